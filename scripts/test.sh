#!/usr/bin/env bash
# Set up (scripts/install.sh), lint (ruff), type-check (pyright; both configured in pyproject.toml)
# and run the whole test suite; extra arguments go to one plain pytest run instead of the parts below.
# The suite runs in two parts:
# 1. every test not marked `alone`, on PYTEST_WORKERS pytest-xdist workers (default 2), a test file to a
#    worker, so that a module's fixtures (often one torchrun launch for many checks) run once;
# 2. the `alone` tests, one at a time in one pytest, beside the integration matrix
#    (tests/integration_tests.py: every layout and feature trained end to end through run_llama_train.sh on
#    8 ranks, at the CI sizes of train_configs/debug_model_ci.toml, one launch at a time). The `alone`
#    tests wait on timeouts (a dead peer's, torchft's, a silent rank's): each has ranks of its own waiting,
#    and the matrix's launches use the cores meanwhile; they are kept off the xdist workers, whose two
#    streams of launches would load the machine more.
# INTEGRATION=0 skips the matrix (e.g. while iterating on one test).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m pyright
if [[ $# -gt 0 ]]; then
  "$PY" -m pytest tests -q --durations=15 "$@"
  [[ "${INTEGRATION:-1}" == 0 ]] && exit 0
  exec "$PY" tests/integration_tests.py "${INTEGRATION_OUTPUT:-outputs/integration}" --ngpu 8 --require-all
fi
"$PY" -m pytest tests -q --durations=15 -m "not alone" -n "${PYTEST_WORKERS:-2}" --dist loadfile
if [[ "${INTEGRATION:-1}" == 0 ]]; then
  exec "$PY" -m pytest tests -q --durations=10 -m alone
fi
alone_log=$(mktemp)
trap 'rm -f "$alone_log"' EXIT
"$PY" -m pytest tests -q --durations=10 -m alone >"$alone_log" 2>&1 &
alone=$!
matrix_rc=0
"$PY" tests/integration_tests.py "${INTEGRATION_OUTPUT:-outputs/integration}" --ngpu 8 --require-all || matrix_rc=$?
alone_rc=0
wait "$alone" || alone_rc=$?
echo "---- the alone tests (run beside the matrix) ----"
cat "$alone_log"
if (( matrix_rc != 0 || alone_rc != 0 )); then
  echo "scripts/test.sh: integration matrix exit $matrix_rc, alone tests exit $alone_rc" >&2
  exit 1
fi
