#!/usr/bin/env bash
# A batch step where no row drafts, with fewer host ops: the host tensor ops a step by function
# (`../probe-verdict/host_ops.py` on this code), and `auto` against plain decoding through the same compiled steps at
# batch 4, greedy (eight ShareGPT dev questions in left-padded batches of four, 64 new tokens, 3 repeats, median
# kept, methods interleaved), on a 2-core CPU with avx512_bf16 (bf16, 2 threads). Packages go to $PACKAGE_CACHE
# (default /tmp/hf_treespec_draft_free). Resumable: a part whose output exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_draft_free}
OUT=docs/results/compiled/draft-free-steps
lscpu | grep -E "Model name"
grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
[ -e "$OUT/host_ops.txt" ] || {
  python docs/results/compiled/probe-verdict/host_ops.py > "$OUT/host_ops.tmp"
  mv "$OUT/host_ops.tmp" "$OUT/host_ops.txt"; }
if [ ! -e "$OUT/b4-greedy/batched.json" ]; then
  hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev \
    --num-questions 8 --batch-size 4 --methods "plain@compile=true,tree:salf@compile=true" --out "$OUT/b4-greedy"
fi
