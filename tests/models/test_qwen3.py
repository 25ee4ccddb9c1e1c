"""Qwen3, Qwen3-MoE and Mixtral: against transformers' own models, the Hugging Face import and export,
the flavors' published sizes, and the bad inputs refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers  # a test-only dependency (the dev extra)

from torchtitan.checkpoint.formats import check_source, export_hf, load_into
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.flops import param_counts
from torchtitan.models.moe import MoE

VOCAB = 96


def _qwen3(**kw):
    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    tie_word_embeddings=True, rope_theta=1e6, **kw)


def _qwen3_moe(**kw):
    return transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], rope_theta=1e6, **kw)


def _mixtral():
    return transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                      num_experts_per_tok=2, rope_theta=1e6)


CASES = {
    "qwen3": ("qwen3", transformers.Qwen3ForCausalLM, _qwen3),
    "qwen3_moe": ("qwen3", transformers.Qwen3MoeForCausalLM, lambda: _qwen3_moe(norm_topk_prob=True)),
    "qwen3_moe_unnormed_step2": ("qwen3", transformers.Qwen3MoeForCausalLM,
                                 lambda: _qwen3_moe(norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("mixtral", transformers.MixtralForCausalLM, _mixtral),
}


def _saved(case: str, folder: Path) -> tuple[str, torch.nn.Module]:
    family, cls, config = CASES[case]
    torch.manual_seed(0)
    model = cls(config()).float().eval()
    with torch.no_grad():  # norms away from one, so that a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return family, model


def _ours(family: str, folder: Path) -> tuple[Decoder, object]:
    args = dataclasses.replace(model_args(family, str(folder)), attn_mask_type="causal")
    model = get_model_spec(family).build(args)
    assert check_source(str(folder), "hf", args) == []
    load_into(model, str(folder), "hf", args)
    return model.eval(), args


@pytest.mark.parametrize("case", list(CASES))
def test_step1_loss_and_logits_equal_transformers(case, tmp_path):
    family, theirs = _saved(case, tmp_path / "hf")
    ours, args = _ours(family, tmp_path / "hf")
    assert args.num_experts == (0 if case == "qwen3" else 8)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    with torch.no_grad():
        ref, got = theirs(tokens).logits, ours(tokens)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    loss = torch.nn.functional.cross_entropy(got.flatten(0, 1), labels.flatten())
    ref_loss = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten())
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "mixtral"])
def test_export_round_trip_loads_in_transformers(case, tmp_path):
    family, theirs = _saved(case, tmp_path / "hf")
    ours, args = _ours(family, tmp_path / "hf")
    export_hf({k: v.detach() for k, v in ours.state_dict().items()}, args, tmp_path / "out")
    again = CASES[case][1].from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, theirs(tokens).logits, rtol=0, atol=1e-5)


def test_hub_config_layout_reads_like_transformers_5(tmp_path):
    """The hub's ``num_experts`` + ``rope_theta`` and transformers 5's ``num_local_experts`` + ``rope_parameters``."""
    _saved("qwen3_moe", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "num_local_experts" in config and "rope_parameters" in config  # what transformers 5 writes
    new = model_args("qwen3", str(tmp_path / "hf"))
    hub = {k: v for k, v in config.items() if k not in ("num_local_experts", "rope_parameters")}
    hub.update(num_experts=8, rope_theta=1e6)
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "config.json").write_text(json.dumps(hub))
    old = model_args("qwen3", str(tmp_path / "hub"))
    assert old == new and new.num_experts == 8 and new.rope_theta == 1e6 and new.mlp_only_layers == (0,)
    assert [new.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_a_folder_missing_an_expert_is_refused_naming_the_key(tmp_path):
    from safetensors.torch import load_file, save_file

    family, _ = _saved("qwen3_moe", tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    del state[key]
    save_file(state, file, metadata={"format": "pt"})
    args = model_args(family, str(tmp_path / "hf"))
    problems = check_source(str(tmp_path / "hf"), "hf", args)
    assert len(problems) == 1 and key in problems[0]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_into(Decoder(args), str(tmp_path / "hf"), "hf", args)


def test_top_k_above_the_experts_is_refused_in_one_line(tmp_path):
    bad = dataclasses.asdict(model_args("qwen3", "debugmodel_moe")) | {"top_k": 9}
    with pytest.raises(ValueError) as info:
        type(model_args("qwen3", "debugmodel_moe"))(**bad)
    assert str(info.value) == "moe top_k=9 must be between 1 and num_experts=8" and "\n" not in str(info.value)
    _saved("qwen3_moe", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {"num_experts_per_tok": 12}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"--model.flavor=.*config.json: moe top_k=12 must be between 1 and "
                                         r"num_experts=8$"):
        model_args("qwen3", str(tmp_path / "hf"))


@pytest.mark.parametrize("family, flavor, total, active", [
    ("qwen3", "0.6B", 0.596e9, None), ("qwen3", "1.7B", 1.72e9, None), ("qwen3", "4B", 4.02e9, None),
    ("qwen3", "8B", 8.19e9, None), ("qwen3", "14B", 14.77e9, None), ("qwen3", "32B", 32.76e9, None),
    ("qwen3", "30B-A3B", 30.5e9, 3.35e9), ("qwen3", "235B-A22B", 235.1e9, 22.2e9),
    ("mixtral", "8x7B", 46.7e9, 12.9e9),
])
def test_flavors_have_the_published_parameter_counts(family, flavor, total, active):
    """Published: Qwen3 model cards (0.6B ... 32B, 30.5B/3.3B active, 235B/22B); Mixtral 46.7B / 12.9B active."""
    args = model_args(family, flavor)
    got_total, got_active = param_counts(args)
    assert abs(got_total - total) / total < 0.005
    assert abs(got_active - (active or total)) / (active or total) < 0.01
    with torch.device("meta"):
        small = dataclasses.replace(args, n_layers=2, mlp_only_layers=())
        assert Decoder(small).num_params() == param_counts(small)[0]


def test_flops_count_active_experts_only():
    spec = get_model_spec("qwen3")
    moe = model_args("qwen3", "30B-A3B")
    more = dataclasses.replace(moe, num_experts=256)
    assert spec.model.flops_per_token(more, 4096) - spec.model.flops_per_token(moe, 4096) == 6.0 * 48 * 2048 * 128
    _, active = param_counts(moe)
    # untied: the output matmul counts, the embedding lookup does not
    assert spec.model.flops_per_token(moe, 0) == 6.0 * (active - moe.vocab_size * moe.dim)
    tied = dataclasses.replace(moe, tie_word_embeddings=True)
    assert spec.model.flops_per_token(tied, 0) == 6.0 * param_counts(tied)[1]  # one weight, still one output matmul


@pytest.mark.parametrize("family, flavor", [("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe"),
                                            ("mixtral", "debugmodel")])
def test_debug_models_have_an_init_spec_per_parameter_and_train(family, flavor):
    args = model_args(family, flavor)
    torch.manual_seed(0)
    model = get_model_spec(family).build(args)
    model.init_weights()
    specs = model.param_init_specs()
    assert set(specs) == {n for n, _ in model.named_parameters()}
    moes = [b.feed_forward for b in model.layers.values() if isinstance(b.feed_forward, MoE)]
    if flavor == "debugmodel_moe":
        assert [isinstance(b.feed_forward, MoE) for b in model.layers.values()] == [False, True, True, True]
        assert specs["layers.1.feed_forward.experts.w1"].kind == specs["layers.1.attention.wq.weight"].kind
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(int(m.tokens_per_expert.sum()) == 2 * 16 * args.top_k for m in moes)


def test_preflight_names_widths_tp_does_not_divide_and_tying_under_pp():
    from torchtitan.models.common.parallel import check_decoder

    args = model_args("qwen3", "debugmodel")  # 8 heads, 4 kv heads, tied
    assert check_decoder(args, tp=2, pp=1, flavor="debugmodel") == []
    problems = check_decoder(args, tp=8, pp=2, flavor="debugmodel")
    assert problems == [
        "--parallelism.tensor_parallel_degree=8: the model's n_kv_heads (4) is not divisible by it; pick a degree "
        "that divides n_kv_heads",
        "--model.flavor=debugmodel ties the output projection to the embedding, which pipeline parallelism does not "
        "support (they live on different stages); use --parallelism.pipeline_parallel_degree=1 (FSDP, HSDP, DDP, TP "
        "and CP all train it tied)"]
    # Only dense layers' width matters to TP: Mixtral's experts are replicated over TP.
    mixtral = dataclasses.replace(model_args("mixtral", "debugmodel"), ffn_hidden_size=7, moe_hidden_size=7)
    assert check_decoder(mixtral, tp=2, pp=1, flavor="debugmodel") == []
    broken = dataclasses.replace(model_args("qwen3", "debugmodel_moe"))
    object.__setattr__(broken, "top_k", 9)  # past the args' own check: preflight still names it
    assert check_decoder(broken, tp=1, pp=1, flavor="x") == [
        "--model.flavor=x: top_k=9 experts per token exceeds num_experts=8; use a top_k between 1 and 8"]


def test_the_registry_finds_each_family_by_its_args():
    from torchtitan.models import spec_for_args

    assert spec_for_args(model_args("qwen3", "30B-A3B")).name == "qwen3"
    assert spec_for_args(model_args("mixtral", "8x7B")).name == "mixtral"
    assert spec_for_args(model_args("llama3", "8B")).name == "llama3"
