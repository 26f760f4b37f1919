#!/usr/bin/env bash
# Compile once per machine: the target's and the drafter's graphs as AOTInductor packages (hf_treespec/compiled/
# packaged.py). ready.py twice over a fresh package cache (the first process builds, the second loads), then the
# held-out ShareGPT prompts (the shipped drafter's dev split), six questions x 64 new tokens, greedy and T=1, bf16,
# 3 repeats (median kept), methods interleaved per question. Resumable: each part is skipped once its output exists.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/packaged-step
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_packaged_step}
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for run in first second; do
  if [ ! -s $OUT/ready_$run.json ]; then
    [ $run = first ] && rm -rf "$HF_TREESPEC_COMPILED_CACHE"
    python $OUT/ready.py > $OUT/ready_$run.json.partial 2> $OUT/ready_$run.log
    mv $OUT/ready_$run.json.partial $OUT/ready_$run.json
  fi
done
METHODS="plain,openvino,plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=2,tree:salf@compile=true@tree_budget=4"
if [ ! -e $OUT/sharegpt-dev/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --out $OUT/sharegpt-dev --methods "$METHODS"
fi
T1_METHODS="plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=4,tree:dyspec@compile=true@tree_budget=4"
if [ ! -e $OUT/sharegpt-dev-t1/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --temperature 1.0 --out $OUT/sharegpt-dev-t1 --methods "$T1_METHODS"
fi
