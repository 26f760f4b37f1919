#!/usr/bin/env bash
# The second CPU of the acceptance runs on a CPU that has avx2 and no avx512 at all (not a cap on an avx512 CPU):
# fp32, its fast dtype there, 2 threads, every kernel (ATen, oneDNN, inductor's, OpenVINO GenAI's) the machine's own.
# Held-out ShareGPT prompts (the shipped drafter's dev split), six questions x 64 new tokens, 3 repeats (median kept),
# methods interleaved per question: 1. greedy beside OpenVINO GenAI's loop; 2. T=1; 3. batch 4 greedy.
# Packages go to $PACKAGE_CACHE (default /tmp/hf_treespec_avx2_native). Resumable: a part whose summary exists is
# skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_avx2_native}
OUT=docs/results/compiled/avx2-native
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype fp32 \
    --dataset sharegpt-dev --out "$folder" "$@"
}
C="@compile=true"
run greedy --methods "plain,openvino,plain$C,tree:salf$C,tree:salf$C@tree_budget=4"
run t1 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:dyspec$C@tree_budget=4,tree:dyspec$C@tree_budget=4@tree_depth=1"
# 3. batch 4, greedy: eight questions in left-padded batches of four
run b4-greedy --num-questions 8 --batch-size 4 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2"
