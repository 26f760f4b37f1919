#!/usr/bin/env bash
# A batch's tree steps on the packaged compiled step: the stacked draft rounds through the drafter's batch graphs,
# and every step of 16 rows or fewer in all (a batch's one-row and tree steps) through graphs whose linears run the
# few-rows op (hf_treespec/compiled/few_rows_linear.py). Held-out ShareGPT prompts (the shipped drafter's dev split),
# bf16, 3 repeats (median kept), methods interleaved:
# 1. eight questions in left-padded batches of 4, greedy and T=1;
# 2. batch 1 at T=1 (six questions), where the one-row drafting changed only in projecting features once a round;
# 3. after sampled tokens are drawn by the inverse of the cumulative weights instead of torch.multinomial (commit
#    a271f9f2): T=1 again at batch 4 and 1, and batch 1 greedy beside OpenVINO GenAI's loop.
# Packages go to $PACKAGE_CACHE (default /tmp/hf_treespec_batch_drafting). Resumable: a part whose summary exists is
# skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_batch_drafting}
OUT=docs/results/compiled/batch-drafting
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev --out "$folder" "$@"
}
C="@compile=true"
run b4-greedy --num-questions 8 --batch-size 4 --methods \
  "plain,plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2,tree:salf$C@tree_budget=4"
run b4-t1 --num-questions 8 --batch-size 4 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2,tree:dyspec$C@tree_budget=4"
run b1-t1 --num-questions 6 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=4,tree:dyspec$C@tree_budget=4"
# 3. (commit a271f9f2)
run b4-t1-draws --num-questions 8 --batch-size 4 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2,tree:dyspec$C@tree_budget=4"
run b1-t1-draws --num-questions 6 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=4,tree:dyspec$C@tree_budget=4"
run b1-greedy --num-questions 6 --methods \
  "plain,openvino,plain$C,tree:salf$C,tree:salf$C@tree_budget=4"
