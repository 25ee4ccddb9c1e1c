import pytest
import torch

from torchtitan.metrics import (
    MetricsLogger,
    Throughput,
    device_memory,
    format_duration,
    format_step_line,
    peak_flops,
    reset_peak_memory,
)

# --- peak FLOP/s table ----------------------------------------------------


@pytest.mark.parametrize(
    "device_name, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA B200", 2.25e15),
        ("AMD Instinct MI300X", 1307.4e12),
    ],
)
def test_peak_flops_bf16(device_name, expected):
    assert peak_flops(device_name) == expected
    assert peak_flops(device_name, torch.float16) == expected


def test_peak_flops_fp32_uses_tf32_rate():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == 494.7e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", torch.float32) == 156e12


@pytest.mark.parametrize("device_name", ["", "cpu", "Intel(R) Xeon(R)", "NVIDIA Tesla T9000"])
def test_peak_flops_unknown_is_none(device_name):
    assert peak_flops(device_name) is None


def test_peak_flops_unlisted_dtype_is_none():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None


# --- memory ---------------------------------------------------------------


def test_cpu_memory_reports_rss():
    memory = device_memory(torch.device("cpu"))
    assert memory["rss_gib"] > 0
    assert memory["peak_rss_gib"] >= memory["rss_gib"] * 0.99
    reset_peak_memory(torch.device("cpu"))
    assert device_memory(torch.device("cpu"))["peak_rss_gib"] > 0


# --- throughput -----------------------------------------------------------


def test_throughput_math():
    meter = Throughput(total_steps=100, flops_per_token=1e9, peak_flops=100e12)
    meter.record(step_time_s=2.0, data_time_s=0.2, tokens=4000)
    meter.record(step_time_s=2.0, data_time_s=0.2, tokens=4000)
    stats = meter.stats()
    assert stats.steps == 2
    assert stats.step_time_s == pytest.approx(2.0)
    assert stats.tokens_per_s == pytest.approx(2000.0)
    assert stats.tflops == pytest.approx(2.0)  # 1e9 * 2000 / 1e12
    assert stats.mfu_pct == pytest.approx(2.0)  # 2 TFLOP/s of 100
    assert stats.data_pct == pytest.approx(10.0)
    assert stats.eta_s == pytest.approx(98 * 2.0)


def test_throughput_unknown_peak_has_no_mfu():
    meter = Throughput(total_steps=10, flops_per_token=1e9, peak_flops=None)
    meter.record(1.0, 0.0, 1000)
    metrics = meter.metrics()
    assert meter.stats().mfu_pct is None
    assert "mfu_pct" not in metrics
    assert metrics["tflops"] == pytest.approx(1.0)


def test_throughput_window_and_resume():
    meter = Throughput(total_steps=10, start_step=5)
    assert meter.stats() is None
    assert meter.metrics() == {}
    meter.record(1.0, 0.5, 100)
    assert meter.stats().eta_s == pytest.approx(4.0)
    assert "tflops" not in meter.metrics()
    meter.reset_window()
    meter.record(3.0, 0.0, 300)
    stats = meter.stats()
    assert stats.steps == 1
    assert stats.tokens_per_s == pytest.approx(100.0)
    assert stats.eta_s == pytest.approx(9.0)


def test_throughput_step_timers():
    ticks = iter([10.0, 10.5, 12.0])
    meter = Throughput(total_steps=3, clock=lambda: next(ticks))
    meter.step_begin()
    meter.data_loaded()
    meter.step_end(tokens=200)
    stats = meter.stats()
    assert stats.step_time_s == pytest.approx(2.0)
    assert stats.data_pct == pytest.approx(25.0)
    assert stats.tokens_per_s == pytest.approx(100.0)


# --- TensorBoard logger -----------------------------------------------------


def _read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir)
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_metrics_logger_writes_tensorboard(tmp_path):
    log_dir = str(tmp_path / "tb")
    with MetricsLogger(log_dir, enable_tensorboard=True, rank=0) as metrics_logger:
        metrics_logger.log(1, {"loss": 2.5, "lr": 1e-4, "mfu_pct": None})
        metrics_logger.log(2, {"loss": 2.0, "lr": 2e-4})
    scalars = _read_scalars(log_dir)
    assert set(scalars) == {"loss", "lr"}
    assert scalars["loss"] == [(1, pytest.approx(2.5)), (2, pytest.approx(2.0))]
    assert scalars["lr"] == [(1, pytest.approx(1e-4)), (2, pytest.approx(2e-4))]


def test_metrics_logger_only_log_rank_writes(tmp_path):
    other = MetricsLogger(str(tmp_path / "other"), enable_tensorboard=True, rank=1)
    other.log(1, {"loss": 1.0})
    other.close()
    disabled = MetricsLogger(str(tmp_path / "off"), enable_tensorboard=False, rank=0)
    disabled.log(1, {"loss": 1.0})
    disabled.close()
    assert not (tmp_path / "other").exists()
    assert not (tmp_path / "off").exists()


# --- console line -----------------------------------------------------------


def test_format_step_line_gpu_fields():
    line = format_step_line(
        10,
        {
            "loss": 7.812345,
            "grad_norm": 1.25,
            "lr": 3e-4,
            "tps": 12345.6,
            "tflops": 321.5,
            "mfu_pct": 45.678,
            "max_reserved_gib": 60.5,
            "max_reserved_pct": 75.0,
            "data_pct": 1.5,
            "eta_s": 3723,
        },
    )
    for part in (
        "step: 10",
        "loss: 7.8123",
        "grad_norm: 1.2500",
        "lr: 3.0e-04",
        "tps: 12,346",
        "tflops: 321.50",
        "mfu: 45.68%",
        "memory: 60.50GiB (75.0%)",
        "data: 1.5%",
        "eta: 1:02:03",
    ):
        assert part in line


def test_format_step_line_cpu_omits_mfu():
    line = format_step_line(3, {"loss": 10.0, "tps": 50.0, "peak_rss_gib": 1.5})
    assert "mfu" not in line
    assert "tflops" not in line
    assert "memory: 1.50GiB rss" in line
    assert line.startswith("step: 3")


def test_format_duration():
    assert format_duration(0) == "0:00:00"
    assert format_duration(59.6) == "0:01:00"
    assert format_duration(90061) == "25:01:01"
    assert format_duration(float("inf")) == "?"
