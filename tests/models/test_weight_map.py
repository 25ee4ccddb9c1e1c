"""Declarative weight maps (models/common/weight_map.py): templates with {layer} and {expert}, stacking,
head permutations (whole or partial rotary), and a scale tensor beside a weight.

Each family's map round-trips every parameter of a small model (names and values, bitwise); the head
permutation is Hugging Face's rotate-halves layout; a partial-rotary permutation leaves the non-rotary rows
alone and permutes the rest as a whole-head one would; a block-scaled weight loads dequantized.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan.models import get_model_spec, model_args
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.weight_map import WeightMap, WeightTemplate, dequantize, permute_rows


@pytest.mark.parametrize("family,flavor", [("llama3", "debugmodel"), ("llama3", "debugmodel_tied"),
                                           ("qwen3", "debugmodel_moe"), ("mixtral", "debugmodel")])
def test_each_family_round_trips_every_parameter_bitwise(family, flavor):
    spec, args = get_model_spec(family), model_args(family, flavor)
    torch.manual_seed(0)
    model = Decoder(args)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items() if not k.endswith("expert_bias")}
    if args.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    hf = spec.state_dict_adapter.to_hf(state, args)
    assert ("lm_head.weight" in hf) == (not args.tie_word_embeddings)
    back = spec.state_dict_adapter.from_hf(hf, args)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(back) == set(params)
    assert all(torch.equal(back[k], state[k]) for k in back)
    if args.num_experts:  # stacked here, one tensor per expert there
        name = spec.state_dict_adapter.hf_expert_names("layers.1.feed_forward.experts.w1", args)
        assert name is not None and len(name) == args.num_experts and all(n in hf for n in name)


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


def test_a_scale_tensor_beside_a_weight_is_multiplied_in():
    weights = WeightMap([WeightTemplate("layers.{layer}.attention.wv.weight",
                                        "model.layers.{layer}.self_attn.v_proj.weight",
                                        scale="model.layers.{layer}.self_attn.v_proj.weight_scale_inv")])
    w, scale = torch.ones(5, 3), torch.tensor([[2.0, 3.0], [4.0, 5.0]])  # blocks of 3 x 2
    state = {"model.layers.1.self_attn.v_proj.weight": w, "model.layers.1.self_attn.v_proj.weight_scale_inv": scale}
    args = model_args("llama3", "debugmodel")
    got = weights.from_hf(state, args, ["layers.1.attention.wv.weight"])["layers.1.attention.wv.weight"]
    assert torch.equal(got, dequantize(w, scale))
    assert got.tolist() == [[2, 2, 3]] * 3 + [[4, 4, 5]] * 2
    with pytest.raises(KeyError, match="no Hugging Face name"):
        weights.hf_name("layers.1.attention.wq.weight", tied=False)
