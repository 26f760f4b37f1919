#!/usr/bin/env bash
# T=1 at batch 1 with the tree rows processed when the verifier's walk reads them (`NodeRows`), the draft row warped
# over the drafter's vocabulary and q's positive columns found once a draw round (`t1-rows-only/`: the code of commit
# f399966, without the warp over the drafter's vocabulary), against plain decoding through the same compiled steps, on a 2-core CPU with
# avx512_bf16 (bf16, 2 threads). Held-out ShareGPT prompts (the shipped drafter's dev split), twelve questions x 64
# new tokens, 3 repeats (median kept), methods interleaved per question. Packages go to $PACKAGE_CACHE (default
# /tmp/hf_treespec_visited_rows). Resumable: a part whose output exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_visited_rows}
OUT=docs/results/compiled/visited-rows
lscpu | grep -E "Model name"
grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
C="@compile=true"
[ -e "$OUT/t1/summary.json" ] || hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 \
  --dataset sharegpt-dev --out "$OUT/t1" --num-questions 12 --temperature 1.0 \
  --methods "plain$C,tree:dyspec$C@tree_depth=1@tree_budget=3,tree:dyspec$C@tree_depth=1@tree_budget=4,tree:salf$C"
# host time a step with each change switched off in turn, in one process (packages built above)
[ -e "$OUT/host_ab.txt" ] || { python "$OUT/host_ab.py" > "$OUT/host_ab.tmp"; mv "$OUT/host_ab.tmp" "$OUT/host_ab.txt"; }
