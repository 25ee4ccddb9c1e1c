#!/usr/bin/env bash
# Install what the project needs into the current Python, without CUDA wheels on CPU-only machines.
#   PYTHON       interpreter to install into (default: python3)
#   TORCH_SPEC   torch requirement to install when torch >= 2.11 is missing
#                (default: "torch>=2.11" with a GPU, "torch==2.13.0" without one, the CPU build here;
#                elsewhere add e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   EXTRAS       the package's extras to install (default: dev; e.g. "dev,wandb")
# A torch already installed (any build: CPU, CUDA, ROCm, a source build) is kept as it is.
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
# Pin the torch now installed, so nothing that depends on torch (transformers, torchft) pulls another
# build. The pin is the installed distribution's version as pip records it, not torch.__version__:
# PyPI's CUDA wheels install distribution "2.14.1" whose __version__ reads "2.14.1+cu130", and a
# "torch==2.14.1+cu130" pin matches no distribution pip knows (ResolutionImpossible).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - >"$constraints" <<'PY'
import importlib.metadata
try:
    print("torch==" + importlib.metadata.version("torch"))
except importlib.metadata.PackageNotFoundError:  # importable but unrecorded (a PYTHONPATH build): no pin
    pass
PY
pin=$(cat "$constraints")
echo "install.sh: keeping ${pin:-torch as it is (pip has no record of its distribution, so it is not pinned)}"
# The dev extra brings torchao (Float8 training, docs/float8.md) in its tested range, against the torch pinned here.
"$PY" -m pip install -q -c "$constraints" -e ".[${EXTRAS:-dev}]"
