#!/usr/bin/env bash
# tree_budget="auto" against fixed tree sizes {2, 4, 8, 16} and plain decoding through the same forward: batch 1
# compiled and batch 4 eager, greedy and T=1, 3 repeats (5 at batch 4; median kept). Resumable: a configuration
# whose summary exists is skipped, so an interrupted run continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/auto
COMMON=(--num-questions 8 --max-new-tokens 96 --repeats 3 --no-progress)
sizes() {  # $1: the method suffix every row carries (@compile=true or nothing)
  local s=$1
  echo "tree:salf$s,tree:salf$s@tree_budget=2,tree:salf$s@tree_budget=4,tree:salf$s@tree_budget=8,tree:salf$s@tree_budget=16"
}
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench "${COMMON[@]}" --out "$folder" "$@"
}
run b1-compiled-greedy --methods "plain,plain@compile=true,$(sizes @compile=true)"
run b1-compiled-t1 --temperature 1.0 --methods "plain,plain@compile=true,$(sizes @compile=true)"
# batch 4: 5 repeats, since the same plain batched run varies by up to +-10% between repeats on a 2-core VM
run b4-eager-greedy --batch-size 4 --repeats 5 --methods "plain,$(sizes '')"
run b4-eager-t1 --batch-size 4 --temperature 1.0 --repeats 5 --methods "plain,$(sizes '')"
