"""A model and its tokenizer for generation, from any of the three formats the project reads.

- a checkpoint of this project (``dcp``): a committed ``step-N`` folder or a checkpoint folder (its
  latest step), saved in any layout; the model config and tokenizer are those of the run's
  ``config.toml`` in the dump folder above it (or ``--config``);
- a Hugging Face folder (``hf``): ``config.json`` + safetensors, with its ``tokenizer.json``;
- Meta's release folder (``meta``): ``params.json`` + ``consolidated.*.pth``, with its ``tokenizer.model``.

The family comes from the run's ``model.name`` or, for a release, from the first registered family
that reads it. Weights load as the trainer's do, through ``checkpoint/formats.py``'s ``load_model``
(``load_into``): DCP reshards into one process, or into the tensor-parallel layout when a ``tp_mesh`` is
given; the routing bias is read with the weights and the rotary table rebuilt before the read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.checkpoint.formats import (
    HFSource,
    expected_shapes,
    find_run_config,
    load_model,
    model_shape_differences,
)
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer, resolve_tokenizer_path
from torchtitan.models import DecoderConfig, get_model_spec, model_names
from torchtitan.models.spec import ModelSpec

FORMATS = ("dcp", "hf", "meta")


@dataclass
class Loaded:
    """What generation needs: the model (eval mode, weights loaded), its args and family, the tokenizer."""

    model: nn.Module
    args: DecoderConfig
    spec: ModelSpec
    tokenizer: Tokenizer
    fmt: str


def checkpoint_format(path: Path) -> str:
    """``dcp``, ``hf`` or ``meta``; ValueError (one line) for a folder that is none of them."""
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder; give a checkpoint of this project (step-N or its checkpoint "
                         "folder), a Hugging Face folder or a Meta release folder")
    if (path / ".metadata").is_file() or any(p.name.startswith("step-") for p in path.iterdir()):
        return "dcp"
    if (path / "config.json").is_file():
        return "hf"
    if (path / "params.json").is_file() or (path / "original" / "params.json").is_file():
        return "meta"
    raise ValueError(f"{path}: neither a checkpoint of this project (.metadata, or step-N folders), a Hugging Face "
                     "folder (config.json + *.safetensors) nor a Meta release (params.json + consolidated.*.pth)")


def _run_args(path: Path, config: Path | None,
              tokenizer_path: str | None) -> tuple[DecoderConfig, ModelSpec, Tokenizer]:
    """A project checkpoint's model args, family and tokenizer, from its run's config.toml."""
    from torchtitan.config import ConfigManager
    from torchtitan.launch_plan import configured_model_args

    config = config or find_run_config(path)
    if config is None:
        raise ValueError(f"{path}: no config.toml in the dump folder above it; pass the run's config with --config")
    cfg = ConfigManager().parse_args(["--job.config_file", str(config)])
    tokenizer = build_tokenizer(tokenizer_path or cfg.model.tokenizer_path)
    args, _ = configured_model_args(cfg, tokenizer)  # the run's layout problems do not matter here
    return args, get_model_spec(cfg.model.name), tokenizer


def _release_args(path: Path, model_name: str | None) -> tuple[DecoderConfig, ModelSpec]:
    """A release's args and the family that reads it (``model_name``, else the first that can)."""
    errors = []
    for name in [model_name] if model_name else model_names():
        spec = get_model_spec(name)
        try:
            return spec.read_release(str(path)), spec
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(errors[0] if len(errors) == 1 else f"{path}: no model family reads it ({'; '.join(errors)})")


def _check_weights(path: Path, fmt: str, args: DecoderConfig, spec: ModelSpec, tokenizer: Tokenizer) -> None:
    """The weights must be usable before any is read: a project checkpoint must hold the model of its args (whose
    vocabulary is the tokenizer's); a release must hold every token id of the tokenizer, and no float8 weight
    without its scales."""
    if fmt == "hf":
        source = HFSource(path, spec.state_dict_adapter)
        float8 = source.float8_problems(expected_shapes(args), args)
        if float8:
            raise ValueError(float8[0])
    if fmt != "dcp":
        if tokenizer.n_words > args.vocab_size:
            raise ValueError(f"tokenizer {tokenizer.model_path} has {tokenizer.n_words} tokens, more than the "
                             f"vocabulary of {path} ({args.vocab_size}); use the release's own tokenizer")
        return
    differ = model_shape_differences(path, args)
    if differ:
        fqn, found, expected = differ[0]
        raise ValueError(f"tokenizer {tokenizer.model_path} ({tokenizer.n_words} tokens) does not match the "
                         f"vocabulary of {path} ({fqn} is {found}, expected {expected}); use the tokenizer the run "
                         "trained with")


@dataclass
class Source:
    """What ``path`` holds, found without reading its weights: format, family, args, tokenizer."""

    path: Path
    fmt: str
    args: DecoderConfig
    spec: ModelSpec
    tokenizer: Tokenizer


def describe(path: str | Path, *, config: Path | None = None, tokenizer_path: str | None = None,
             model_name: str | None = None) -> Source:
    """Read ``path``'s format, model and tokenizer; ValueError (one line) for what generation cannot use."""
    path = Path(path).expanduser()
    fmt = checkpoint_format(path)
    if fmt == "dcp":
        args, spec, tokenizer = _run_args(path, config, tokenizer_path)
    else:
        args, spec = _release_args(path, model_name)
        if tokenizer_path is None:
            try:
                tokenizer_path = resolve_tokenizer_path(str(path))
            except FileNotFoundError:
                raise ValueError(f"{path} holds no tokenizer (tokenizer.json, tokenizer.model or "
                                 "original/tokenizer.model); pass the release's with --tokenizer") from None
        tokenizer = build_tokenizer(tokenizer_path)
    _check_weights(path, fmt, args, spec, tokenizer)
    if not spec.model.supports_kv_cache:
        raise ValueError(f"model family {spec.name} has no KV-cache forward; generation cannot run it")
    return Source(path, fmt, args, spec, tokenizer)


def load(source: Source, *, device: torch.device, dtype: torch.dtype = torch.float32,
         tp_mesh: DeviceMesh | None = None) -> Loaded:
    """The model of ``source`` on ``device`` in ``dtype`` (tensor-parallel over ``tp_mesh`` when given)."""
    model = load_model(source.path, source.fmt, source.args, device=device, dtype=dtype, tp_mesh=tp_mesh)
    return Loaded(model, source.args, source.spec, source.tokenizer, source.fmt)
