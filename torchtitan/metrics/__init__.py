from torchtitan.metrics.device_info import device_memory, peak_flops, reset_peak_memory
from torchtitan.metrics.logger import MetricsLogger, format_duration, format_step_line
from torchtitan.metrics.throughput import Throughput, ThroughputStats

__all__ = [
    "MetricsLogger",
    "Throughput",
    "ThroughputStats",
    "device_memory",
    "format_duration",
    "format_step_line",
    "peak_flops",
    "reset_peak_memory",
]
