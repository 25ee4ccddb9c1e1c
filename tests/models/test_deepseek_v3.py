"""DeepSeek-V3 (``--model.name deepseek_v3``): against transformers' ``DeepseekV3ForCausalLM`` (logits, export),
MLA's own properties (document mask, cache), the flavors' published sizes, and bad inputs in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers  # a test-only dependency (the dev extra)

from torchtitan.checkpoint.formats import check_source, export_hf, load_into
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.attention import build_document_mask
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model, param_counts
from torchtitan.models.kv_cache import KVCache
from torchtitan.models.moe import MoE

VOCAB = 96
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def hf_config(q_lora_rank: int | None = 24, rope: dict | None = None, **kw) -> transformers.DeepseekV3Config:  # noqa: ANN003
    """Every option on: a query LoRA (or none), YaRN with mscale, a value head apart from the key head, a dense
    first layer, 8 experts in 4 groups (2 kept), top-3, a shared expert, renormalised and scaled weights."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=12,
                  qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=256, num_mtp_layers=0,
                  rope_parameters=rope or YARN)
    return transformers.DeepseekV3Config(**(fields | kw))


def saved(folder: Path, config: transformers.DeepseekV3Config | None = None,
          seed: int = 0) -> transformers.DeepseekV3ForCausalLM:
    """A random transformers model saved to ``folder``: norms away from one and a nonzero correction bias,
    so that a misplaced norm or a dropped bias shows."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config or hf_config()).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(folder)
    return model


def ours(folder: Path, mask: str = "causal") -> tuple[DeepSeekV3Model, object]:
    args = dataclasses.replace(model_args("deepseek_v3", str(folder)), attn_mask_type=mask)
    model = get_model_spec("deepseek_v3").build(args)
    assert check_source(str(folder), "hf", args) == []
    load_into(model, str(folder), "hf", args)
    return model.eval(), args


def assert_rel_close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max |diff| {err} over max |ref| {ref.abs().max().item()}"


@pytest.mark.parametrize("q_lora_rank, rope", [(24, YARN), (None, None)], ids=["q_lora_yarn", "wq_plain_rope"])
def test_logits_and_loss_equal_transformers(q_lora_rank, rope, tmp_path):
    theirs = saved(tmp_path, hf_config(q_lora_rank, rope or {"rope_type": "default", "rope_theta": 10000.0}))
    model, args = ours(tmp_path)
    assert (args.q_lora_rank, args.yarn is not None) == (q_lora_rank or 0, rope is not None)
    assert (model.layers["0"].attention.wq is None) == bool(q_lora_rank)
    bias = model.layers["1"].feed_forward.router.expert_bias
    assert bias is not None and bias.abs().sum() > 0  # the release's correction bias was read
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = theirs(tokens).logits, model(tokens)
    assert_rel_close(got, ref)
    labels = torch.roll(tokens, -1, 1).flatten()
    loss, ref_loss = (torch.nn.functional.cross_entropy(x.flatten(0, 1), labels) for x in (got, ref))
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()


def test_export_loads_in_transformers_with_the_learned_routing_bias(tmp_path):
    saved(tmp_path / "hf")
    model, args = ours(tmp_path / "hf")
    with torch.no_grad():  # as training would have moved it
        for moe in model.moe_layers().values():
            assert moe.router.expert_bias is not None
            moe.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    export_hf({k: v.detach() for k, v in model.state_dict().items()}, args, tmp_path / "out", dtype=torch.float32)
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert torch.equal(again.model.layers[2].mlp.gate.e_score_correction_bias, torch.linspace(-0.5, 0.5, 8))
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_rel_close(model(tokens), again(tokens).logits)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert model_args("deepseek_v3", str(tmp_path / "out")) == dataclasses.replace(args, attn_mask_type="block_causal")
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["q_lora_rank"] == 24


def test_documents_attend_only_to_themselves():
    """block_causal: a row of two documents gives each document's logits as if it were alone."""
    args = dataclasses.replace(model_args("deepseek_v3", "debugmodel"), n_layers=2, vocab_size=VOCAB, max_seq_len=64)
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    model.eval()
    tokens = torch.randint(0, VOCAB, (1, 40))
    positions = torch.cat([torch.arange(25), torch.arange(15)])[None]
    with torch.no_grad():
        packed = model(tokens, positions=positions)
        first, second = model(tokens[:, :25]), model(tokens[:, 25:])
    assert_rel_close(packed[:, :25], first)
    assert_rel_close(packed[:, 25:], second)
    assert not torch.allclose(packed[:, 25:], model(tokens)[:, 25:], atol=1e-3)  # the mask did something
    assert build_document_mask(positions).segment_lengths() == [25, 15]


def test_the_cache_holds_the_latent_and_decodes_as_the_full_forward():
    args = dataclasses.replace(model_args("deepseek_v3", "debugmodel"), n_layers=2, vocab_size=VOCAB, max_seq_len=64)
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, 20))
    cache = KVCache(torch.zeros(2, dtype=torch.long), capacity=32)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :12], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(12, 20)]
    assert_rel_close(torch.cat(steps, dim=1), full)
    layer = cache.layer("0")
    assert layer.k is not None and layer.v is not None
    # per token and layer: the latent and the shared rotary key, whatever the head count
    assert (layer.k.shape[1], layer.k.shape[-1], layer.v.shape[1], layer.v.shape[-1]) == (
        1, args.kv_lora_rank, 1, args.qk_rope_head_dim)


def test_the_tp_plan_is_a_query_and_apply_tp_gives_mla_its_group():
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate

    from torchtitan.models.deepseek_v3.mla import MultiHeadLatentAttention

    attention = DeepSeekV3Model(model_args("deepseek_v3", "debugmodel")).layers["0"].attention
    assert isinstance(attention, MultiHeadLatentAttention)
    mesh = SimpleNamespace(get_group=lambda: "the tp group")  # tp_plan must not ask the mesh for anything
    assert set(attention.tp_plan(Replicate(), mesh)) == {"", "wq_b", "wkv_b", "wo"}  # type: ignore[arg-type]
    assert attention.tp_group is None
    assert get_model_spec("deepseek_v3").model.apply_tp is DeepSeekV3Model.apply_tp  # the decoder's, then the group


@pytest.mark.parametrize("flavor, total, active", [
    ("16B", 15.96e9, 2.91e9), ("671B", 671e9, 37e9), ("kimi_k2", 1.03e12, 32.9e9)])
def test_flavors_have_the_published_parameter_counts(flavor, total, active):
    """Published: DeepSeek-V3 671B total, 37B active (report, Table 1 / §1; the main model without the MTP
    module); Kimi K2 1.04T / 32B active (its model card: "1T total, 32B activated"); Moonlight 16B / 3B."""
    args = model_args("deepseek_v3", flavor)
    got_total, got_active = param_counts(args)
    assert abs(got_total - total) / total < 0.02 and abs(got_active - active) / active < 0.03
    with torch.device("meta"):
        small = dataclasses.replace(args, n_layers=args.first_k_dense_replace + 1)
        assert DeepSeekV3Model(small).num_params() == param_counts(small)[0]


def test_debugmodel_exercises_every_option():
    args = model_args("deepseek_v3", "debugmodel")
    model = DeepSeekV3Model(args)
    moes = model.moe_layers()
    assert args.q_lora_rank and args.yarn is not None and args.v_head_dim != args.qk_nope_head_dim
    assert list(moes) == ["1", "2", "3"] and not isinstance(model.layers["0"].feed_forward, MoE)
    moe = moes["1"].args
    assert (moe.num_experts, moe.num_shared_experts, moe.num_groups, moe.score_func) == (8, 1, 2, "sigmoid")


@pytest.mark.parametrize("fields, message", [
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even and positive"),
    ({"qk_nope_head_dim": -8}, "qk_rope_head_dim=16 is larger than the query/key head"),
])
def test_bad_mla_shapes_are_refused_in_one_line(fields, message):
    base = model_args("deepseek_v3", "debugmodel")
    with pytest.raises(ValueError, match=message) as info:
        dataclasses.replace(base, **fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("entry, message", [
    ({"rope_interleave": False}, "rope_interleave false"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope' is not supported"),
    ({"qk_rope_head_dim": 9}, "qk_rope_head_dim=9 must be even"),
])
def test_bad_release_configs_are_refused_in_one_line(entry, message, tmp_path):
    saved(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | entry
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        model_args("deepseek_v3", str(tmp_path))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- FP8 releases

BLOCK = 16  # the release's 128 x 128, scaled down so that the tiny weights hold several blocks, some partial


def _fp8_release(folder: Path) -> dict[str, torch.Tensor]:
    """The saved model requantized as DeepSeek-V3's FP8 release is: every projection float8_e4m3fn with a
    per-block ``_scale_inv``; returns the dequantized value of each quantized weight, computed block by block."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    state, out, expected = load_file(file), {}, {}
    for name, w in state.items():
        if w.dim() != 2 or not name.endswith("proj.weight"):
            out[name] = w
            continue
        rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
        q, scale, value = torch.empty_like(w, dtype=torch.float8_e4m3fn), torch.empty(rows, cols), torch.empty_like(w)
        for i in range(rows):
            for j in range(cols):
                cut = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
                scale[i, j] = w[cut].abs().max() / 448.0
                q[cut] = (w[cut] / scale[i, j]).to(torch.float8_e4m3fn)
                value[cut] = q[cut].float() * scale[i, j]
        out[name], out[name + "_scale_inv"], expected[name] = q, scale, value
    save_file(out, file, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (folder / "config.json").write_text(json.dumps(config))
    return expected


def test_fp8_block_weights_are_dequantized_on_load(tmp_path):
    saved(tmp_path)
    expected = _fp8_release(tmp_path)
    model, args = ours(tmp_path)
    attn, moe = model.layers["1"].attention, model.layers["1"].feed_forward
    assert torch.equal(attn.wkv_b.weight, expected["model.layers.1.self_attn.kv_b_proj.weight"])
    assert torch.equal(attn.wq_a.weight, expected["model.layers.1.self_attn.q_a_proj.weight"])
    assert torch.equal(moe.experts.w2[5], expected["model.layers.1.mlp.experts.5.down_proj.weight"])
    # quantization moved the weights: the check above is not of the unquantized values
    assert not torch.equal(attn.wkv_b.weight, saved(tmp_path / "again").model.layers[1].self_attn.kv_b_proj.weight)


def test_an_unknown_quantization_is_refused_in_one_line(tmp_path):
    saved(tmp_path)
    args = model_args("deepseek_v3", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    problems = check_source(str(tmp_path), "hf", args)
    assert len(problems) == 1 and "quant_method 'mxfp4'" in problems[0] and "\n" not in problems[0]
    with pytest.raises(ValueError, match="is not supported: only fp8 e4m3"):
        load_into(DeepSeekV3Model(args), str(tmp_path), "hf", args)
