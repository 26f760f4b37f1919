#!/usr/bin/env bash
# The few-rows bf16 linear in inductor's several-rows graph (hf_treespec/compiled/few_rows_linear.py): the step alone,
# paired against inductor's own linears in one process (step_linear.py), then held-out ShareGPT prompts (the shipped
# drafter's dev split), six questions x 64 new tokens, greedy, bf16, 3 repeats (median kept), methods interleaved per
# question. Resumable: each part is skipped once its output exists.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/few-rows-linear
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
if ! grep -q "^| context" $OUT/step_linear.txt 2>/dev/null; then
  python $OUT/step_linear.py > $OUT/step_linear.txt.partial 2> $OUT/step_linear.log
  mv $OUT/step_linear.txt.partial $OUT/step_linear.txt
fi
METHODS="plain,openvino,plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=2,tree:salf@compile=true@tree_budget=4"
if [ ! -e $OUT/sharegpt-dev/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --out $OUT/sharegpt-dev --methods "$METHODS"
fi
