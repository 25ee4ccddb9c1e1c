"""A model's shape read from a release: a Hugging Face ``config.json`` or Meta's ``params.json``.

``--model.flavor`` takes a flavor name or a path: the release folder (holding either file,
or ``original/params.json``) or the file itself. The field mapping is in ``convert.py``;
this module finds and reads the file and refuses what the model cannot represent.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchtitan.models.common.hf_config import read_json_object
from torchtitan.models.llama3 import convert
from torchtitan.models.llama3.args import ModelArgs

HF_ARCHITECTURES = ("LlamaForCausalLM",)


def release_config_file(path: str | Path) -> Path | None:
    """The ``config.json`` / ``params.json`` that ``path`` names or holds (None: neither)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    for candidate in (p / "config.json", p / "params.json", p / "original" / "params.json"):
        if candidate.is_file():
            return candidate
    return None


def args_from_release(path: str | Path, base: ModelArgs | None = None) -> ModelArgs:
    """``ModelArgs`` with every shape ``path``'s release states; ValueError (one line) for what is unsupported."""
    file = release_config_file(path)
    if file is None:
        raise ValueError(f"{path}: neither a flavor name nor a release (no config.json or params.json there)")
    config = read_json_object(file)
    try:
        if "hidden_size" in config or "architectures" in config or "model_type" in config:
            archs = config.get("architectures") or []
            if config.get("model_type", "llama") != "llama" or (archs and not any(a in HF_ARCHITECTURES
                                                                                   for a in archs)):
                raise ValueError(f"{file}: architecture {archs or config.get('model_type')} is not supported; "
                                 f"only {', '.join(HF_ARCHITECTURES)} (Llama 3) releases are")
            fields = convert.fields_from_hf_config(config)
        elif "dim" in config and "n_heads" in config:
            fields = convert.fields_from_meta_params(config)
        else:
            raise ValueError(f"{file}: neither a Hugging Face config.json (hidden_size, ...) nor Meta's params.json "
                             "(dim, n_heads, ...)")
        args = convert.args_with_fields(base or ModelArgs(), fields)
    except KeyError as e:
        raise ValueError(f"{file} lacks the entry {e}") from None
    except ValueError as e:  # the file is named once, at the front
        raise ValueError(str(e) if str(e).startswith(str(file)) else f"{file}: {e}") from None
    max_pos = config.get("max_position_embeddings")
    return dataclasses.replace(args, max_seq_len=max_pos) if isinstance(max_pos, int) else args
