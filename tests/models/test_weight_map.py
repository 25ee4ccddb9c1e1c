"""Declarative weight maps (models/common/weight_map.py): templates with {layer} and {expert}, stacking,
head permutations (whole or partial rotary), and rows that transpose, interleave and unpack.

Each family's map round-trips every parameter of a small model (names and values, bitwise) through the
export and the one reader production uses (``checkpoint/formats.py``, tensor by tensor); the head
permutation is Hugging Face's rotate-halves layout; a partial-rotary permutation leaves the non-rotary rows
alone and permutes the rest as a whole-head one would; two tensors interleaved and transposed in one of
the release's are gathered on export and read back apart, from it or from a packed form of it.
Block-scaled (FP8) weights are read by the same reader: ``tests/models/test_deepseek_v3.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from torchtitan.checkpoint.formats import INDEX_FILE, export_hf, load_model
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.common import weight_map
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.weight_map import PackedFormat, Part, WeightMap, WeightTemplate, permute_rows
from torchtitan.models.spec import StateDictAdapter


@pytest.mark.parametrize("family,flavor", [("llama3", "debugmodel"), ("llama3", "debugmodel_tied"),
                                           ("qwen3", "debugmodel_moe"), ("mixtral", "debugmodel")])
def test_each_family_round_trips_every_parameter_bitwise(family, flavor, tmp_path):
    spec, args = get_model_spec(family), model_args(family, flavor)
    torch.manual_seed(0)
    model = Decoder(args)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items() if not k.endswith("expert_bias")}
    if args.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    export_hf(state, args, tmp_path)
    hf = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert ("lm_head.weight" in hf) == (not args.tie_word_embeddings)
    back = load_model(tmp_path, "hf", args, device=torch.device("cpu")).state_dict()
    params = [k for k, _ in model.named_parameters(remove_duplicate=False)]
    assert [k for k in params if not torch.equal(back[k], state[k])] == []
    if args.num_experts:  # stacked here, one tensor per expert there
        name = spec.state_dict_adapter.hf_expert_names("layers.1.feed_forward.experts.w1", args)
        assert name is not None and len(name) == args.num_experts and all(n in hf for n in name)


def test_one_weight_path_reads_releases():
    """No whole-dict conversion beside the reader the tests above run, and one FP8 dequantizer
    (``checkpoint/quantized.py``): a second path would be checked by the tests while production took the other."""
    adapters = [get_model_spec(f).state_dict_adapter for f in ("llama3", "qwen3", "mixtral", "deepseek_v3", "gpt_oss")]
    assert [type(a).__name__ for a in adapters if hasattr(a, "from_hf")] == []
    assert not hasattr(StateDictAdapter, "from_hf") and not hasattr(WeightMap, "from_hf")
    assert not hasattr(weight_map, "dequantize")


def test_the_head_permutation_is_hugging_faces_rotate_halves():
    heads, hd = 2, 8
    ours = torch.arange(heads * hd * 3, dtype=torch.float32).view(heads * hd, 3)
    theirs = permute_rows(ours, heads, to_hf=True)
    for h in range(heads):  # row c * hd/2 + i of theirs is row 2i + c of ours, within each head
        for c in range(2):
            for i in range(hd // 2):
                assert torch.equal(theirs[h * hd + c * hd // 2 + i], ours[h * hd + 2 * i + c])
    assert torch.equal(permute_rows(theirs, heads, to_hf=False), ours)


def test_a_partial_rotary_permutation_keeps_the_plain_rows_and_permutes_the_rest():
    heads, nope, rope = 3, 4, 6
    ours = torch.randn(heads * (nope + rope), 5)
    theirs = permute_rows(ours, heads, to_hf=True, rotary_dims=rope)
    per_head_ours, per_head_theirs = ours.view(heads, nope + rope, 5), theirs.view(heads, nope + rope, 5)
    assert torch.equal(per_head_theirs[:, :nope], per_head_ours[:, :nope])
    whole = permute_rows(per_head_ours[:, nope:].reshape(heads * rope, 5), heads, to_hf=True)
    assert torch.equal(per_head_theirs[:, nope:].reshape(heads * rope, 5), whole)
    assert torch.equal(permute_rows(theirs, heads, to_hf=False, rotary_dims=rope), ours)


def test_a_parameter_without_a_row_is_named():
    weights = WeightMap([WeightTemplate("layers.{layer}.attention.wv.weight",
                                        "model.layers.{layer}.self_attn.v_proj.weight")])
    assert weights.hf_name("layers.1.attention.wv.weight", tied=False) == "model.layers.1.self_attn.v_proj.weight"
    with pytest.raises(KeyError, match="no Hugging Face name for parameter 'layers.1.attention.wq.weight'"):
        weights.hf_name("layers.1.attention.wq.weight", tied=False)


def test_rows_gather_two_interleaved_transposed_tensors_and_read_them_back_plain_or_packed():
    """GPT-OSS's experts as rows: ours [E, F, D] twice, theirs one [E, D, 2F] with the two alternating."""
    args = model_args("llama3", "debugmodel")
    # a stand-in packed format: two values per group, each code times its group's scale
    doubled = PackedFormat(("_codes", "_scales"), 2, lambda codes, scales: (codes * scales[..., None]).flatten(-2))
    rows = [WeightTemplate(ours, "gate_up", transpose=(1, 2), part=Part(dim=1, index=i, count=2), packed=doubled)
            for i, ours in enumerate(("gate", "up"))]
    weights = WeightMap(rows)
    gate, up = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    hf = weights.to_hf({"gate": gate, "up": up}, args)
    assert list(hf) == ["gate_up"] and hf["gate_up"].shape == (2, 4, 6)
    assert torch.equal(hf["gate_up"][:, :, 0::2], gate.transpose(1, 2))
    assert torch.equal(hf["gate_up"][:, :, 1::2], up.transpose(1, 2))
    for fqn, ours in (("gate", gate), ("up", up)):
        converted = weights.hf_conversion(fqn, {"gate_up": (2, 4, 6)}, hf.__getitem__)
        assert converted is not None and converted.shape == (2, 3, 4) and torch.equal(converted.read(), ours)
    packed = {"gate_up_codes": torch.randn(2, 6, 2, 2), "gate_up_scales": torch.randn(2, 6, 2)}  # [E, 2F, G, 2]
    values = doubled.dequantize(packed["gate_up_codes"], packed["gate_up_scales"])  # [E, 2F, D]: ours' rows
    converted = weights.hf_conversion("up", {n: tuple(t.shape) for n, t in packed.items()}, packed.__getitem__)
    assert converted is not None and converted.shape == (2, 3, 4) and torch.equal(converted.read(), values[:, 1::2])
    with pytest.raises(ValueError, match="the Hugging Face weights lack gate_up \\(for our gate\\)"):
        weights.hf_conversion("gate", {"gate_up_codes": (2, 6, 2, 2)}, packed.__getitem__)
