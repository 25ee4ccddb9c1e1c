#!/usr/bin/env bash
# Set up (scripts/install.sh), lint (ruff), type-check (pyright; both configured in pyproject.toml)
# and run the whole test suite; extra arguments go to one plain pytest run instead of the two below.
# The suite runs in two parts. First every test not marked `alone`, on PYTEST_WORKERS pytest-xdist
# workers (default 2), a test file to a worker (its module fixtures, often one torchrun launch for
# many checks, run once): a worker that waits on its launch's ranks leaves the core to the other.
# Then the `alone` tests, one at a time, with nothing beside them: each waits on a timeout (a
# collective's, torchft's, a dead peer's) that a machine loaded by another launch could trip.
# Then the integration matrix (tests/integration_tests.py): every layout and feature trained end to end
# through run_llama_train.sh on 8 ranks, at the CI sizes of train_configs/debug_model_ci.toml.
# INTEGRATION=0 skips it (e.g. while iterating on one test).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m pyright
if [[ $# -gt 0 ]]; then
  "$PY" -m pytest tests -q --durations=15 "$@"
else
  "$PY" -m pytest tests -q --durations=15 -m "not alone" -n "${PYTEST_WORKERS:-2}" --dist loadfile
  "$PY" -m pytest tests -q --durations=5 -m alone
fi
if [[ "${INTEGRATION:-1}" != 0 ]]; then
  exec "$PY" tests/integration_tests.py "${INTEGRATION_OUTPUT:-outputs/integration}" --ngpu 8 --require-all
fi
