#!/usr/bin/env bash
# `auto` and the best fixed trees over plain decoding through the same compiled steps, on a 2-core CPU with
# avx512_bf16 (bf16, 2 threads), after two changes: a probe switches drafting back on only on a positive mean gain,
# and sampling's warpers run over the drafter's reduced vocabulary alone. Held-out ShareGPT prompts (the shipped
# drafter's dev split), 64 new tokens, 3 repeats (median kept), methods interleaved per question: 1. T=1 at batch 1
# (twelve questions); 2. batch 4 greedy (eight questions in left-padded batches of four); 3. below. Packages go to
# $PACKAGE_CACHE (default /tmp/hf_treespec_probe_verdict). Resumable: a part whose output exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_probe_verdict}
OUT=docs/results/compiled/probe-verdict
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
# 3. host time with sampling's warpers over the drafter's vocabulary alone or over the whole vocabulary, interleaved in
# one process
[ -e "$OUT/host_ab.txt" ] || {
  python "$OUT/host_ab.py" > "$OUT/host_ab.tmp" && mv "$OUT/host_ab.tmp" "$OUT/host_ab.txt"; }
