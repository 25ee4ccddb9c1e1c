"""Prompts in, texts out: encoding and checking the prompts, decoding them in one batch, and the timing."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.generation.decode import decode
from torchtitan.generation.loading import Loaded, Source
from torchtitan.generation.sampling import Sampling


@dataclass
class Output:
    """One prompt's result: its ids as the model saw them, the new ids and their text."""

    prompt: str
    prompt_tokens: list[int]
    tokens: list[int]
    text: str


def prompt_ids(loaded: Loaded | Source, prompts: list[str]) -> list[list[int]]:
    """Each prompt's ids (BOS first); ValueError (one line) for a prompt the model cannot continue."""
    if not prompts:
        raise ValueError("no prompt given; pass --prompt TEXT or --prompts_file FILE")
    out = []
    limit = loaded.args.max_seq_len
    for i, prompt in enumerate(prompts):
        ids = loaded.tokenizer.encode(prompt, bos=True, eos=False)
        if len(ids) >= limit:
            raise ValueError(f"prompt {i + 1} has {len(ids)} tokens, not shorter than the model's max_seq_len "
                             f"({limit}); shorten it")
        out.append(ids)
    return out


def generate(loaded: Loaded, prompts: list[str], max_new_tokens: int, sampling: Sampling,
             use_cache: bool = True) -> tuple[list[Output], dict[str, float]]:
    """The continuation of every prompt (batched), and the timing (seconds, tokens/s)."""
    problems = sampling.problems()
    if max_new_tokens < 1:
        problems.append(f"--max_new_tokens={max_new_tokens}: generate at least 1 token")
    if problems:
        raise ValueError("; ".join(problems))
    ids = prompt_ids(loaded, prompts)
    tok = loaded.tokenizer
    pad_id = tok.pad_id if tok.pad_id >= 0 else tok.eos_id
    result = decode(loaded.model, ids, max_new_tokens, sampling, stop_ids=[tok.eos_id],
                    max_len=loaded.args.max_seq_len, use_cache=use_cache, pad_id=pad_id)
    outputs = [Output(p, i, new, tok.decode(t for t in new if t != tok.eos_id))
               for p, i, new in zip(prompts, ids, result.tokens)]
    new_tokens = sum(len(t) for t in result.tokens)
    decoded = new_tokens - len(prompts)  # the first token of each row comes from the prefill
    timing = {"prefill_s": result.prefill_s, "decode_s": result.decode_s, "new_tokens": new_tokens,
              "decode_tokens_per_s": decoded / result.decode_s if result.decode_s > 0 else 0.0,
              "tokens_per_s": new_tokens / (result.prefill_s + result.decode_s)}
    return outputs, timing
