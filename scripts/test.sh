#!/usr/bin/env bash
# Set up (scripts/install.sh), lint (ruff), type-check (pyright; both configured in pyproject.toml)
# and run the whole test suite; extra arguments go to pytest.
# Then the integration matrix (tests/integration_tests.py): every layout and feature trained
# end to end through run_llama_train.sh on 8 ranks, at the CI sizes of
# train_configs/debug_model_ci.toml. INTEGRATION=0 skips it (e.g. while iterating on one test).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"${PYTHON:-python3}" -m ruff check .
"${PYTHON:-python3}" -m pyright
"${PYTHON:-python3}" -m pytest tests -q --durations=15 "$@"
if [[ "${INTEGRATION:-1}" != 0 ]]; then
  exec "${PYTHON:-python3}" tests/integration_tests.py "${INTEGRATION_OUTPUT:-outputs/integration}" --ngpu 8 --require-all
fi
