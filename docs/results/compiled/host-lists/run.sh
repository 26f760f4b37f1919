#!/usr/bin/env bash
# Tree steps with their host bookkeeping on Python lists (SALF's search, the trees' fields, the drafter's and the
# target's tree rows, greedy verification, the stopping criteria) against plain decoding through the same compiled
# steps, on a 2-core CPU with avx512_bf16 (bf16, 2 threads). Held-out ShareGPT prompts (the shipped drafter's dev
# split), 64 new tokens, 3 repeats (median kept), methods interleaved per question: 1. T=1 at batch 1 (twelve
# questions); 2. batch 4 greedy (eight questions in left-padded batches of four); then the host tensor ops a step
# (`../probe-verdict/host_ops.py`). Part 3 is `host_ab.sh`: host time a step of this code against the code before.
# Packages go to $PACKAGE_CACHE (default /tmp/hf_treespec_host_lists). Resumable: a part whose output exists is
# skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_host_lists}
OUT=docs/results/compiled/host-lists
lscpu | grep -E "Model name"
grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 \
    --dataset sharegpt-dev --out "$folder" "$@"
}
C="@compile=true"
run t1 --num-questions 12 --temperature 1.0 \
  --methods "plain$C,tree:salf$C,tree:swor$C@tree_budget=auto,tree:dyspec$C@tree_depth=1@tree_budget=3"
run b4-greedy --num-questions 8 --batch-size 4 --methods "plain$C,tree:salf$C,tree:salf$C@tree_budget=2"
# the host tensor ops a step by function, with the packages built above
[ -e "$OUT/host_ops.txt" ] || {
  python docs/results/compiled/probe-verdict/host_ops.py > "$OUT/host_ops.tmp"
  mv "$OUT/host_ops.tmp" "$OUT/host_ops.txt"; }
