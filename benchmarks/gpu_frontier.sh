#!/usr/bin/env bash
# What only a GPU shows, in one go on one CUDA device (benchmarks/README.md §25 and §32):
#   tier       the `gpu` test tier first (python -m pytest -m gpu over the files that carry the mark);
#   peer       the TorchTitan ratio: the project against the peer (TorchTitan from PyPI, installed apart in
#              $PEER_SITE; 0.2.2 imports on torch 2.11, 0.3.0 does not) on the Llama 3 8B shape cut to $LAYERS
#              layers, seq 8192, eager then compiled, taking turns (benchmarks/gpu_throughput.py);
#   float8     the same 8B cut compiled with Float8 linears (tensorwise, rowwise) against bf16, through
#              gpu_throughput.py (one invocation with `peer` when both are asked: they share project-compile);
#   attention  block_causal (FlexAttention) against causal (SDPA) through train.py on the same 8B cut,
#              eager and compiled: tokens/s and reserved memory (benchmarks/gpu_moe_summary.py reads them);
#   moe        the CUTLASS grouped GEMM against the per-expert loop on MoE expert shapes
#              (benchmarks/moe_grouped_mm.py --device cuda);
#   moe_train  Qwen3-30B-A3B cut to $LAYERS layers, seq 4096, eager, through train.py;
#   mla_sinks  MLA (DeepSeek-V3's attention at Moonlight-16B's shape) and GPT-OSS 20b (sinks, sliding windows
#              of 128) cut to $LAYERS layers, seq $SEQ_ATTN, block_causal (FlexAttention on CUDA), through train.py.
# Usage: LOGS=outputs/gpu_frontier PEER_SITE=/path bash benchmarks/gpu_frontier.sh [PART ...]  (default: all)
#        PLAN_CLUSTER=h200 bash benchmarks/gpu_frontier.sh [PART ...]   (no GPU: every run's train.py arguments
#        go to scripts/plan.py instead, which checks them and writes the planner's prediction, NAME.plan.json)
# Each part's log lands in $LOGS; a part that fails is reported and the next one runs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGS=${LOGS:-outputs/gpu_frontier}
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-4}
SEQ_ATTN=${SEQ_ATTN:-4096}
PLAN_CLUSTER=${PLAN_CLUSTER:-}
mkdir -p "$LOGS"
parts=("$@")
((${#parts[@]})) || parts=(tier peer float8 attention moe moe_train mla_sinks)
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }
if [[ -z $PLAN_CLUSTER ]]; then
  python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 2
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
fi
status=0
note() { echo "== $* ($(date +%T))"; }

# One train.py run in one process, or with PLAN_CLUSTER the planner's prediction of that same run.
train() {  # name, config, extra overrides...
  local name=$1 config=$2; shift 2
  local args=(--job.config_file "$config" --training.batch_size 1 --training.steps "$STEPS" --training.seed 42
              --metrics.log_freq 1 --metrics.enable_tensorboard false --job.dump_folder "$LOGS/$name" "$@")
  if [[ -n $PLAN_CLUSTER ]]; then
    python3 scripts/plan.py --cluster "$PLAN_CLUSTER" --world_size 1 --json "${args[@]}" >"$LOGS/$name.plan.json" \
      2>"$LOGS/$name.plan.err"
    local rc=$?
    echo "$name: plan exit $rc; $(tail -c 300 "$LOGS/$name.plan.json")"
    return $rc
  fi
  python3 train.py "${args[@]}" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc; $(grep -E '(^|[^n] )step: *[0-9]+' "$LOGS/$name.log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g')"
  return $rc
}
dense() {  # name, extra overrides...: the 8B cut at seq 8192
  local name=$1; shift
  train "$name" train_configs/debug_model.toml --model.flavor "$LOGS/llama3_8b_${LAYERS}l" --training.seq_len 8192 "$@"
}
python3 benchmarks/gpu_moe_summary.py --write-flavors "$LOGS" --layers "$LAYERS" || exit 2

if want tier; then
  note "gpu tier"
  if [[ -n $PLAN_CLUSTER ]]; then echo "tier: needs a GPU (skipped while planning)"
  else
    # The files that carry the mark, not all of tests/: collecting the whole suite costs time, and one
    # unrelated module that fails to import would stop the session before any gpu test ran.
    mapfile -t gpu_files < <(grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort)
    timeout 240 python3 -m pytest -m gpu "${gpu_files[@]}" -q -p no:cacheprovider -rfEs 2>&1 \
      | tee "$LOGS/gpu_tier.log" | tail -25 || status=1
  fi
fi

if want peer || want float8; then
  note "peer ratio and Float8 (gpu_throughput.py)"
  variants=()
  want peer && variants+=(project-eager torchtitan-eager project-compile torchtitan-compile)
  want float8 && ! want peer && variants+=(project-compile)
  want float8 && variants+=(project-compile-fp8tw project-compile-fp8rw)
  if [[ -n $PLAN_CLUSTER ]]; then  # the same runs as train.py would train them
    want peer && { dense 8b-eager || status=1; }
    dense 8b-compile --training.compile || status=1
    if want float8; then
      for recipe in tensorwise rowwise; do
        dense "8b-fp8-$recipe-compile" --training.compile --model.converters float8 --float8.recipe_name "$recipe" \
          || status=1
      done
    fi
  elif want peer && [[ -z "${PEER_SITE:-}" ]]; then echo "peer: PEER_SITE is not set"; status=1
  else
    peer=(); want peer && peer=(--peer-site "$PEER_SITE")
    variant_list=$(IFS=,; echo "${variants[*]}")
    timeout 420 python3 benchmarks/gpu_throughput.py --layers "$LAYERS" --steps "$STEPS" --warmup "$WARMUP" \
      --variants "$variant_list" "${peer[@]}" --json "$LOGS/throughput.json" 2>&1 \
      | tee "$LOGS/throughput.log" | grep -vE '^\{' | tail -20 || status=1
  fi
fi

if want attention; then
  note "attention"
  for mode in eager compile; do
    flag=(); [[ $mode == compile ]] && flag=(--training.compile)
    dense "attn-causal-$mode" --model.attn_mask_type causal "${flag[@]}" || status=1
    dense "attn-block_causal-$mode" --model.attn_mask_type block_causal "${flag[@]}" || status=1
  done
  [[ -z $PLAN_CLUSTER ]] && python3 benchmarks/gpu_moe_summary.py "$LOGS"/attn-*.log | tee "$LOGS/attention.md"
fi

if want moe; then
  note "moe grouped GEMM"
  if [[ -n $PLAN_CLUSTER ]]; then echo "moe: needs a GPU (skipped while planning)"
  else
    timeout 300 python3 benchmarks/moe_grouped_mm.py --device cuda --rounds 3 --repeats 3 2>&1 \
      | tee "$LOGS/moe_grouped_mm.log" || status=1
  fi
fi

if want mla_sinks; then
  note "MLA and GPT-OSS sinks on CUDA (FlexAttention)"
  long=(--training.seq_len "$SEQ_ATTN" --model.attn_mask_type block_causal)
  train mla-deepseek_v3_16b train_configs/deepseek_v3_debug.toml --model.flavor "$LOGS/deepseek_v3_16b_${LAYERS}l" \
    "${long[@]}" || status=1
  train sinks-gpt_oss_20b train_configs/gpt_oss_debug.toml --model.flavor "$LOGS/gpt_oss_20b_${LAYERS}l" \
    "${long[@]}" || status=1
  [[ -z $PLAN_CLUSTER ]] && python3 benchmarks/gpu_moe_summary.py "$LOGS"/{mla,sinks}-*.log | tee "$LOGS/mla_sinks.md"
fi

if want moe_train; then
  note "Qwen3-30B-A3B cut, eager"
  train moe-qwen3_30b_a3b train_configs/qwen3_debug_moe.toml --model.flavor "$LOGS/qwen3_30b_a3b_${LAYERS}l" \
    --training.seq_len 4096 || status=1
  [[ -z $PLAN_CLUSTER ]] && python3 benchmarks/gpu_moe_summary.py "$LOGS"/moe-*.log | tee "$LOGS/moe_train.md"
fi
exit $status
