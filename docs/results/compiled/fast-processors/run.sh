#!/usr/bin/env bash
# The min-length processors computed without a vocabulary-wide isin (FAST_PROCESSORS; the bench forces 64 new tokens
# with min_new_tokens, so they run on every step, tree depth and draft round): held-out ShareGPT prompts (the shipped
# drafter's dev split), six questions x 64 new tokens, greedy, bf16, 3 repeats (median kept), methods interleaved per
# question. Resumable: skipped once its summary exists.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/fast-processors
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
METHODS="plain,openvino,plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=4"
if [ ! -e $OUT/sharegpt-dev/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --out $OUT/sharegpt-dev --methods "$METHODS"
fi
