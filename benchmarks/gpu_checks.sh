#!/usr/bin/env bash
# Correctness on one CUDA device, in one go (benchmarks/README.md, "On a GPU"):
#   1. the tests that run in one process, on CUDA (pytest -k below; multi-rank gloo worlds are left out),
#      then the CUDA-only ones (pytest -m gpu);
#   2. the debug model trained by train.py in one process: fp32 and bf16, eager and compiled, with
#      selective (op) and full AC, seq 2048, batch 8; each run's log lands in $LOGS/<name>.log;
#   3. 100 steps of fp32 and of bf16 with the same seed, the curves docs/determinism.md shows
#      (compare them with scripts/loss_compare.py on the two logs).
# Usage: LOGS=outputs/gpu_checks bash benchmarks/gpu_checks.sh [--no-tests] [--no-runs]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGS=${LOGS:-outputs/gpu_checks}
mkdir -p "$LOGS"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 2

status=0
if [[ " $* " != *" --no-tests "* ]]; then
  # Single-process tests; the ones that spawn gloo worlds or torchrun jobs of several ranks
  # stay on CPU (several ranks sharing one GPU is not a layout anyone trains with).
  timeout 300 python3 -m pytest tests/models tests/optim tests/metrics tests/config tests/datasets \
    tests/test_trainer.py::test_single_process_cli_run_writes_config_and_tensorboard \
    tests/test_trainer.py::test_one_device_still_gets_the_mixed_precision_policy \
    -q -p no:cacheprovider --timeout 150 \
    2>&1 | tee "$LOGS/pytest.log" | tail -25 || status=1
  # The CUDA-only checks (marked gpu; skipped on a machine without CUDA).
  timeout 150 python3 -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$LOGS/pytest_gpu.log" | tail -5 \
    || status=1
fi

[[ " $* " == *" --no-runs "* ]] && exit $status
common=(--job.config_file train_configs/debug_model.toml --training.seq_len 2048 --training.batch_size 8
        --training.seed 42 --metrics.log_freq 1 --metrics.enable_tensorboard false)
run() {  # name, steps, extra overrides...
  local name=$1 steps=$2; shift 2
  python3 train.py "${common[@]}" --training.steps "$steps" --job.dump_folder "$LOGS/$name" "$@" \
    >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc; $(grep -E 'step: *[0-9]+' "$LOGS/$name.log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g')"
  return $rc
}
# Tiny model: the runs share the GPU side by side (compile uses the host's cores meanwhile).
pids=()
run fp32-eager-100 100 --training.mixed_precision_param float32 & pids+=($!)
run bf16-eager-100 100 --training.mixed_precision_param bfloat16 & pids+=($!)
run bf16-compile 30 --training.mixed_precision_param bfloat16 --training.compile & pids+=($!)
run fp32-compile 30 --training.mixed_precision_param float32 --training.compile & pids+=($!)
run bf16-compile-sac 30 --training.mixed_precision_param bfloat16 --training.compile \
  --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op & pids+=($!)
run bf16-eager-sac 30 --training.mixed_precision_param bfloat16 \
  --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op & pids+=($!)
run bf16-eager-full-ac 30 --training.mixed_precision_param bfloat16 --activation_checkpoint.mode full & pids+=($!)
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
