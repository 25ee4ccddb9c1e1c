"""Meta's tiktoken ``tokenizer.model`` as Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``.

An export must open with ``AutoTokenizer.from_pretrained``, which cannot read Meta's file.
The BPE is converted by ``transformers``' own ``TikTokenConverter`` (byte-level BPE with the
Llama 3 split pattern); the 256 special tokens keep their ids after the ranks, BOS is added
on ``add_special_tokens=True`` as the Llama 3 releases do, and ``tokenizer_config.json`` names
BOS/EOS and marks every special token, so ``decode(..., skip_special_tokens=True)`` drops them.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_hf_tokenizer(tokenizer, out: Path, model_max_length: int) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a ``TiktokenTokenizer`` into ``out``."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from torchtitan.datasets.tokenizer import LLAMA3_SPLIT_PATTERN, read_tiktoken_ranks

    class _Converter(TikTokenConverter):
        # The project's own parser: tiktoken's loader caches files by path in a temporary folder.
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return read_tiktoken_ranks(str(tiktoken_url))

    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    hf = _Converter(vocab_file=str(tokenizer.model_path), pattern=LLAMA3_SPLIT_PATTERN,
                    extra_special_tokens=specials).converted()
    bos = "<|begin_of_text|>"
    hf.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tokenizer.bos_id)]),
    ])
    wrong = {t: hf.token_to_id(t) for t in specials if hf.token_to_id(t) != tokenizer.special_tokens[t]}
    if wrong:  # the converter appends specials after the ranks; a gap in the ranks would shift them
        raise ValueError(f"converting {tokenizer.model_path}: special token ids moved ({len(wrong)}, e.g. {wrong})")
    hf.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|end_of_text|>",
        "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "added_tokens_decoder": {str(tokenizer.special_tokens[t]): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True} for t in specials},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return [out / "tokenizer.json", out / "tokenizer_config.json"]
