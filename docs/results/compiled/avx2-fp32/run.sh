#!/usr/bin/env bash
# Acceptance's second CPU: fp32 with ATen, oneDNN, MKL, inductor and the cache-attention op capped at avx2 (a stand-in
# for a CPU without avx512; OpenVINO has no such cap and keeps this CPU's avx512), its own cost-curve cache so the
# curves are measured under the cap. Held-out ShareGPT prompts (the shipped drafter's dev split), six questions x 64
# new tokens, greedy, 3 repeats (median kept), methods interleaved per question. Resumable: skipped once its summary
# exists.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COST_CACHE=${HF_TREESPEC_AVX2_COSTS:-$HOME/.cache/hf_treespec-avx2-costs}
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
OUT=docs/results/compiled/avx2-fp32
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
if [ ! -e $OUT/sharegpt-dev/summary.json ]; then
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --dtype fp32 --dataset sharegpt-dev \
    --out $OUT/sharegpt-dev --methods "plain,openvino,plain@compile=true,tree:salf@compile=true,tree:salf@compile=true@tree_budget=4"
fi
