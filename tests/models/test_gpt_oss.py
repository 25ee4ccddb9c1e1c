"""GPT-OSS against transformers' ``GptOssForCausalLM``: logits, the Hugging Face import and export, MXFP4
experts, the masks (sliding window composed with documents), refusals, flavors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers  # a test-only dependency (the dev extra)

from torchtitan.checkpoint.formats import check_source, export_hf, load_into
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.gpt_oss.model import GptOssModel

VOCAB = 96


def hf_config(**kw) -> transformers.GptOssConfig:
    """Every option on: GQA, a window (5) shorter than the sequences, an irregular layer pattern, YaRN,
    a clamp (0.6) the activations cross, biases and sinks (set non-zero by ``saved``)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                swiglu_limit=0.6, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
                attn_implementation="eager")
    base.update(kw)
    return transformers.GptOssConfig(**base)


def saved(folder: Path, **kw) -> transformers.GptOssForCausalLM:
    """A transformers GPT-OSS with every weight drawn (biases, sinks and norms away from their init), saved."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def ours(folder: Path, **replace) -> tuple[GptOssModel, GptOssArgs]:
    args = dataclasses.replace(model_args("gpt_oss", str(folder)), **replace)
    model = get_model_spec("gpt_oss").build(args)
    assert check_source(str(folder), "hf", args) == []
    load_into(model, str(folder), "hf", args)
    return model.eval(), args


def tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_logits_and_loss_equal_transformers(tmp_path):
    theirs = saved(tmp_path / "hf")
    model, args = ours(tmp_path / "hf")
    assert args.window(0) == 5 and args.window(1) is None and args.rope_yarn is not None
    x = tokens(2, 24)
    with torch.no_grad():
        ref, got = theirs(x).logits, model(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    labels = torch.roll(x, -1, 1)
    loss = torch.nn.functional.cross_entropy(got.flatten(0, 1), labels.flatten())
    ref_loss = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten())
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


def test_export_is_read_by_transformers_with_equal_logits(tmp_path):
    theirs = saved(tmp_path / "hf")
    model, args = ours(tmp_path / "hf")
    export_hf({k: v.detach() for k, v in model.state_dict().items()}, args, tmp_path / "out")
    again = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    x = tokens(1, 16, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, theirs(x).logits, rtol=1e-5, atol=1e-5)
    for name, p in theirs.state_dict().items():  # every tensor back in place, bit for bit
        assert torch.equal(again.state_dict()[name], p), name


def test_documents_and_windows_compose(tmp_path):
    """Under block_causal, a document packed after another gives the logits it gives alone (window and sinks
    included); a query never sees past its window: changing a token further back leaves it unchanged."""
    saved(tmp_path / "hf")
    model, _ = ours(tmp_path / "hf", attn_mask_type="block_causal")
    a, b = tokens(1, 9, seed=3), tokens(1, 11, seed=4)
    positions = torch.cat([torch.arange(9), torch.arange(11)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), positions)
        alone = model(b, torch.arange(11)[None])
    torch.testing.assert_close(packed[:, 9:], alone, rtol=1e-5, atol=1e-5)
    # One sliding layer alone: the window (5 keys) hides token 0 from query 5 and later.
    attention = model.layers["0"].attention
    x = torch.randn(1, 12, 64)
    y = x.clone()
    y[:, 0] += 1.0
    with torch.no_grad():
        rope, backend = model.rope_cache, model.backend_for(x.device)
        out_x, out_y = attention(x, rope, backend=backend), attention(y, rope, backend=backend)
    assert not torch.allclose(out_x[:, 4], out_y[:, 4])
    torch.testing.assert_close(out_x[:, 5:], out_y[:, 5:], rtol=0, atol=0)


def _mxfp4_release(folder: Path) -> dict[str, torch.Tensor]:
    """The saved transformers model's expert weights replaced by random MXFP4 blocks and scales (their layout:
    [E, out, in/32, 16] and [E, out, in/32]), the config naming the quantization. Returns what was written."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    state = load_file(file)
    gen = torch.Generator().manual_seed(5)
    packed = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = state.pop(name).shape
        packed[name + "_blocks"] = torch.randint(0, 256, (e, d_out, d_in // 32, 16), generator=gen, dtype=torch.uint8)
        packed[name + "_scales"] = torch.randint(120, 132, (e, d_out, d_in // 32), generator=gen, dtype=torch.uint8)
    save_file({**state, **packed}, str(file), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return packed


def test_mxfp4_experts_dequantize_as_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    saved(tmp_path / "hf")
    packed = _mxfp4_release(tmp_path / "hf")
    model, _ = ours(tmp_path / "hf")
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = convert_moe_packed_tensors(packed[prefix + "gate_up_proj_blocks"],
                                             packed[prefix + "gate_up_proj_scales"], dtype=torch.float32)
        down = convert_moe_packed_tensors(packed[prefix + "down_proj_blocks"], packed[prefix + "down_proj_scales"],
                                          dtype=torch.float32)
        experts = model.layers[str(layer)].feed_forward.experts
        assert torch.equal(experts.w1, gate_up[..., 0::2].transpose(1, 2))  # their [E, D, 2F], gate at 0::2
        assert torch.equal(experts.w3, gate_up[..., 1::2].transpose(1, 2))
        assert torch.equal(experts.w2, down.transpose(1, 2))
        assert experts.w1.abs().max() > 0


def test_an_unknown_quantization_config_is_refused_in_one_line(tmp_path):
    saved(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='fp8' is not supported") as e:
        model_args("gpt_oss", str(tmp_path / "hf"))
    assert "\n" not in str(e.value)
    args = get_model_spec("gpt_oss").flavors["debugmodel"]
    problems = check_source(str(tmp_path / "hf"), "hf", args)
    assert any("quant_method='fp8' is not supported" in p for p in problems)


def test_flavors_build_and_the_debug_model_has_an_init_spec_per_parameter():
    spec = get_model_spec("gpt_oss")
    with torch.device("meta"):
        for flavor, layers, experts in (("20b", 24, 32), ("120b", 36, 128)):
            args = spec.flavors[flavor]
            model = spec.build(args)
            assert len(model.layers) == layers and model.layers["0"].feed_forward.experts.w1.shape[0] == experts
            assert args.window(0) == 128 and args.window(1) is None
    model = spec.build(spec.flavors["debugmodel"])
    model.init_weights()
    assert set(model.param_init_specs()) == {n for n, _ in model.named_parameters()}
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith(("bias", "sinks")))


GPT_OSS_CONFIG = "train_configs/gpt_oss_debug.toml"


@pytest.mark.parametrize("overrides, world, needle", [
    (["--parallelism.tensor_parallel_degree=3", "--parallelism.data_parallel_shard_degree=1"], 3,
     "--parallelism.tensor_parallel_degree=3: the model's n_heads (8) is not divisible by it"),
    (["--parallelism.expert_parallel_degree=3", "--parallelism.data_parallel_shard_degree=3"], 3,
     "--parallelism.expert_parallel_degree=3 does not divide the 8 experts"),
])
def test_bad_layouts_are_one_line_each_before_any_process_group(overrides, world, needle):
    from conftest import REPO, debug_config

    from torchtitan.config import ConfigError
    from torchtitan.preflight import preflight

    with pytest.raises(ConfigError) as e:
        preflight(debug_config(*overrides, config=str(REPO / GPT_OSS_CONFIG)), world)
    assert any(needle in p for p in e.value.problems), e.value.problems
    assert all("\n" not in p for p in e.value.problems)


def test_windows_with_context_parallelism_pass_the_preflight():
    """Sliding windows and sinks run under CP (the all-gathered keys, masked per chunk): nothing to refuse; the
    layout is trained against one process in tests/distributed/test_gpt_oss_layouts.py."""
    from conftest import REPO, debug_config

    from torchtitan.preflight import preflight

    plan = preflight(debug_config("--parallelism.context_parallel_degree=2",
                                  "--parallelism.data_parallel_shard_degree=1", config=str(REPO / GPT_OSS_CONFIG)), 2)
    assert plan.dims.cp == 2 and plan.model_args.window(0) == 16


def test_an_unknown_quantization_is_a_config_error_before_any_process_group(tmp_path):
    from conftest import REPO, debug_config

    from torchtitan.config import ConfigError
    from torchtitan.preflight import preflight

    saved(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        preflight(debug_config(f"--model.flavor={tmp_path / 'hf'}", config=str(REPO / GPT_OSS_CONFIG)), 1)
    (problem,) = [p for p in e.value.problems if "quant_method" in p]
    assert "quant_method='bitsandbytes' is not supported" in problem and "\n" not in problem
