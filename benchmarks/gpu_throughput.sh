#!/usr/bin/env bash
# Single-GPU throughput: Llama 3 8B shapes with fewer layers (4 on an 80 GB H100, 8 on a
# 141 GB H200), seq 8192, bf16; eager/compile, with and without selective (op) AC; the
# project's model against a plain-PyTorch one in the same run. Arguments go to
# gpu_throughput.py (e.g. --layers 4 --steps 30 --json out.json). --smoke runs tiny shapes on CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ " $* " != *" --smoke "* ]] && ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: run with --smoke to check the script on CPU" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec python3 benchmarks/gpu_throughput.py "$@"
