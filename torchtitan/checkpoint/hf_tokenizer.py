"""The run's tokenizer as Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``, for an export.

An export must open with ``AutoTokenizer.from_pretrained``, which reads neither Meta's tiktoken file nor
a SentencePiece model as such. Both are converted by ``transformers``' own converters:

- Meta's tiktoken ``tokenizer.model``: ``TikTokenConverter`` (byte-level BPE with the Llama 3 split
  pattern); the 256 special tokens keep their ids after the ranks, BOS is added on
  ``add_special_tokens=True`` as the Llama 3 releases do;
- a SentencePiece model (the project's own tokenizer): ``SpmConverter.build_tokenizer_from_spm_proto``,
  which follows the model's own normalizer, dummy prefix and byte fallback; its control and unknown
  pieces become special tokens, and BOS is added on ``add_special_tokens=True``. The converted tokenizer
  must encode a sample of texts exactly as SentencePiece does, or it is not written.

``tokenizer_config.json`` names BOS/EOS and marks every special token, so ``decode(...,
skip_special_tokens=True)`` drops them. What cannot be converted raises ``NotConverted``, one line saying
why; the export then goes on without ``tokenizer.json`` and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan.datasets.tokenizer import SentencePieceTokenizer, Tokenizer

# Texts a converted tokenizer must encode exactly as the original: spaces (leading, runs, tabs, newlines),
# digits, punctuation, accents, other scripts and an emoji (byte fallback).
SAMPLE_TEXTS = ("Once upon a time", "  two  spaces,\ttabs\n\nand newlines ", "digits 12345 and 3.14159",
                "héllo wörld, ñandú, 日本語, emoji 🙂", "def f(x):\n    return x ** 2  # squared",
                " leading space", "trailing space ")


class NotConverted(ValueError):
    """The run's tokenizer could not be written as ``tokenizer.json``; the message says why, in one line."""


def _config(bos: str, eos: str, specials: dict[str, int], model_max_length: int, **extra: object) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": model_max_length, **extra,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in specials.items()},
    }


def write_hf_tokenizer(tokenizer: Tokenizer, out: Path, model_max_length: int) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a tiktoken or SentencePiece tokenizer into
    ``out``; ``NotConverted`` (one line) when it cannot be done faithfully."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return _write_sentencepiece(tokenizer, out, model_max_length)
    return _write_tiktoken(tokenizer, out, model_max_length)


def _write_tiktoken(tokenizer, out: Path, model_max_length: int) -> list[Path]:  # noqa: ANN001 - a TiktokenTokenizer
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
    config = _config(bos, "<|end_of_text|>", {t: tokenizer.special_tokens[t] for t in specials}, model_max_length,
                     clean_up_tokenization_spaces=True)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return [out / "tokenizer.json", out / "tokenizer_config.json"]


def _write_sentencepiece(tokenizer: SentencePieceTokenizer, out: Path, model_max_length: int) -> list[Path]:
    where = f"{out}: no tokenizer.json written ({tokenizer.model_path} is a SentencePiece model"
    try:
        from tokenizers import AddedToken, processors
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
    except ImportError as e:
        raise NotConverted(f"{where}; converting it needs transformers: {e})") from None
    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        raise NotConverted(f"{where}; this transformers has no SpmConverter.build_tokenizer_from_spm_proto, which "
                           "converts it following its own settings: upgrade transformers)")
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(tokenizer.model_path))
    pieces = [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    # protobuf's generated classes are made at import time: pyright sees none of their attributes.
    proto = import_protobuf().ModelProto()  # pyright: ignore[reportAttributeAccessIssue]
    proto.ParseFromString(Path(tokenizer.model_path).read_bytes())  # pyright: ignore[reportAttributeAccessIssue]
    hf = SpmConverter.build_tokenizer_from_spm_proto(proto, {piece: i for i, piece in enumerate(pieces)})
    if hf is None:
        raise NotConverted(f"{where}; transformers cannot convert its model type)")
    # BOS, EOS (and pad) are control pieces; with the unknown piece they decode to nothing.
    specials = {pieces[i]: i for i in range(len(pieces)) if sp.is_control(i) or sp.is_unknown(i)}
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos, eos = pieces[tokenizer.bos_id], pieces[tokenizer.eos_id]
    hf.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                      special_tokens=[(bos, tokenizer.bos_id)])
    for text in SAMPLE_TEXTS:
        if hf.encode(text, add_special_tokens=False).ids != tokenizer.encode(text, bos=False, eos=False):
            raise NotConverted(f"{where}; transformers' conversion encodes {text!r} otherwise)")
    if {t: hf.token_to_id(t) for t in specials} != specials:
        raise NotConverted(f"{where}; its special tokens' ids moved in the conversion)")
    hf.save(str(out / "tokenizer.json"))
    extra: dict[str, object] = {}
    if sp.unk_id() >= 0:
        extra["unk_token"] = pieces[sp.unk_id()]
    if tokenizer.pad_id >= 0:
        extra["pad_token"] = pieces[tokenizer.pad_id]
    config = _config(bos, eos, specials, model_max_length, **extra)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return [out / "tokenizer.json", out / "tokenizer_config.json"]
