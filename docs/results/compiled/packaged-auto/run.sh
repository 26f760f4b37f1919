#!/usr/bin/env bash
# The packaged compiled step (hf_treespec/compiled/packaged.py) with `tree_budget="auto"` holding draft-free steps as
# its size-ladder's size 0 (hf_treespec/cost/held_size.py), and the OpenVINO target step in the same run:
# 1. held-out ShareGPT prompts (the shipped drafter's dev split), six questions x 64 new tokens, bf16, greedy and T=1,
#    batch 1, 3 repeats (median kept), methods interleaved per question;
# 2. batch 4: eight dev questions in left-padded batches of 4, greedy and T=1, 3 repeats.
# Packages go to $PACKAGE_CACHE (default /tmp/hf_treespec_packaged_auto). Resumable: a part whose summary exists is
# skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_packaged_auto}
OUT=docs/results/compiled/packaged-auto
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev --out "$folder" "$@"
}
C="@compile=true"; O="@compile=openvino"
run b1-greedy --num-questions 6 --methods \
  "plain,openvino,plain$C,tree:salf$C,tree:salf$C@tree_budget=4,plain$O,tree:salf$O@tree_budget=4"
run b1-t1 --num-questions 6 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=4,tree:dyspec$C@tree_budget=4,tree:dyspec$C"
run b4-greedy --num-questions 8 --batch-size 4 --methods \
  "plain,plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2,tree:salf$C@tree_budget=4"
run b4-t1 --num-questions 8 --batch-size 4 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=2,tree:dyspec$C@tree_budget=4"
# 3. after the ladder's fix (from size 0 it tries the best tree size measured and double it, commit 36eaf734; the
#    parts above ran at 861ce84b, where from 0 it tried one node only): batch 1 again
run b1-greedy-climb --num-questions 6 --methods \
  "plain,openvino,plain$C,tree:salf$C,tree:salf$C@tree_budget=4"
run b1-t1-climb --num-questions 6 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=4,tree:dyspec$C@tree_budget=4"
