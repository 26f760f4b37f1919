#!/usr/bin/env bash
# T=1 at batch 1 with a step's target logits left in bf16 unless returned (each row cast to fp32 where generate's
# processors read it), against plain decoding through the same compiled steps, on a 2-core CPU with avx512_bf16 (bf16,
# 2 threads). Held-out ShareGPT prompts (the shipped drafter's dev split), twelve questions x 64 new tokens, 3
# repeats (median kept), methods interleaved per question; then the host time a step with the change switched off
# and on in one process, and where a tree step's host time goes (py-spy samples, `pip install py-spy`). Packages go
# to $PACKAGE_CACHE (default /tmp/hf_treespec_bf16_rows). Resumable: a part whose output exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_bf16_rows}
OUT=docs/results/compiled/bf16-rows
lscpu | grep -E "Model name"
grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
C="@compile=true"
[ -e "$OUT/t1/summary.json" ] || hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 \
  --dataset sharegpt-dev --out "$OUT/t1" --num-questions 12 --temperature 1.0 \
  --methods "plain$C,tree:dyspec$C@tree_depth=1@tree_budget=4"
# host time a step with the change switched off and on, in one process (packages built above)
[ -e "$OUT/host_ab.txt" ] || { python "$OUT/host_ab.py" > "$OUT/host_ab.tmp"; mv "$OUT/host_ab.tmp" "$OUT/host_ab.txt"; }
# where the host time goes: py-spy samples of twelve seeded calls, summarised by the innermost hf_treespec line
if [ ! -e "$OUT/host_samples.txt" ]; then
  python "$OUT/host_samples.py" run > "$OUT/samples.log" 2>&1 &
  pid=$!
  until grep -q GO "$OUT/samples.log" 2>/dev/null; do sleep 1; done
  py-spy record -p "$pid" -r 500 -f raw -o "$OUT/samples.raw" --nonblocking -d 9 > /dev/null 2>&1
  wait "$pid"
  python "$OUT/host_samples.py" summarise "$OUT/samples.raw" > "$OUT/host_samples.tmp"
  mv "$OUT/host_samples.tmp" "$OUT/host_samples.txt"
  rm -f "$OUT/samples.raw" "$OUT/samples.log"
fi
