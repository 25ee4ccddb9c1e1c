#!/usr/bin/env bash
# Set up (scripts/install.sh) and train the debug model on whatever devices this machine has.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
exec ./run_llama_train.sh "$@"
