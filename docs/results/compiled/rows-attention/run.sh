#!/usr/bin/env bash
# The several-rows attention through the in-place op (hf_treespec/compiled/cache_attention.py): the step alone,
# paired against two bmm per layer in one process (step_attention.py), then held-out ShareGPT prompts (the shipped
# drafter's dev split), six questions x 64 new tokens, greedy, bf16, 3 repeats (median kept), methods interleaved per
# question. Resumable: each part is skipped once its output exists.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/rows-attention
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
if ! grep -q "^| context" $OUT/step_attention.txt 2>/dev/null; then
  python $OUT/step_attention.py > $OUT/step_attention.txt.partial 2> $OUT/step_attention.log
  mv $OUT/step_attention.txt.partial $OUT/step_attention.txt
fi
METHODS="plain,openvino,plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=2,tree:salf@compile=true@tree_budget=4"
if [ ! -e $OUT/sharegpt-dev/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --out $OUT/sharegpt-dev --methods "$METHODS"
fi
# sampling at T=1 (the same prompts; no OpenVINO row: its loop is greedy only)
T1_METHODS="plain,plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=4,tree:dyspec@compile=true"
if [ ! -e $OUT/sharegpt-dev-t1/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --temperature 1.0 --out $OUT/sharegpt-dev-t1 --methods "$T1_METHODS"
fi
# T=1, DySpec's sampled trees at budgets the few-rows graph serves (its default 60 nodes verify 61 rows a step)
DY_METHODS="plain@compile=true,tree:salf@compile=true@tree_budget=4,tree:dyspec@compile=true@tree_budget=4,tree:dyspec@compile=true@tree_budget=8,tree:dyspec@compile=true@tree_budget=15"
if [ ! -e $OUT/sharegpt-dev-t1-dyspec/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --temperature 1.0 --out $OUT/sharegpt-dev-t1-dyspec --methods "$DY_METHODS"
fi
