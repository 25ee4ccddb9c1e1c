#!/usr/bin/env bash
# Train on this machine: one process per GPU, or 8 CPU processes (gloo) when there is no GPU.
#   NGPU         processes to start (default: the number of GPUs, or 8 without one)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK     ranks whose output is shown, comma-separated (default: 0)
# Extra arguments are config overrides, e.g. --training.steps 30.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count() or 8)")
fi
CONFIG_FILE=${CONFIG_FILE:-"$here/train_configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}
# One OpenMP thread per process: 8 CPU ranks on a small machine would otherwise oversubscribe it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --standalone --nproc_per_node="$NGPU" --local-ranks-filter "$LOG_RANK" \
  "$here/train.py" --job.config_file "$CONFIG_FILE" "$@"
