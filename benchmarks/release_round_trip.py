"""Round trip of real Llama 3 configs: transformers -> this project -> export -> transformers.

    python benchmarks/release_round_trip.py                 # 3.2 1B, 3.2 3B, 3.1 8B; 2 layers, vocab 2048
    python benchmarks/release_round_trip.py --vocab 128256 --releases 3.2-1B,3.2-3B  # the real vocabulary
    python benchmarks/release_round_trip.py --tiny --layers 1 --vocab 64 --seq 8   # checks the script in a second

For each published ``config.json`` (the values of tests/checkpoint/test_releases.py), cut to
``--layers`` layers and ``--vocab`` words, widths and heads as released: ``transformers`` makes
and saves a random model (float32); the project reads the shape from the folder
(``--model.flavor`` path), loads the weights and computes logits; the project's state is
exported (``export_hf``, float32 and bfloat16) and ``transformers`` loads the export. It prints
the parameter counts, whether each side is tied, and the max abs logits differences:
project vs transformers, export vs original, bfloat16 export vs original. One process, CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# The published configs are tests/checkpoint/test_releases.py's; that module imports its folder's helpers.
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "checkpoint"))
from checkpoint.test_releases import PUBLISHED  # noqa: E402

# --tiny: a release's rope, tying and GQA ratio kept, its widths cut.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def measure(name: str, config: dict, folder: Path, tokens: torch.Tensor) -> dict:
    import transformers

    from torchtitan.checkpoint.formats import export_hf, load_into
    from torchtitan.models import model_args
    from torchtitan.models.common.decoder import Decoder

    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    original.save_pretrained(folder / "release")
    with torch.no_grad():
        reference = original(tokens).logits
    args = model_args("llama3", str(folder / "release"))
    ours = Decoder(args).eval()
    load_into(ours, str(folder / "release"), "hf", args)
    with torch.no_grad():
        project = ours(tokens)
    row = {"release": name, "params (transformers)": original.num_parameters(), "params (project)": ours.num_params(),
           "tied": args.tie_word_embeddings, "project vs transformers": (project - reference).abs().max().item()}
    del original
    for dtype in (torch.float32, torch.bfloat16):
        out = folder / f"export-{dtype}".replace("torch.", "")
        export_hf(ours.state_dict(), args, out, dtype=dtype)
        back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        if dtype == torch.float32:
            row["export tied"] = back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
            row["params (export)"] = back.num_parameters()
        with torch.no_grad():
            row[f"export {str(dtype)[6:]} vs original"] = (back(tokens).logits - reference).abs().max().item()
        del back
    row["logits max"] = reference.abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--releases", default="3.2-1B,3.2-3B,3.1-8B", help="comma-separated subset")
    parser.add_argument("--tiny", action="store_true",
                        help="cut the widths too (64 wide, 4 heads of 16, 2 KV heads, FFN 128): checks the script")
    opts = parser.parse_args()
    unknown = [name for name in opts.releases.split(",") if name not in PUBLISHED]
    if unknown:
        parser.error(f"--releases: unknown {', '.join(unknown)}; choose from {', '.join(PUBLISHED)}")
    tokens = torch.randint(0, opts.vocab, (2, opts.seq), generator=torch.Generator().manual_seed(0))
    for name in opts.releases.split(","):
        published = PUBLISHED[name]
        config = {**published, "num_hidden_layers": opts.layers, "vocab_size": opts.vocab, "bos_token_id": 1,
                  "eos_token_id": 2, **(TINY if opts.tiny else {})}
        with tempfile.TemporaryDirectory() as tmp:
            row = measure(name, config, Path(tmp), tokens)
        print(" | ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v:,}" if isinstance(v, int)
                         and not isinstance(v, bool) else f"{k}: {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
