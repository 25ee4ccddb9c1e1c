#!/usr/bin/env bash
# Install what the project needs into the current Python, without CUDA wheels on CPU-only machines.
#   PYTHON       interpreter to install into (default: python3)
#   TORCH_SPEC   torch requirement to install when torch >= 2.11 is missing
#                (default: "torch>=2.11" with a GPU, "torch==2.13.0" without one, the CPU build here;
#                elsewhere add e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
has_torch() {
  "$PY" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
}
if ! has_torch; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-"torch>=2.11"}
  else
    spec=${TORCH_SPEC:-"torch==2.13.0"}
  fi
  echo "install.sh: installing $spec"
  "$PY" -m pip install -q "$spec"
fi
# Pin the torch now installed, so nothing that depends on torch (transformers) pulls another build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" -c 'import torch; print("torch==" + torch.__version__)' >"$constraints"
"$PY" -m pip install -q -c "$constraints" -e ".[dev]"
