#!/usr/bin/env bash
# What only a GPU shows, in one go on one CUDA device (benchmarks/README.md, "GPU tier and the frontier recipe"):
#   tier       the `gpu` test tier first (python -m pytest -m gpu): CUDA kernels without a CPU path;
#   peer       the TorchTitan ratio: the project against the peer (TorchTitan from PyPI, installed apart in
#              $PEER_SITE) on the Llama 3 8B shape cut to $LAYERS layers, seq 8192, eager then compiled,
#              taking turns (benchmarks/gpu_throughput.py);
#   attention  block_causal (FlexAttention) against causal (SDPA) through train.py on the same 8B cut,
#              eager and compiled: tokens/s and reserved memory (benchmarks/gpu_moe_summary.py reads them);
#   moe        the CUTLASS grouped GEMM against the per-expert loop on MoE expert shapes
#              (benchmarks/moe_grouped_mm.py --device cuda);
#   float8     the 8B cut with and without Float8 (tensorwise, rowwise), eager and compiled, through train.py.
# Usage: LOGS=outputs/gpu_frontier PEER_SITE=/path bash benchmarks/gpu_frontier.sh [PART ...]  (default: all)
# Each part's log lands in $LOGS; a part that fails is reported and the next one runs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGS=${LOGS:-outputs/gpu_frontier}
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-12}
mkdir -p "$LOGS"
parts=("$@")
((${#parts[@]})) || parts=(tier peer attention moe float8)
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
status=0
note() { echo "== $* ($(date +%T))"; }

if want tier; then
  note "gpu tier"
  timeout 180 python3 -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tee "$LOGS/gpu_tier.log" | tail -15 || status=1
fi

if want peer; then
  note "peer ratio"
  if [[ -z "${PEER_SITE:-}" ]]; then echo "peer: PEER_SITE is not set"; status=1
  else
    timeout 330 python3 benchmarks/gpu_throughput.py --layers "$LAYERS" --steps "$STEPS" --warmup 4 \
      --variants project-eager,torchtitan-eager,project-compile,torchtitan-compile --peer-site "$PEER_SITE" \
      --json "$LOGS/peer.json" 2>&1 | tee "$LOGS/peer.log" | grep -vE '^\{' | tail -20 || status=1
  fi
fi

train() {  # name, extra overrides...: the 8B cut through train.py, one process
  local name=$1; shift
  python3 train.py --job.config_file train_configs/debug_model.toml --model.flavor "$LOGS/llama3_8b_${LAYERS}l" \
    --training.seq_len 8192 --training.batch_size 1 --training.steps "$STEPS" --training.seed 42 \
    --metrics.log_freq 1 --metrics.enable_tensorboard false --job.dump_folder "$LOGS/$name" "$@" \
    >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc; $(grep -E '(^|[^n] )step: *[0-9]+' "$LOGS/$name.log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g')"
  return $rc
}
if want attention || want float8; then
  python3 benchmarks/gpu_moe_summary.py --write-flavors "$LOGS" --layers "$LAYERS" || exit 2
fi

if want attention; then
  note "attention"
  for mode in eager compile; do
    flag=(); [[ $mode == compile ]] && flag=(--training.compile)
    train "attn-causal-$mode" --model.attn_mask_type causal "${flag[@]}" || status=1
    train "attn-block_causal-$mode" --model.attn_mask_type block_causal "${flag[@]}" || status=1
  done
  python3 benchmarks/gpu_moe_summary.py "$LOGS"/attn-*.log | tee "$LOGS/attention.md"
fi

if want moe; then
  note "moe grouped GEMM"
  timeout 300 python3 benchmarks/moe_grouped_mm.py --device cuda --rounds 3 --repeats 3 2>&1 \
    | tee "$LOGS/moe_grouped_mm.log" || status=1
fi

if want float8; then
  note "float8"
  if ! python3 -c "import torchao" 2>/dev/null; then echo "float8: torchao is not installed"; status=1
  else
    for mode in eager compile; do
      flag=(); [[ $mode == compile ]] && flag=(--training.compile)
      train "fp8-none-$mode" "${flag[@]}" || status=1
      for recipe in tensorwise rowwise; do
        train "fp8-$recipe-$mode" --model.converters float8 --float8.recipe_name "$recipe" "${flag[@]}" || status=1
      done
    done
    python3 benchmarks/gpu_moe_summary.py "$LOGS"/fp8-*.log | tee "$LOGS/float8.md"
  fi
fi
exit $status
