#!/usr/bin/env bash
# The compiled prefill and the leaner draft-free sizing: the paired prompt forward (eager against compiled), then
# held-out ShareGPT prompts (the shipped drafter's dev split), six questions x 64 new tokens, greedy, bf16, 3 repeats
# (median kept), methods interleaved per question. Resumable: a part whose output exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/compiled-prefill
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
if [ ! -s $OUT/prefill.txt ]; then python $OUT/prefill.py > $OUT/prefill.tmp && mv $OUT/prefill.tmp $OUT/prefill.txt; fi
METHODS="plain,openvino,plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=4"
if [ ! -e $OUT/sharegpt-dev/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --out $OUT/sharegpt-dev --methods "$METHODS"
fi
