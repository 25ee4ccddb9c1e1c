"""The shapes and the table of ``benchmarks/gpu_moe.sh``.

    python benchmarks/gpu_moe_summary.py --write-flavors DIR --layers 4   # the release folders the runs train
    python benchmarks/gpu_moe_summary.py LOG [LOG ...]                   # one table row per train.py log
                                                                         # (the planner's beside it: LOG's .plan.json)
    python benchmarks/gpu_moe_summary.py --trace rank0_trace.json          # GPU kernel time by kind

The flavors are released shapes cut to ``--layers`` layers, written as release folders (a Hugging Face
``config.json`` for Qwen3-30B-A3B, DeepSeek-V3's MLA at Moonlight-16B's shape and GPT-OSS 20b, Meta's
``params.json`` for Llama 3 8B), so that ``train.py`` and ``scripts/plan.py`` read the same model from
``--model.flavor DIR``. A row gives the median tokens/s over the steps after the third (compile and the
allocator warm up in the first ones) and the reserved peak of the last step, both as the step line prints them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WARM_UP_STEPS = 3
_STEP = re.compile(r"step: *(\d+) .*?tps: ([\d,]+).*?memory: ([\d.]+)GiB")


def write_flavors(folder: Path, layers: int) -> None:
    import torch

    from torchtitan.models import get_model_spec
    from torchtitan.models.deepseek_v3.args import deepseek_v3_flavors
    from torchtitan.models.gpt_oss.args import gpt_oss_flavors
    from torchtitan.models.qwen3.args import qwen3_flavors

    hf_cut = {  # family, folder name, the release cut to `layers` layers (a Hugging Face config.json each)
        "qwen3": (f"qwen3_30b_a3b_{layers}l", dataclasses.replace(qwen3_flavors["30B-A3B"], n_layers=layers)),
        # MLA at Moonlight-16B-A3B's shape (DeepSeek-V3's attention without the query LoRA); layer 0 dense.
        "deepseek_v3": (f"deepseek_v3_16b_{layers}l",
                        dataclasses.replace(deepseek_v3_flavors["16B"], n_layers=layers)),
        # Sinks, sliding windows of 128 on the even layers; layer_types () is the releases' alternation again.
        "gpt_oss": (f"gpt_oss_20b_{layers}l", dataclasses.replace(gpt_oss_flavors["20b"], n_layers=layers,
                                                                   layer_types=())),
    }
    for family, (name, args) in hf_cut.items():
        release = folder / name
        release.mkdir(parents=True, exist_ok=True)
        config = get_model_spec(family).state_dict_adapter.hf_config(args, bos_id=None, eos_id=None,
                                                                      dtype=torch.bfloat16)
        (release / "config.json").write_text(json.dumps(config, indent=1))
    llama = folder / f"llama3_8b_{layers}l"
    llama.mkdir(parents=True, exist_ok=True)
    (llama / "params.json").write_text(json.dumps({  # Meta's Llama 3 8B params.json, fewer layers
        "dim": 4096, "n_layers": layers, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "multiple_of": 1024,
        "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 500000.0}))
    print(f"release folders in {folder}: {', '.join(name for name, _ in hf_cut.values())}, {llama.name}")


def planned(log: Path) -> str:
    """The planner's tokens/s and GiB for the run of ``log``, from ``NAME.plan.json`` beside it (written by
    ``PLAN_CLUSTER=... benchmarks/gpu_frontier.sh``: the same train.py arguments through scripts/plan.py)."""
    plan = log.with_suffix(".plan.json")
    if not plan.exists():
        return " | "
    try:
        found = json.loads(plan.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f" (unreadable: {plan.name}) | "
    return f" {found['tokens_per_second_per_gpu']:,.0f} | {found['peak_memory_gib']:.1f}"


def row(log: Path) -> str:
    if not log.exists():
        return f"| {log.stem} | (no log) | |{planned(log)} |"
    steps = [(int(m[1]), float(m[2].replace(",", "")), float(m[3]))
             for m in map(_STEP.search, log.read_text(errors="replace").splitlines()) if m]
    timed = [tps for step, tps, _ in steps if step > WARM_UP_STEPS]
    if not timed:
        return f"| {log.stem} | (no step after {WARM_UP_STEPS} logged) | |{planned(log)} |"
    return f"| {log.stem} | {statistics.median(timed):,.0f} | {steps[-1][2]:.2f} |{planned(log)} |"


# Kernel kinds, by the first pattern that matches a kernel's name (case-insensitive).
KERNEL_KINDS = [
    ("grouped GEMM", r"grouped|group_gemm|ragged"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|cublas|matmul"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("sort, gather, scatter", r"sort|scatter|gather|index|radix|cub::|histogram|bincount|cumsum|scan"),
    ("copy", r"memcpy|memset|copy"),
    ("optimizer", r"multi_tensor|adam"),
    ("elementwise and reductions", r"elementwise|vectorized|reduce|norm|softmax|cross_entropy|triton"),
]


def kernel_time(trace: Path) -> None:
    """GPU time of a torch.profiler Chrome trace's kernels, by kind, and the largest kernels (ms)."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    kernels = [(e["name"], e.get("dur", 0) / 1000) for e in events if e.get("cat") == "kernel"]
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for name, ms in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.I)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        by_name[name] = by_name.get(name, 0.0) + ms
    total = sum(by_kind.values())
    print("| kernel kind | ms | share |\n|---|---|---|")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {ms:.1f} | {100 * ms / max(total, 1e-9):.0f}% |")
    print(f"| all kernels | {total:.1f} | |\n\nlargest kernels (ms):")
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {ms:8.1f}  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="*", type=Path)
    p.add_argument("--write-flavors", type=Path, help="write the release folders here and stop")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--trace", type=Path, help="print the GPU kernel time of this profiler trace by kind and stop")
    a = p.parse_args()
    if a.trace:
        kernel_time(a.trace)
        return
    if a.write_flavors:
        write_flavors(a.write_flavors, a.layers)
        return
    print("| run | tokens/s (median, steps > 3) | reserved GiB (last step) | planner tokens/s | planner GiB |\n"
          "|---|---|---|---|---|")
    for log in a.logs:
        print(row(log))


if __name__ == "__main__":
    main()
