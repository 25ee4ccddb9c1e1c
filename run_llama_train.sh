#!/usr/bin/env bash
# Train on this machine, or on one node of several: one process per GPU, or 8 CPU processes
# (gloo) when there is no GPU.
#   NGPU           processes to start on this node (default: the number of GPUs, or 8 without one)
#   CONFIG_FILE    TOML config (default: train_configs/debug_model.toml); --job.config_file FILE among
#                  the arguments does the same, and naming different files in both is refused
#   LOG_RANK       local ranks whose output is shown, comma-separated (default: 0)
#   LAUNCH_PREFLIGHT  1 (default): check the config once here before torchrun, so a config error
#                  exits 2 with only its lines; 0 skips that (every rank still checks), one
#                  Python start less per launch
#   MAX_RESTARTS   times torchrun restarts the workers after a failure (default: 0); with
#                  --fault_tolerance.enable a restarted group heals from its live peers
#   PYTHON         the interpreter that runs everything here, torchrun and the ranks included
#                  (default: python3), as in scripts/test.sh and scripts/install.sh
# Several nodes (run this script once on each; see README "Multi-node"):
#   NNODES         nodes in the job (default: 1, which runs torchrun --standalone)
#   NODE_RANK      this node's index, 0..NNODES-1 (default: 0); node 0 hosts the rendezvous
#   MASTER_ADDR    node 0's address, reachable from every node (default: localhost)
#   MASTER_PORT    its port (default: 29500)
#   RDZV_ENDPOINT  host:port instead of MASTER_ADDR:MASTER_PORT
#   RDZV_ID        job id shared by the nodes (default: torchtitan)
#   LOCAL_ADDR     this node's address as the others reach it (default: what its host name resolves to)
# Extra arguments are config overrides, e.g. --training.steps 30.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY=${PYTHON:-python3}
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() or 8)")
fi
# The config: CONFIG_FILE, else the arguments' own --job.config_file, else the debug model. Both given
# are both passed on, and the config manager refuses them (exit 2, in the check below) if the files differ.
names_config_file() {
  local arg
  for arg in "$@"; do
    [[ "$arg" == --job.config_file || "$arg" == --job.config_file=* ]] && return 0
  done
  return 1
}
config=()
if [[ -n "${CONFIG_FILE:-}" ]]; then
  config=(--job.config_file "$CONFIG_FILE")
elif ! names_config_file "$@"; then
  config=(--job.config_file "$here/train_configs/debug_model.toml")
fi
LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
# One OpenMP thread per process: 8 CPU ranks on a small machine would otherwise oversubscribe it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A rank that dies of a native crash (SIGSEGV, SIGABRT) prints its Python stacks, not only torchrun's signal number.
export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
if [[ "$NNODES" == 1 ]]; then
  launch=(--standalone)
else
  endpoint=${RDZV_ENDPOINT:-"${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}"}
  # c10d rendezvous: node 0, which must be the host at the endpoint, serves the store and the
  # others join it. Said explicitly, since torchrun's guess from host names fails where an
  # address is not the one the host name resolves to. Each node gets a contiguous block of
  # NGPU global ranks.
  is_host=$([[ "${NODE_RANK:-0}" == 0 ]] && echo true || echo false)
  launch=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}" --rdzv_backend=c10d
          --rdzv_endpoint="$endpoint" --rdzv_id="${RDZV_ID:-torchtitan}" --rdzv_conf="is_host=$is_host")
  if [[ -n "${LOCAL_ADDR:-}" ]]; then
    launch+=(--local_addr="$LOCAL_ADDR")
  fi
fi
# Check the job once before any rank starts: a config problem exits 2 here with one line per
# problem, not inside torchrun's report of failed ranks. Each rank still checks for itself.
if [[ "${LAUNCH_PREFLIGHT:-1}" != 0 ]]; then
  WORLD_SIZE=$((NGPU * NNODES)) "$PY" "$here/train.py" --preflight_only ${config[@]+"${config[@]}"} "$@" \
    || exit $?
fi
# torchrun as a module of that interpreter: it starts the ranks with the same one.
exec "$PY" -m torch.distributed.run "${launch[@]}" --nproc_per_node="$NGPU" --max-restarts="${MAX_RESTARTS:-0}" --local-ranks-filter "$LOG_RANK" \
  "$here/train.py" ${config[@]+"${config[@]}"} "$@"
