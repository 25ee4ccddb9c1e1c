"""The one abstract root of every family's arguments (``models/common/config.py`` ``DecoderConfig``): it cannot
be built or registered, it holds only what the shared decoder reads, and every family subclasses it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from torchtitan.models import get_model_spec, model_names
from torchtitan.models.common.args import MoEDecoderArgs
from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import ModelArgs
from torchtitan.models.spec import ModelSpec

COMMON = Path(__file__).resolve().parents[2] / "torchtitan" / "models" / "common"
# The shared decoder's code: the model, its FLOPs and its parallel plans (args.py and config.py declare the
# fields; hf_config.py reads a family's own table of them).
SHARED_CODE = ("decoder.py", "flops.py", "parallel.py", "weight_map.py", "hf.py")


def _attributes_read(files: tuple[str, ...]) -> set[str]:
    names: set[str] = set()
    for name in files:
        tree = ast.parse((COMMON / name).read_text())
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    return names


@pytest.mark.parametrize("abstract", [DecoderConfig, MoEDecoderArgs])
def test_an_abstract_args_class_is_neither_built_nor_registered(abstract):
    fields = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 128, "norm_eps": 1e-5, "rope_theta": 1e4,
              "max_seq_len": 32}
    with pytest.raises(TypeError, match="abstract"):
        abstract(**fields)
    llama = get_model_spec("llama3")
    with pytest.raises(TypeError) as info:
        ModelSpec(name="root", model=Decoder, args_type=abstract, flavors={}, read_release=llama.read_release,
                  state_dict_adapter=llama.state_dict_adapter)
    assert str(info.value) == (f"model family 'root': args_type {abstract.__name__} is abstract (the shared root or "
                               "base of families' arguments); give the family's own args class")


def test_the_root_holds_only_fields_the_shared_decoder_reads():
    root = {f.name for f in dataclasses.fields(DecoderConfig)}
    unread = root - _attributes_read(SHARED_CODE)
    assert not unread, f"fields of the args root that the shared decoder never reads (a family's?): {sorted(unread)}"


def test_every_family_adds_its_own_fields_to_the_root():
    root = {f.name for f in dataclasses.fields(DecoderConfig)}
    for name in model_names():
        args_type = get_model_spec(name).args_type
        assert issubclass(args_type, DecoderConfig) and not inspect.isabstract(args_type), name
        assert root < {f.name for f in dataclasses.fields(args_type)}, f"{name} adds no field of its own"
    # Llama 3 is no MoEDecoderArgs: the expert fields are not its (it answers num_experts from the root: 0).
    assert not issubclass(ModelArgs, MoEDecoderArgs) and "top_k" not in {f.name for f in dataclasses.fields(ModelArgs)}
    assert ModelArgs().num_experts == 0
