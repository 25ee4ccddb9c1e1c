"""Turn a checkpoint folder (any layout, any kind) into one ``torch.save`` file of full model weights.

    python scripts/export_checkpoint.py outputs/checkpoint/step-1000 llama3.pt

The output is a plain ``{parameter FQN: tensor}`` state dict in the dtype the
checkpoint holds (``export_dtype`` for a weights-only export), which a single-process
``Transformer(args).load_state_dict(torch.load("llama3.pt"))`` accepts. It runs on one
process with no process group; it needs the memory for the whole model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a committed checkpoint folder, e.g. outputs/checkpoint/step-1000")
    parser.add_argument("output", help="the torch.save file to write")
    args = parser.parse_args(argv)
    from torchtitan.checkpoint import export_model_weights

    try:
        weights = export_model_weights(args.checkpoint, args.output)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(t.numel() for t in weights.values())
    print(f"wrote {args.output}: {len(weights)} tensors, {total:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
