#!/usr/bin/env bash
# Tree steps over plain decoding through the same compiled steps (the packaged graphs called with their flat tensors),
# on a 2-core CPU with avx512_bf16 (bf16, 2 threads). Held-out ShareGPT prompts (the shipped drafter's dev split), 64 new tokens, 3 repeats (median
# kept), methods interleaved per question: 1. T=1 at batch 1 (six questions); 2. batch 4 greedy (eight questions in
# left-padded batches of four); 3. the compiled target's row curve (`calibrate --compile`); 4-5 below.
# Packages go to $PACKAGE_CACHE (default /tmp/hf_treespec_flat_calls). Resumable: a part whose output exists is
# skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_flat_calls}
OUT=docs/results/compiled/flat-calls
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 \
    --dataset sharegpt-dev --out "$folder" "$@"
}
C="@compile=true"
D="tree:dyspec$C@tree_depth=1@tree_budget"
run t1 --num-questions 6 --temperature 1.0 --methods "plain$C,tree:salf$C,${D}=3,${D}=4,${D}=5"
run b4-greedy --num-questions 8 --batch-size 4 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2"
if [ ! -e "$OUT/curve/compiled_curve.json" ]; then
  hf-treespec calibrate --compile --dtype bf16 --sizes 1,2,4,5,6,7,8,10,12,16 --contexts 200 --repeats 7 \
    --batch-size 4 --out "$OUT/curve" > "$OUT/curve.md.tmp" && mv "$OUT/curve.md.tmp" "$OUT/curve.md"
fi
# 4. the machine's compute peak and memory rate beside the few-rows linear's; 5. host time with and without the two
# host cuts (flat package calls, row moves in one op), interleaved in one process
[ -e "$OUT/kernel_peak.txt" ] || { python "$OUT/kernel_peak.py" > "$OUT/kernel_peak.tmp" && mv "$OUT/kernel_peak.tmp" "$OUT/kernel_peak.txt"; }
[ -e "$OUT/host_ab.txt" ] || { python "$OUT/host_ab.py" > "$OUT/host_ab.tmp" && mv "$OUT/host_ab.tmp" "$OUT/host_ab.txt"; }
