"""Export a checkpoint folder (any layout, any kind): a Hugging Face folder, or one ``torch.save`` file.

    python scripts/export_checkpoint.py outputs/checkpoint/step-1000 llama3_hf --format hf
    python scripts/export_checkpoint.py outputs/checkpoint/step-1000 llama3.pt

``--format hf`` writes safetensors shards with their index, a ``config.json`` for
``LlamaForCausalLM``, a ``generation_config.json`` (BOS/EOS) and the tokenizer files (Hugging
Face ones beside the weights; Meta's tiktoken file as ``original/tokenizer.model``, a SentencePiece model
as ``tokenizer.model``, and either converted to the ``tokenizer.json`` + ``tokenizer_config.json`` that
``AutoTokenizer`` reads, or a warning line saying why not), into a new or empty folder. The weights are
read as the trainer and generation read them (``load_into``), the routing bias included. ``--dtype
bfloat16|float32`` sets the weights' dtype; by default it is that of the release the run started
from (``checkpoint.initial_load_path``), else bfloat16. A tied model writes no ``lm_head.weight``. A MoE
trained with the routing bias (``--moe.load_balance_coeff``) is refused where the family's format has no
place for the bias (Qwen3-MoE, Mixtral, GPT-OSS), unless ``--drop_routing_bias`` accepts the difference. The model
config (flavor, tokenizer) is the run's ``config.toml``, found next to the checkpoint
folder (``<dump_folder>/config.toml``) or given with ``--config``.

``--format torch`` (the default) writes a plain ``{parameter FQN: tensor}`` state dict in
the dtype the checkpoint holds, which ``Transformer(args).load_state_dict(torch.load(...))``
accepts. Both run on one process with no process group and need the memory for the whole model.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def export_dtype(choice: str | None, cfg):
    """``--dtype``, else the dtype of the release the run started from (initial_load_path), else bfloat16."""
    import torch

    from torchtitan.checkpoint.formats import release_dtype
    from torchtitan.config.dtypes import DTYPES

    if choice is not None:
        return DTYPES[choice]
    ck = cfg.checkpoint
    if ck.initial_load_path and ck.initial_load_format in ("hf", "meta"):
        found = release_dtype(ck.initial_load_path, ck.initial_load_format)
        if found is not None:
            return found
    return torch.bfloat16


def export_hf(checkpoint: Path, output: Path, config: Path | None, tokenizer_path: str | None,
              max_shard_gib: float, dtype: str | None = None, drop_routing_bias: bool = False) -> str:
    import torch

    from torchtitan.checkpoint.formats import check_export_target, find_run_config, load_model, model_shape_differences
    from torchtitan.checkpoint.formats import export_hf as write_hf
    from torchtitan.config import ConfigManager
    from torchtitan.datasets import build_tokenizer
    from torchtitan.launch_plan import configured_model_args

    problem = check_export_target(output)
    if problem:
        raise ValueError(problem)
    config = config or find_run_config(checkpoint)
    if config is None:
        raise ValueError(f"no config.toml found above {checkpoint}; pass the run's config with --config")
    cfg = ConfigManager().parse_args(["--job.config_file", str(config)])
    tokenizer = build_tokenizer(tokenizer_path or cfg.model.tokenizer_path)
    args, _ = configured_model_args(cfg, tokenizer)  # its problems (the run's layout) do not matter here
    # Parameters and persistent buffers (an MoE router's bias: the format decides whether it is written).
    differ = model_shape_differences(checkpoint, args)
    if differ:
        fqn, found, expected = differ[0]
        raise ValueError(f"{checkpoint} does not hold a {cfg.model.flavor} model with the vocabulary of "
                         f"{tokenizer.model_path} ({len(differ)} tensors differ, e.g. {fqn}: {found} vs {expected}); "
                         "pass the run's --config")
    # Read as generation and the trainer read it (load_into); the full model on this one process.
    model = load_model(checkpoint, "dcp", args, device=torch.device("cpu"))
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:
        weights.pop("output.weight", None)  # the state dict names the one tied tensor twice
    files = write_hf(weights, args, output, tokenizer=tokenizer, max_shard_bytes=int(max_shard_gib * 2**30),
                     dtype=export_dtype(dtype, cfg), drop_routing_bias=drop_routing_bias)
    total = sum(t.numel() for t in weights.values())
    return f"wrote {output}: {len(files)} files, {len(weights)} tensors, {total:,} parameters"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a committed checkpoint folder, e.g. outputs/checkpoint/step-1000")
    parser.add_argument("output", help="the torch.save file, or with --format hf the folder, to write")
    parser.add_argument("--format", choices=("torch", "hf"), default="torch", help="what to write (default torch)")
    parser.add_argument("--config", type=Path, default=None,
                        help="the run's config.toml (default: the one in the dump folder above the checkpoint)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the config's)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="--format hf: dtype of the weights (default: that of the release the run started "
                             "from, else bfloat16)")
    parser.add_argument("--drop_routing_bias", action="store_true",
                        help="--format hf: export a model trained with the routing bias (--moe.load_balance_coeff) "
                             "to a format without a place for it, accepting that the export routes otherwise")
    parser.add_argument("--max_shard_gib", type=float, default=5.0, help="largest safetensors shard (GiB)")
    args = parser.parse_args(argv)
    # The export's warnings (a tokenizer it could not convert) as one line each on stderr.
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    from torchtitan.checkpoint.location import is_remote

    if is_remote(args.checkpoint) or is_remote(args.output):
        print(f"error: {args.checkpoint if is_remote(args.checkpoint) else args.output} is an object-store URI; "
              "the export reads and writes local folders only: copy the step folder to a local disk first "
              "(e.g. aws s3 cp --recursive)", file=sys.stderr)
        return 2
    try:
        if args.format == "hf":
            print(export_hf(Path(args.checkpoint), Path(args.output), args.config, args.tokenizer,
                            args.max_shard_gib, args.dtype, args.drop_routing_bias))
            return 0
        from torchtitan.checkpoint import export_model_weights

        weights = export_model_weights(args.checkpoint, args.output)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(t.numel() for t in weights.values())
    print(f"wrote {args.output}: {len(weights)} tensors, {total:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
