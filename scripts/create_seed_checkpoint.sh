#!/usr/bin/env bash
# Write an initialized model as checkpoint step 0, on one process (a CPU is enough).
# Any layout then starts from it with --checkpoint.enable_checkpoint and the same dump folder.
#   CONFIG_FILE  TOML config (default: the arguments' own --job.config_file, else train_configs/debug_model.toml;
#                both given and naming different files are refused, exit 2)
# Extra arguments are config overrides, e.g. --job.dump_folder ./outputs/run1.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# As run_llama_train.sh: CONFIG_FILE, else the arguments' --job.config_file, else the debug model.
config=()
if [[ -n "${CONFIG_FILE:-}" ]]; then
  config=(--job.config_file "$CONFIG_FILE")
else
  config=(--job.config_file "$here/train_configs/debug_model.toml")
  for arg in "$@"; do
    [[ "$arg" == --job.config_file || "$arg" == --job.config_file=* ]] && config=()
  done
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# One process whatever the config says: every parallel degree is 1 and torchrun's variables are dropped.
exec env -u RANK -u WORLD_SIZE -u LOCAL_RANK "${PYTHON:-python3}" "$here/train.py" "${config[@]}" \
  --checkpoint.create_seed_checkpoint \
  --parallelism.data_parallel_replicate_degree=1 --parallelism.data_parallel_shard_degree=-1 \
  --parallelism.tensor_parallel_degree=1 --parallelism.context_parallel_degree=1 \
  --parallelism.pipeline_parallel_degree=1 "$@"
