"""The three tokenizer backends, picked by content, against the libraries' own encodings.

The test trains a tiny byte-level BPE with ``tokenizers`` (Llama 3's split pattern), saves it
as a Hugging Face ``tokenizer.json`` folder and as a Meta-style tiktoken ``tokenizer.model``
(the same ranks, base64 lines), and checks each backend against ``tokenizers`` / ``tiktoken``.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from torchtitan.datasets.tokenizer import (
    LLAMA3_SPLIT_PATTERN,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
    llama3_special_tokens,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.\nIt's 2024; numbers like 123456 split in threes.",
    "Naïve café owners in Zürich serve crème brûlée — 東京 and Москва too. ",
    "def main():\n    return {'a': 1, \"b\": [2, 3]}\n\n\n",
] * 20
TEXTS = [
    "Hello world!\n\nNew paragraph\twith tabs  and   spaces.",
    "Non-ASCII: naïve café, 東京タワー, Москва, emoji 🙂 and é decomposed e\u0301.",
    "Special tokens as text: <|begin_of_text|>hi<|end_of_text|> <|eot_id|>\n",
    "I'll we've they're SHOUTING'S 1234567 x\r\ny",
    "",
]


def _train_bpe():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _byte_of_char() -> dict[str, int]:
    """Inverse of byte-level BPE's printable stand-ins for the 256 bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    tok = _train_bpe()
    # Meta-style tiktoken file: ranks in id order (the trainer's merge order), base64 of the bytes.
    to_byte = _byte_of_char()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tiktoken_file = root / "original" / "tokenizer.model"
    tiktoken_file.parent.mkdir()
    tiktoken_file.write_text("".join(f"{base64.b64encode(bytes(to_byte[c] for c in token)).decode()} {rank}\n"
                                     for token, rank in vocab))
    # Hugging Face folder: the same BPE plus the special tokens after the ranks, as Llama 3 lays them out.
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True) for t in llama3_special_tokens()[:12]])
    hf_dir = root / "hf"
    hf_dir.mkdir()
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}}))
    return {"tiktoken": tiktoken_file, "hf": hf_dir, "n_ranks": len(vocab), "root": root}


def test_tiktoken_file_matches_tiktoken(files) -> None:
    import tiktoken

    # Named nothing like a tiktoken file: the content decides.
    renamed = files["root"] / "tok.bin"
    shutil.copy(files["tiktoken"], renamed)
    tok = build_tokenizer(str(renamed))
    assert isinstance(tok, TiktokenTokenizer)
    n = files["n_ranks"]
    assert tok.n_words == n + 256
    assert (tok.bos_id, tok.eos_id) == (n, n + 1)
    assert tok.special_tokens["<|eot_id|>"] == n + 9
    lines = files["tiktoken"].read_text().splitlines()
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines)}
    reference = tiktoken.Encoding("ref", pat_str=LLAMA3_SPLIT_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={t: n + i for i, t in enumerate(llama3_special_tokens())})
    for text in TEXTS:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids == [n] + reference.encode(text, disallowed_special=()) + [n + 1], text
        assert tok.decode(ids) == text
    # Special-token text in the data stays text: no control ids appear.
    assert max(tok.encode(TEXTS[2], bos=False, eos=False)) < n


def test_hf_tokenizer_json_matches_tokenizers(files) -> None:
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(files["hf"] / "tokenizer.json"))
    reference.encode_special_tokens = True
    for path in (files["hf"], files["hf"] / "tokenizer.json"):  # the folder or the file
        tok = build_tokenizer(str(path))
        assert isinstance(tok, HFTokenizer)
        n = files["n_ranks"]
        assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (n + 12, n, n + 1, -1)
        for text in TEXTS:
            ids = tok.encode(text, bos=True, eos=False)
            assert ids == [n] + reference.encode(text, add_special_tokens=False).ids, text
            assert tok.decode(ids) == text
        assert max(tok.encode(TEXTS[2], bos=False, eos=False)) < n
    # The same BPE in both formats gives the same ids.
    tiktoken_tok = build_tokenizer(str(files["tiktoken"]))
    for text in TEXTS:
        assert tok.encode(text, bos=False, eos=False) == tiktoken_tok.encode(text, bos=False, eos=False), text


def test_shipped_sentencepiece_still_picked(shipped_tokenizer) -> None:
    assert isinstance(build_tokenizer(shipped_tokenizer), SentencePieceTokenizer)


def test_unknown_or_broken_tokenizers_name_the_formats(files, tmp_path) -> None:
    garbage = tmp_path / "tokenizer.model"
    garbage.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError) as e:
        build_tokenizer(str(garbage))
    for fmt in ("SentencePiece", "tiktoken", "Hugging Face tokenizer.json"):
        assert fmt in str(e.value)
    bad_line = tmp_path / "bad_tiktoken.model"
    bad_line.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match="line 2 is not 'base64-token rank'"):
        build_tokenizer(str(bad_line))
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(files["hf"] / "tokenizer.json", no_config / "tokenizer.json")
    with pytest.raises(ValueError, match="no tokenizer_config.json"):
        build_tokenizer(str(no_config))
    (no_config / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    with pytest.raises(ValueError, match="bos_token '<s>' is not a token"):
        build_tokenizer(str(no_config))


def test_export_copies_hf_and_tiktoken_tokenizers(files, tmp_path) -> None:
    """An HF export carries the tokenizer: tokenizer.json beside the weights, Meta's file in original/."""
    from torchtitan.checkpoint.formats import export_hf
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.llama3 import ModelArgs

    for name, path, copied in (("hf", files["hf"], "tokenizer.json"),
                               ("tiktoken", files["tiktoken"], "original/tokenizer.model")):
        tok = build_tokenizer(str(path))
        args = ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=tok.n_words, multiple_of=16, max_seq_len=8)
        out = tmp_path / name
        export_hf(Decoder(args).state_dict(), args, out, tokenizer=tok)
        again = build_tokenizer(str(out / copied))
        assert type(again) is type(tok)
        for text in TEXTS:
            assert again.encode(text, bos=True, eos=True) == tok.encode(text, bos=True, eos=True)
        config = json.loads((out / "config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (tok.bos_id, tok.eos_id,
                                                                                          tok.n_words)
        if name == "tiktoken":  # (the HF fixture's config spells eos as a dict, which transformers 5 refuses)
            _assert_autotokenizer_encodes_like(out, tok)


def _assert_autotokenizer_encodes_like(folder: Path, tok) -> None:
    """transformers opens the export (Meta's file converted to tokenizer.json) and encodes/decodes as we do."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(folder)
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (tok.bos_id, tok.eos_id, tok.n_words)
    for text in TEXTS:
        if "<|" in text:  # transformers reads special-token text as the token; this project as text
            continue
        ids = tok.encode(text, bos=True, eos=True)
        assert theirs(text)["input_ids"] == ids[:-1], text  # BOS added, as the releases do
        assert theirs.encode(text, add_special_tokens=False) == ids[1:-1], text
        assert theirs.decode(ids, skip_special_tokens=True) == tok.decode(ids) == text


def test_release_folders_and_declared_specials(files, tmp_path) -> None:
    """A release's original/ folder or the release folder is a tokenizer path; specials that only
    tokenizer_config.json declares decode to nothing; a Git LFS pointer is named as such."""
    release = files["root"]  # holds original/tokenizer.model and no tokenizer.json
    for path in (release, release / "original"):
        tok = build_tokenizer(str(path))
        assert isinstance(tok, TiktokenTokenizer) and tok.model_path == str(release / "original" / "tokenizer.model")
    # The specials are plain added tokens in tokenizer.json; only tokenizer_config.json says they are special.
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(files["hf"] / "tokenizer.json"))
    data = json.loads(plain.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = False
    folder = tmp_path / "unmarked"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "added_tokens_decoder": {str(files["n_ranks"] + 9): {"content": "<|eot_id|>", "special": True}}}))
    tok = build_tokenizer(str(folder))
    n = files["n_ranks"]
    assert tok.decode([n, *tok.encode("hi there", bos=False, eos=False), n + 9, n + 1]) == "hi there"
    pointer = tmp_path / "lfs" / "tokenizer.model"
    pointer.parent.mkdir()
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 2183982\n")
    with pytest.raises(ValueError) as e:
        build_tokenizer(str(pointer.parent))
    assert str(e.value) == (f"{pointer} is a Git LFS pointer, not the file itself: run `git lfs pull` or download "
                            "it again")


def test_token_store_prepares_with_every_backend(files, tmp_path) -> None:
    """The store holds each document as the backend encodes it (BOS + text + EOS), and
    a Hugging Face folder is fingerprinted by its files, so a changed tokenizer is refused."""
    from torchtitan.datasets.prepare import prepare_store
    from torchtitan.datasets.sources import TokenStoreError
    from torchtitan.datasets.token_store import TokenStore

    docs = [t for t in CORPUS if t]
    for name in ("tiktoken", "hf"):
        tokenizer = build_tokenizer(str(files[name]))
        out = prepare_store(documents=iter(docs), out_dir=tmp_path / name, tokenizer_path=str(files[name]),
                            source={"fingerprint": "test"}, progress=False)
        store = TokenStore(out)
        expected = [i for d in docs for i in tokenizer.encode(d, bos=True, eos=True)]
        assert store.read(0, store.n_tokens).tolist() == expected, name
        store.check_tokenizer(str(files[name]), tokenizer.n_words)
    changed = tmp_path / "hf_changed"
    changed.mkdir()
    (changed / "tokenizer.json").write_text(
        (files["hf"] / "tokenizer.json").read_text().replace('"<|eot_id|>"', '"<|eot|>"'))
    (changed / "tokenizer_config.json").write_text((files["hf"] / "tokenizer_config.json").read_text())
    with pytest.raises(TokenStoreError, match="prepared with the tokenizer"):
        TokenStore(tmp_path / "hf").check_tokenizer(str(changed), build_tokenizer(str(changed)).n_words)
