#!/usr/bin/env bash
# The README's "what to expect" table: plain `generate`, compiled plain, transformers' prompt lookup, OpenVINO GenAI
# and trees (eager and compiled, auto-sized and at 4 nodes) on the real model, 8 MT-bench questions x 96 new tokens,
# 3 repeats (median kept), methods interleaved per question. bf16 greedy and T=1 on this CPU, and fp32 greedy with
# the kernels capped at avx2 (a stand-in for a CPU without avx512; its cost curves calibrated under the cap).
# Resumable: a configuration whose summary exists is skipped, so an interrupted run continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/headline
COMMON=(--num-questions 8 --max-new-tokens 96 --repeats 3 --no-progress)
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench "${COMMON[@]}" --out "$folder" "$@"
}
lscpu | grep -E "Model name|Flags" | sed -E 's/(Flags:).*/\1 '"$(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')"'/'
run bf16-greedy --dtype bf16 \
  --methods "plain,plain@compile=true,assisted_lookup,openvino,tree:salf,tree:salf@tree_budget=4,tree:salf@compile=true,tree:salf@compile=true@tree_budget=4"
run bf16-t1 --dtype bf16 --temperature 1.0 \
  --methods "plain,plain@compile=true,assisted_lookup,tree:salf,tree:dyspec,tree:salf@compile=true,tree:dyspec@compile=true"
HF_TREESPEC_COST_CACHE=${HF_TREESPEC_AVX2_COSTS:-$HOME/.cache/hf_treespec-avx2-costs} ATEN_CPU_CAPABILITY=avx2 \
  ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
  run fp32-avx2-greedy --dtype fp32 \
  --methods "plain,plain@compile=true,assisted_lookup,tree:salf,tree:salf@tree_budget=4,tree:salf@compile=true,tree:salf@compile=true@tree_budget=4"
