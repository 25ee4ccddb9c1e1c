"""The Float8 converter's parts without processes: what converts, the checks, the experts' padded grouped GEMM."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from conftest import debug_config
from torch import nn

from torchtitan import compat
from torchtitan.compat import kernels as compat_kernels
from torchtitan.config import ConfigError
from torchtitan.models import get_model_spec, model_args
from torchtitan.models.moe import experts as experts_module
from torchtitan.models.moe import float8_experts
from torchtitan.models.moe.experts import ClampedSwiGLUExperts, GroupedExperts
from torchtitan.models.moe.float8_experts import ALIGN, aligned_rows, padded_grouped_mm
from torchtitan.preflight import preflight
from torchtitan.quantization import checks, converter_problems
from torchtitan.quantization.converters import device_problems, model_problems
from torchtitan.quantization.float8 import convert_to_float8, skip_reason

FP8 = "--model.converters=float8"


def _build(name: str, flavor: str) -> nn.Module:
    args = dataclasses.replace(model_args(name, flavor), vocab_size=2048)
    with torch.device("meta"):
        return get_model_spec(name).build(args)


def test_skip_reasons():
    assert skip_reason(nn.Linear(256, 512), "layers.0.attention.wq", ["output"]) is None
    assert skip_reason(nn.Linear(256, 2048), "output", ["output"]) == "filtered"
    assert skip_reason(nn.Linear(256, 8), "layers.0.feed_forward.router.gate", []) == "dims not multiples of 16"
    assert skip_reason(nn.Linear(24, 256), "x", []) == "dims not multiples of 16"
    assert skip_reason(nn.LayerNorm(16), "norm", []) == "not a linear"


def test_dense_model_converts_every_linear_but_the_output_and_keeps_its_state_dict():
    plain, model = _build("llama3", "debugmodel"), _build("llama3", "debugmodel")
    counts = convert_to_float8(model, debug_config(FP8).float8, "cpu", "llama3 debugmodel")
    assert counts == {"converted": 42, "filtered": 1}  # 6 blocks x 7 linears; the output head stays
    assert type(model.get_submodule("output")) is nn.Linear
    assert type(model.get_submodule("layers.0.attention.wq")).__name__ == "Float8Linear"
    # Same names, shapes and dtypes: checkpoints and Hugging Face exports do not see the conversion.
    shapes = {k: (v.shape, v.dtype) for k, v in plain.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == shapes
    adapter = get_model_spec("llama3").state_dict_adapter
    args = dataclasses.replace(model_args("llama3", "debugmodel"), vocab_size=2048)
    assert adapter.to_hf(model.state_dict(), args).keys() == adapter.to_hf(plain.state_dict(), args).keys()


def test_filter_fqns_add_to_the_built_in_filter():
    model = _build("llama3", "debugmodel")
    counts = convert_to_float8(model, debug_config(FP8, "--float8.filter_fqns=feed_forward").float8, "cpu",
                               "llama3 debugmodel")
    assert counts == {"converted": 24, "filtered": 19}  # 6 x 3 feed-forward linears, and the output all the same
    assert type(model.get_submodule("output")) is nn.Linear


def test_a_filter_that_matches_no_linear_is_refused_in_one_line():
    bad = debug_config(FP8, "--float8.filter_fqns=feed_forward,nosuchmodule")
    with pytest.raises(ConfigError) as info:  # the launcher's preflight: exit 2 before any rank starts
        preflight(bad, 2)
    assert info.value.problems == [
        "--float8.filter_fqns: no linear layer or routed-experts module of llama3 debugmodel has 'nosuchmodule' in "
        "its FQN, so it filters nothing; name part of such an FQN such as layers.0.attention.wq, or drop it"]
    with pytest.raises(ValueError, match="'nosuchmodule'"):  # a direct caller, before the model changes
        convert_to_float8(_build("llama3", "debugmodel"), bad.float8, "cpu", "llama3 debugmodel")
    # The built-in patterns may be named again (a TorchTitan config does), even where a model has no router.
    dense = dataclasses.replace(model_args("llama3", "debugmodel"), vocab_size=2048)
    named_again = debug_config(FP8, "--float8.filter_fqns=output,router.gate")
    assert model_problems(named_again.model, named_again.float8, lambda: get_model_spec("llama3").build(dense)) == []


def test_checkpoint_model_state_is_plain_under_the_fp8_all_gather_and_a_load_drops_precomputed_scales():
    from torchtitan.checkpoint.states import BUILTIN, Holders, StateRegistry

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    convert_to_float8(model, debug_config(FP8, "--float8.enable_fsdp_float8_all_gather").float8, "cpu", "two linears")
    weight = model.get_parameter("0.weight")
    assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"  # what the FP8 all-gather casts
    holders = Holders(model, optimizer=None, lr_scheduler=None, dataset=None, rank=0)  # type: ignore[arg-type]
    saved = next(spec for spec in BUILTIN if spec.name == "model").save(holders, 0)
    assert {type(t) for t in saved.values()} <= {torch.Tensor, nn.Parameter}  # no torchao class for DCP to pickle
    assert saved["0.weight"].data_ptr() == weight._tensor.data_ptr()  # the weight itself, not a copy
    weight._precomputed_scale = torch.tensor(2.0)  # as precompute_float8_dynamic_scale_for_fsdp leaves it
    StateRegistry(holders).apply({})
    assert weight._precomputed_scale is None  # the next all-gather computes it from the loaded weights


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_moe_model_routed_experts_fp8_only_on_cuda(device_type):
    model = _build("qwen3", "debugmodel_moe")
    counts = convert_to_float8(model, debug_config(FP8).float8, device_type, "qwen3 debugmodel_moe")
    routers = [fqn for fqn, _ in model.named_modules() if fqn.endswith("router.gate")]
    assert routers and all(type(model.get_submodule(f)) is nn.Linear for f in routers)  # the gate stays
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    fp8 = device_type == "cuda" and compat.scaled_grouped_mm_available()
    assert counts["experts_fp8" if fp8 else "experts_high_precision"] == len(experts) > 0
    assert all(m.fp8 == fp8 for m in experts)


def test_to_float8_switches_plain_experts_only_and_falls_back_where_fp8_does_not_fit(monkeypatch):
    """Where FP8 grouped GEMMs run, plain experts switch; GPT-OSS's biased, clamped experts stay in high precision.
    A switched module whose products do not fit (here: CPU tensors) computes the high-precision products."""
    monkeypatch.setattr(experts_module, "fp8_grouped_mm_runs", lambda device_type, emulate: True)
    plain, clamped = GroupedExperts(16, 32, 4), ClampedSwiGLUExperts(16, 32, 4, limit=7.0, alpha=1.702)
    assert plain.to_float8("cuda", False) and plain.fp8
    assert not clamped.to_float8("cuda", False) and not clamped.fp8
    reference = GroupedExperts(16, 32, 4)
    for name in ("w1", "w2", "w3"):
        torch.nn.init.normal_(getattr(reference, name), std=0.1)
        getattr(plain, name).data.copy_(getattr(reference, name))
    x, counts = torch.randn(10, 16), torch.tensor([3, 0, 5, 2])
    assert torch.equal(plain(x, counts), reference(x, counts))


def _expert_lines(caplog: pytest.LogCaptureFixture, name: str, flavor: str, device_type: str, *flags: str
                  ) -> list[str]:
    with caplog.at_level(logging.INFO, logger="torchtitan.quantization.float8"):
        caplog.clear()
        convert_to_float8(_build(name, flavor), debug_config(FP8, *flags).float8, device_type, f"{name} {flavor}")
    return [r.getMessage() for r in caplog.records if "routed experts" in r.getMessage()]


def test_routed_experts_say_in_one_line_why_they_skip_fp8(caplog):
    """One line at conversion for the experts that take FP8 grouped GEMMs, one per reason the others do not."""
    skipped = "Float8: FP8 grouped GEMMs for the routed experts of {} MoE layers: skipped, {} (the high-precision " \
              "grouped product runs)"
    assert _expert_lines(caplog, "qwen3", "debugmodel_moe", "cpu") == [
        skipped.format(3, "no CUDA device (this run is on cpu)")]
    assert _expert_lines(caplog, "qwen3", "debugmodel_moe", "cuda", "--float8.emulate") == [
        skipped.format(3, "--float8.emulate (no FP8 kernel is asked for)")]
    assert _expert_lines(caplog, "qwen3", "debugmodel_moe", "cuda", "--float8.filter_fqns=layers.1.feed_forward") == [
        skipped.format(1, "filtered by --float8.filter_fqns"),
        "Float8: the routed experts of 2 MoE layers run FP8 grouped GEMMs (rowwise scales)"]
    assert _expert_lines(caplog, "gpt_oss", "debugmodel", "cuda") == [
        skipped.format(model_args("gpt_oss", "debugmodel").n_layers,
                       "ClampedSwiGLUExperts is not checked in FP8 (biased, clamped products)")]
    assert _expert_lines(caplog, "llama3", "debugmodel", "cpu") == []  # no experts, no line


def test_fp8_grouped_gemm_selection(monkeypatch):
    assert compat.fp8_grouped_mm_skip_reason("cpu", emulate=False) == "no CUDA device (this run is on cpu)"
    assert compat.fp8_grouped_mm_skip_reason("cuda", emulate=True) == "--float8.emulate (no FP8 kernel is asked for)"
    assert compat.fp8_grouped_mm_skip_reason("cuda", emulate=False) is None  # torch 2.13 and torchao 0.18 have it
    monkeypatch.setattr(compat_kernels, "TORCHAO_GROUPED_MM", "torchao.no_such_module")
    assert "the installed torchao has no torchao.no_such_module" in str(compat.fp8_grouped_mm_missing())
    monkeypatch.setattr(compat_kernels, "scaled_grouped_mm_available", lambda: False)
    assert compat.fp8_grouped_mm_skip_reason("cuda", emulate=False) == \
        f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    assert not float8_experts.fp8_grouped_mm_runs("cuda", emulate=False)


MOE = ("--model.name=qwen3", "--model.flavor=debugmodel_moe")


def test_fp8_experts_on_a_gpu_without_the_kernel_are_refused_before_any_process_group(monkeypatch):
    """An SM 9.0 GPU (the device query mocked) whose torch lacks ``_scaled_grouped_mm``: the launcher's preflight
    refuses the FP8 experts in one line (exit 2) naming the fixes, each of which passes."""
    monkeypatch.setattr(compat, "cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(compat_kernels, "scaled_grouped_mm_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        preflight(debug_config(FP8, *MOE), 1)
    assert info.value.problems == [
        "--model.converters=float8: the routed experts of qwen3 debugmodel_moe (layers.1.feed_forward.experts and 2 "
        f"more) take FP8 grouped GEMMs on this GPU, but torch {torch.__version__} has no torch._scaled_grouped_mm; "
        f"install torch and torchao with it ({checks.TORCHAO_PIN}), set --float8.emulate (the experts stay in high "
        "precision), keep them in high precision with --float8.filter_fqns=feed_forward.experts, or drop float8 "
        "from --model.converters"]
    for fix in (("--float8.emulate",), ("--float8.filter_fqns=feed_forward.experts",), ()):
        cfg = debug_config(*(fix or MOE), *(MOE if fix else ()), *((FP8,) if fix else ()))
        assert device_problems(cfg.model, cfg.float8, _factory(cfg)) == [], fix
    # Models without FP8-capable experts need no kernel: a dense model, GPT-OSS's clamped experts.
    for model in (("--model.name=llama3", "--model.flavor=debugmodel"),
                  ("--model.name=gpt_oss", "--model.flavor=debugmodel")):
        cfg = debug_config(FP8, *model)
        assert device_problems(cfg.model, cfg.float8, _factory(cfg)) == [], model
    monkeypatch.setattr(compat, "cuda_capability", lambda: (8, 0))  # before FP8 tensor cores: the GPU's own line
    cfg = debug_config(FP8, *MOE)
    (problem,) = device_problems(cfg.model, cfg.float8, _factory(cfg))
    assert "compute capability 8.0" in problem and "--float8.emulate" in problem


def _factory(cfg):  # noqa: ANN001, ANN202 - a JobConfig; the model builder preflight hands the check
    args = dataclasses.replace(model_args(cfg.model.name, cfg.model.flavor), vocab_size=2048)
    return lambda: get_model_spec(cfg.model.name).build(args)


def test_emulate_follows_the_option_and_the_cpu_kernel():
    from torchtitan.quantization.float8 import emulated

    if torch.__version__.startswith("2.13"):
        assert compat.scaled_mm_supported("cpu")  # torch 2.13's CPU build multiplies float8
    assert emulated(debug_config(FP8, "--float8.emulate").float8, "cpu")
    assert emulated(debug_config(FP8).float8, "cpu") == (not compat.scaled_mm_supported("cpu"))


def test_capability_check():
    assert checks.capability_problem(None, emulate=False) is None  # no GPU: the CPU path
    assert checks.capability_problem((9, 0), emulate=False) is None  # Hopper
    assert checks.capability_problem((8, 9), emulate=False) is None  # Ada
    assert checks.capability_problem((8, 0), emulate=True) is None  # emulated on an A100
    problem = checks.capability_problem((8, 0), emulate=False)
    assert problem is not None and "compute capability 8.0" in problem and "--float8.emulate" in problem


def _option_problems(*flags: str) -> list[str]:
    cfg = debug_config(*flags)
    return converter_problems(cfg.model, cfg.float8)


def test_option_checks():
    assert _option_problems(FP8) == []
    rowwise = _option_problems(FP8, "--float8.recipe_name=rowwise", "--float8.enable_fsdp_float8_all_gather")
    assert len(rowwise) == 1 and "needs one scale per tensor" in rowwise[0]
    precompute = _option_problems(FP8, "--float8.precompute_float8_dynamic_scale_for_fsdp")
    assert len(precompute) == 1 and "also set --float8.enable_fsdp_float8_all_gather" in precompute[0]
    assert _option_problems("--model.converters=int4") == [
        "--model.converters: unknown converter 'int4'; choose from float8"]
    assert _option_problems("--model.converters=float8,float8") == [
        "--model.converters=float8,float8: a converter is named twice"]
    # Without the converter the [float8] section is not looked at.
    assert _option_problems("--float8.precompute_float8_dynamic_scale_for_fsdp") == []


def test_torchao_version_range(monkeypatch):
    assert checks.torchao_problem() is None  # the installed torchao is the tested one
    monkeypatch.setattr(checks.metadata, "version", lambda name: "0.19.1")
    problem = checks.torchao_problem()
    assert problem is not None and "torchao 0.19.1 is not a tested version" in problem


def test_aligned_rows_start_every_group_at_a_multiple_of_16():
    counts = torch.tensor([3, 0, 17, 16, 1])
    destination, offsets, capacity = aligned_rows(counts, int(counts.sum()))
    assert offsets.tolist() == [16, 16, 48, 64, 80] and offsets.dtype == torch.int32
    assert capacity >= 80
    # The buffer's rows are a multiple of 16 too: the weight gradient reads it transposed (16-byte FP8 strides).
    for sizes in ([3, 0, 17, 16, 1], [3, 0, 17], [1]):
        assert aligned_rows(torch.tensor(sizes), sum(sizes))[2] % ALIGN == 0, sizes
    starts = [0, 16, 16, 48, 64]
    expected = [s + i for s, n in zip(starts, counts.tolist()) for i in range(n)]
    assert destination.tolist() == expected


def test_padded_grouped_mm_equals_the_per_group_product_forward_and_backward():
    from torchtitan.models.moe.experts import per_group_linear

    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 19, 16])
    x = torch.randn(int(counts.sum()), 32, requires_grad=True)
    w = torch.randn(4, 48, 32, requires_grad=True)
    seen: list[list[int]] = []

    def high_precision(buffer: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        seen.append(offsets.tolist())
        sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
        used = int(offsets[-1])
        out = per_group_linear(buffer[:used], weight_t.transpose(-2, -1), sizes)
        return torch.cat([out, out.new_zeros(buffer.shape[0] - used, out.shape[1])])

    out = padded_grouped_mm(x, w, counts, high_precision)
    assert all(o % ALIGN == 0 for o in seen[0])
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = per_group_linear(ref_x, ref_w, counts)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_declared_torchao_range_is_the_checked_one():
    import tomllib
    from conftest import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra in ("float8", "dev", "test"):  # scripts/install.sh installs dev
        assert checks.TORCHAO_PIN in extras[extra], extra
    low, high = checks.TORCHAO_TESTED
    assert checks.TORCHAO_PIN == f"torchao>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
