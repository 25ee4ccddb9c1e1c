#!/usr/bin/env bash
# Run the test suite on a given torch release, in a venv of its own (made once, then reused).
#   scripts/test_torch.sh 2.14.1 [pytest arguments]      e.g. INTEGRATION=0 scripts/test_torch.sh 2.14.1 -x
#   VENV_ROOT    where the venvs live (default: ${TMPDIR:-/tmp}/torchtitan-venvs; one per version)
#   TORCH_SPEC   the requirement to install (default: torch==VERSION; e.g. with a +cpu local version)
#   INTEGRATION  0 skips the 8-rank integration matrix after pytest (see scripts/test.sh)
# The venv gets that torch first, then scripts/install.sh keeps it and installs the rest against it.
# Versions tested so far, and how: docs/versions.md.
set -euo pipefail
version=${1:?usage: scripts/test_torch.sh TORCH_VERSION [pytest arguments]}
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${VENV_ROOT:-${TMPDIR:-/tmp}/torchtitan-venvs}/torch-$version
if [[ ! -x "$venv/bin/python" ]]; then
  echo "test_torch.sh: making $venv"
  python3 -m venv "$venv"
fi
installed() {
  "$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}
have=$(installed)
if [[ "${have%%+*}" != "$version" ]]; then  # a +cpu/+cu local label still counts as that version
  "$venv/bin/python" -m pip install -q "${TORCH_SPEC:-torch==$version}"
  have=$(installed)
fi
if [[ "${have%%+*}" != "$version" ]]; then
  echo "test_torch.sh: asked for torch $version, but $venv has torch ${have:-none}" >&2
  exit 1
fi
echo "test_torch.sh: torch $have in $venv"
# On PATH first too, for anything the tests start as python3 or torchrun.
PATH="$venv/bin:$PATH" PYTHON="$venv/bin/python" exec bash scripts/test.sh "$@"
