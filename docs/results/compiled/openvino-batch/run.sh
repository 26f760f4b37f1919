#!/usr/bin/env bash
# Batches through the OpenVINO target step: left-padded batches of 1 and 4 MT-bench prompts, greedy.
# 1. speed (bf16, 8 questions x 64 new tokens, 3 repeats, median kept, methods interleaved per batch): plain batched
#    `generate`, plain decoding through the step, tree:salf with the default budget (auto) and fixed 1, 2, 4 nodes;
# 2. identity (fp32, 16-node trees, every policy): rows equal plain decoding through the same step.
# 3. sampling at T=1, batch 1 (bf16, 3 repeats).
# Resumable: a configuration whose batched.json exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/openvino-batch
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --num-questions 8 --max-new-tokens 64 --no-progress --out "$folder" "$@"
}
T="@compile=openvino"
run speed-bf16 --dtype bf16 --repeats 3 --batch-size 1,4 --methods \
  "plain,plain$T,tree:salf$T,tree:salf$T@tree_budget=1,tree:salf$T@tree_budget=2,tree:salf$T@tree_budget=4"
POLICIES="chain eagle2 optimal salf c2t delayed dyspec static iid swor nde"
run identity-fp32 --dtype fp32 --batch-size 1,4 --set tree.tree_budget=16 --methods \
  "plain,plain$T,$(for p in $POLICIES; do printf 'tree:%s%s,' "$p" "$T"; done | sed 's/,$//')"
run t1-bf16 --dtype bf16 --temperature 1.0 --seed 0 --repeats 3 --batch-size 1 --methods \
  "plain,plain$T,tree:salf$T,tree:salf$T@tree_budget=1,tree:salf$T@tree_budget=2,tree:salf$T@tree_budget=4"
