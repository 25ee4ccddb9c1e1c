#!/usr/bin/env bash
# Mixture of experts on one CUDA device, in one go (benchmarks/README.md, "MoE on a GPU"):
#   1. throughput through train.py in one process: Qwen3-30B-A3B shapes (seq 4096) and Llama 3 8B shapes
#      (seq 8192) cut to $LAYERS layers (default 4), batch 1, bf16 compute over float32 master weights,
#      eager and compiled, one run at a time; benchmarks/gpu_moe_summary.py reads tokens/s and the reserved
#      peak off the step lines, and scripts/plan.py predicts the same runs (world size 1) for the table;
#   2. the Qwen3-MoE debug model trained on CUDA, 30 steps: eager, compiled, and with the routing bias and
#      the sequence-wise auxiliary loss;
#   3. on the same machine's CPU (its torch, gloo): tests/distributed/test_moe_layouts.py, which trains EP
#      with TP, CP and PP.
# Usage: LOGS=outputs/gpu_moe bash benchmarks/gpu_moe.sh [--no-throughput] [--no-debug] [--no-cpu-tests]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGS=${LOGS:-outputs/gpu_moe}
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-12}
mkdir -p "$LOGS"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python3 benchmarks/gpu_moe_summary.py --write-flavors "$LOGS" --layers "$LAYERS" || exit 2

status=0
run() {  # name, config, steps, extra overrides...
  local name=$1 config=$2 steps=$3; shift 3
  python3 train.py --job.config_file "$config" --training.steps "$steps" --training.seed 42 \
    --metrics.log_freq 1 --metrics.enable_tensorboard false --job.dump_folder "$LOGS/$name" "$@" \
    >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc; $(grep -E 'step: *[0-9]+' "$LOGS/$name.log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g')"
  return $rc
}

if [[ " $* " != *" --no-throughput "* ]]; then
  moe=(train_configs/qwen3_debug_moe.toml "$STEPS" --model.flavor "$LOGS/qwen3_30b_a3b_${LAYERS}l"
       --training.seq_len 4096 --training.batch_size 1)
  dense=(train_configs/debug_model.toml "$STEPS" --model.flavor "$LOGS/llama3_8b_${LAYERS}l"
         --training.seq_len 8192 --training.batch_size 1)
  run moe-eager "${moe[@]}" || status=1
  run moe-compile "${moe[@]}" --training.compile || status=1
  run dense-eager "${dense[@]}" || status=1
  run dense-compile "${dense[@]}" --training.compile || status=1
  python3 benchmarks/gpu_moe_summary.py "$LOGS"/{moe,dense}-{eager,compile}.log | tee "$LOGS/throughput.md"
fi

if [[ " $* " != *" --no-debug "* ]]; then
  debug=(train_configs/qwen3_debug_moe.toml 30 --training.seq_len 2048 --training.batch_size 4)
  pids=()  # tiny model: the runs share the GPU side by side
  run debug-moe-eager "${debug[@]}" & pids+=($!)
  run debug-moe-compile "${debug[@]}" --training.compile & pids+=($!)
  run debug-moe-balanced "${debug[@]}" --moe.load_balance_coeff 1e-3 --moe.aux_loss sequence & pids+=($!)
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  for f in "$LOGS"/debug-moe-*.log; do grep -q "Training done" "$f" || { echo "$f: did not finish"; status=1; }; done
fi

if [[ " $* " != *" --no-cpu-tests "* ]]; then
  CUDA_VISIBLE_DEVICES="" timeout 400 python3 -m pytest tests/distributed/test_moe_layouts.py -q -p no:cacheprovider \
    2>&1 | tee "$LOGS/test_moe_layouts.log" | tail -5 || status=1
fi
exit $status
