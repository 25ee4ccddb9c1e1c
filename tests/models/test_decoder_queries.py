"""The typed queries that generic code asks of every family's args (``models/common/config.py``) and model
parts (``distributed/fsdp.py``, ``distributed/compile.py``), instead of probing for one family's fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.compile import apply_compile, wait_for_embedding_output
from torchtitan.distributed.fsdp import apply_fsdp
from torchtitan.models import model_args, model_names

FAMILIES = model_names()


@pytest.mark.parametrize("name", FAMILIES)
def test_first_layers_keep_each_layers_attention(name):
    """The planner's shorter stand-in (planning/repeats.py) keeps its first blocks as they were, GPT-OSS's
    window pattern included."""
    args = model_args(name, "debugmodel")
    short = args.with_first_layers(2)
    assert type(short) is type(args) and short.n_layers == 2 and args.n_layers > 2
    assert [short.layer_attention(i) for i in range(2)] == [args.layer_attention(i) for i in range(2)]


@pytest.mark.parametrize("name", FAMILIES)
def test_only_deepseek_v3_predicts_further_tokens(name):
    args = model_args(name, "debugmodel")
    assert args.has_mtp == (name == "deepseek_v3")
    assert args.mtp_depths == 0
    if args.has_mtp:
        assert dataclasses.replace(args, num_mtp_layers=2).mtp_depths == 2


def test_parallelisms_refuse_a_model_that_is_not_a_decoder():
    """FSDP and compile read the blocks a family's model states (a ``Decoder``); any other module is
    refused, naming the caller."""
    module = torch.nn.Linear(2, 2)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    for apply in (apply_compile, wait_for_embedding_output,
                  lambda m: apply_fsdp(m, dims, JobConfig(), "cpu")):
        with pytest.raises(TypeError, match="a family built \\(a Decoder\\), not a Linear"):
            apply(module)
