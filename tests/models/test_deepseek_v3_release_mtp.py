"""A DeepSeek-V3 release's multi-token prediction layer (``model.layers.<n_layers>.*``: enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head, embed_tokens and a block): exported from our MTP module and loaded back
bitwise with ``--model.mtp_layers`` 1, left unread (and the rest loaded) with MTP off, and skipped by
transformers' ``DeepseekV3ForCausalLM``, whose logits on the export are ours."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from test_deepseek_v3 import VOCAB, assert_rel_close, saved

from torchtitan.checkpoint.formats import check_source, export_hf, load_into
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

N = 3  # hf_config's layers: the MTP layer is model.layers.3
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _model(folder: Path, depths: int) -> tuple[DeepSeekV3Model, object]:
    args = dataclasses.replace(model_args("deepseek_v3", str(folder)), num_mtp_layers=depths, attn_mask_type="causal")
    model = get_model_spec("deepseek_v3").build(args)
    assert isinstance(model, DeepSeekV3Model)
    return model, args


def _trained_like(model: DeepSeekV3Model, seed: int) -> None:
    """Every parameter and routing bias random (norms away from one), as training would leave them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
        for moe in model.moe_layers().values():
            assert moe.router.expert_bias is not None
            moe.router.expert_bias.copy_(0.2 * torch.randn(moe.router.expert_bias.shape, generator=g))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_release_mtp_layer_round_trips(tmp_path):
    saved(tmp_path / "hf")  # a transformers release without the layer, for its config
    model, args = _model(tmp_path / "hf", 1)
    _trained_like(model, 0)
    export_hf(_state(model), args, tmp_path / "out", dtype=torch.float32)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    layer = f"model.layers.{N}."
    for name in (*MTP_OWN, "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "mlp.experts.7.down_proj.weight", "mlp.gate.e_score_correction_bias", "input_layernorm.weight"):
        assert layer + name in index, layer + name
    assert not any(n.startswith(f"model.layers.{N + 1}.") for n in index)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # the layer's own parts are the module's, its copies of the embedding and head the shared ones
    hf = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert model.tok_embeddings is not None and model.output is not None and model.mtp is not None
    module = model.mtp[str(N)]
    for name, ours in (("embed_tokens", model.tok_embeddings), ("shared_head.head", model.output),
                       ("eh_proj", module.eh_proj), ("shared_head.norm", module.norm), ("enorm", module.enorm)):
        assert torch.equal(hf[f"{layer}{name}.weight"], ours.weight.detach()), name

    again, args_again = _model(tmp_path / "out", 1)
    assert check_source(str(tmp_path / "out"), "hf", args_again) == []
    load_into(again, str(tmp_path / "out"), "hf", args_again)
    want, got = _state(model), _state(again)
    assert want.keys() == got.keys() and any(k.startswith(f"mtp.{N}.block.") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]

    # MTP off: the layer is left unread, the rest loads as it was
    plain, plain_args = _model(tmp_path / "out", 0)
    assert plain.mtp is None and check_source(str(tmp_path / "out"), "hf", plain_args) == []
    load_into(plain, str(tmp_path / "out"), "hf", plain_args)
    assert all(torch.equal(t, want[k]) for k, t in _state(plain).items())

    # transformers has no MTP module: it skips the layer, and its logits are ours
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_rel_close(model.eval()(tokens), theirs(tokens).logits)
