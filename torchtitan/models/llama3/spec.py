"""Llama 3's ``ModelSpec``: how the rest of the code builds, parallelizes, splits, checks and converts
a Llama 3 model. Registered under ``--model.name=llama3``."""

from __future__ import annotations

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common import parallel as common_parallel
from torchtitan.models.common.decoder_spec import decoder_spec
from torchtitan.models.llama3.adapter import Llama3StateDictAdapter
from torchtitan.models.llama3.args import ModelArgs, llama3_flavors
from torchtitan.models.llama3.model import Attention, Transformer, ffn_hidden_dim, flops_per_token
from torchtitan.models.llama3.parallelize import apply_cp, apply_tp
from torchtitan.models.llama3.release import args_from_release
from torchtitan.models.registry import register_model_spec

prune_stage = common_parallel.prune_stage  # shared by the decoders (models/common/parallel.py)


def check(args: ModelArgs, dims: ParallelDims, cfg: JobConfig) -> list[str]:
    """Llama 3's preflight problems: widths that tensor parallelism must divide, and tying under PP."""
    problems: list[str] = []
    tp = dims.tp
    if tp > 1:
        n_kv = args.n_kv_heads or args.n_heads
        for what, value in [("n_heads", args.n_heads), ("n_kv_heads", n_kv), ("dim", args.dim),
                            ("FFN hidden size", ffn_hidden_dim(args))]:
            if value % tp:
                problems.append(f"--parallelism.tensor_parallel_degree={tp}: the model's {what} ({value}) is not "
                                f"divisible by it; pick a degree that divides {what}")
        if args.vocab_size % tp:
            # Padding the vocabulary would change the parameter shapes (and checkpoints) with the layout.
            problems.append(f"--parallelism.tensor_parallel_degree={tp}: vocab size {args.vocab_size} is not divisible "
                            f"by it (the vocabulary is not padded); pick a degree that divides {args.vocab_size}")
    if args.tie_word_embeddings and cfg.parallelism.pipeline_parallel_degree > 1:
        # The embedding and the output live on the first and last stage; nothing keeps two copies equal.
        problems.append(f"--model.flavor={cfg.model.flavor} ties the output projection to the embedding, which "
                        "pipeline parallelism does not support (they live on different stages); use "
                        "--parallelism.pipeline_parallel_degree=1 (FSDP, HSDP, DDP, TP and CP all train it tied)")
    return problems


# A decoder like the shared one (models/common/decoder_spec.py), with Llama 3's own model, plans and checks.
SPEC = decoder_spec("llama3", ModelArgs, llama3_flavors, args_from_release, build=Transformer,
                    flops_per_token=flops_per_token, attention=Attention, apply_tp=apply_tp, apply_cp=apply_cp,
                    check=check, state_dict_adapter=Llama3StateDictAdapter())
register_model_spec(SPEC)

__all__ = ["SPEC", "check", "prune_stage"]
