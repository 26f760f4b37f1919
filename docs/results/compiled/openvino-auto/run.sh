#!/usr/bin/env bash
# tree_budget="auto" (the default) through the OpenVINO target step, beside its fixed 4-node tree, plain decoding
# through it, OpenVINO GenAI's greedy loop, inductor's compiled step and plain `generate`: six questions x 64 new
# tokens, greedy, bf16, 3 repeats (median kept), methods interleaved per question; MT-bench, then held-out ShareGPT
# prompts (the shipped drafter's dev split). Resumable: a configuration whose summary exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/openvino-auto
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
METHODS="plain,openvino,plain@compile=openvino,tree:salf@compile=openvino,tree:salf@compile=openvino@tree_budget=4,plain@compile=true,tree:salf@compile=true"
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --out "$folder" "$@"
}
run mtbench --dtype bf16 --methods "$METHODS"
run sharegpt-dev --dtype bf16 --dataset sharegpt-dev --methods "$METHODS"
