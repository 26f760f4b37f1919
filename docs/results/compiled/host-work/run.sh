#!/usr/bin/env bash
# Tree steps with less host work around the packaged graphs: sampled siblings and the SWOR walk over the columns q can
# draw (8192 of 49152 for the shipped drafter), p's softmax only at the nodes the top-down walk visits, the drafter's
# feature projection through the few-rows op, greedy argmaxes read from the forward's own logits. Held-out ShareGPT prompts (the
# shipped drafter's dev split), bf16, 3 repeats (median kept), methods interleaved:
# 1. batch 1 at T=1 (six questions); 2. batch 4 greedy and T=1 (eight questions in left-padded batches of four);
# 3. batch 1 greedy beside OpenVINO GenAI's loop (six questions); 4. host milliseconds per step (host_time.py), 5. and before.
# Packages go to $PACKAGE_CACHE (default /tmp/hf_treespec_host_work). Resumable: a part whose output exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_host_work}
OUT=docs/results/compiled/host-work
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev --out "$folder" "$@"
}
C="@compile=true"
run b1-t1 --num-questions 6 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=4,tree:dyspec$C@tree_budget=4"
run b4-greedy --num-questions 8 --batch-size 4 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2"
run b4-t1 --num-questions 8 --batch-size 4 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:dyspec$C@tree_budget=4"
run b1-greedy --num-questions 6 --methods \
  "plain,openvino,plain$C,tree:salf$C,tree:salf$C@tree_budget=4"
[ -e $OUT/host_time.txt ] || python $OUT/host_time.py > $OUT/host_time.txt
# 5. the same host profile on the code before these changes (commit 95c65358, in a worktree, its own packages)
if [ ! -e $OUT/host_time_before.txt ]; then
  before=$(mktemp -d); git worktree add -q --detach "$before" 95c65358
  PYTHONPATH="$before" python $OUT/host_time.py > $OUT/host_time_before.txt.part
  mv $OUT/host_time_before.txt.part $OUT/host_time_before.txt; git worktree remove --force "$before"
fi
# 6. both once more, back to back (the machine's speed drifts between parts: compare the graphs' time too)
[ -e $OUT/host_time_2.txt ] || python $OUT/host_time.py > $OUT/host_time_2.txt
if [ ! -e $OUT/host_time_before_2.txt ]; then
  before=$(mktemp -d); git worktree add -q --detach "$before" 95c65358
  PYTHONPATH="$before" python $OUT/host_time.py > $OUT/host_time_before_2.txt.part
  mv $OUT/host_time_before_2.txt.part $OUT/host_time_before_2.txt; git worktree remove --force "$before"
fi
