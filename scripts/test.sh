#!/usr/bin/env bash
# Set up (scripts/install.sh), lint (ruff), type-check (pyright; both configured in pyproject.toml)
# and run the whole test suite; extra arguments go to one plain pytest run (then the matrix) instead.
# The suite runs as two streams side by side, since much of each is waiting (on ranks, on timeouts):
# 1. every test not marked `alone`, one at a time, its output here as it comes;
# 2. the `alone` tests, one at a time (each waits on a timeout: a dead peer's, torchft's, a silent
#    rank's), then the integration matrix (tests/integration_tests.py: every layout and feature trained
#    end to end through run_llama_train.sh on 8 ranks, at the CI sizes of train_configs/debug_model_ci.toml,
#    one launch at a time); its output follows the first stream's.
# INTEGRATION=0 skips the matrix (e.g. while iterating on one test).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m pyright
matrix() {
  [[ "${INTEGRATION:-1}" == 0 ]] && return 0
  "$PY" tests/integration_tests.py "${INTEGRATION_OUTPUT:-outputs/integration}" --ngpu 8 --require-all
}
if [[ $# -gt 0 ]]; then
  "$PY" -m pytest tests -q --durations=15 "$@"
  matrix
  exit
fi
second_log=$(mktemp)
trap 'rm -f "$second_log"' EXIT
( rc=0
  "$PY" -m pytest tests -q --durations=10 -m alone || rc=1
  matrix || rc=1
  exit $rc ) >"$second_log" 2>&1 &
second=$!
first_rc=0
"$PY" -m pytest tests -q --durations=15 -m "not alone" || first_rc=$?
second_rc=0
wait "$second" || second_rc=$?
echo "---- the second stream: the alone tests, then the integration matrix ----"
cat "$second_log"
if (( first_rc != 0 || second_rc != 0 )); then
  echo "scripts/test.sh: tests not marked alone exit $first_rc; alone tests and matrix exit $second_rc" >&2
  exit 1
fi
