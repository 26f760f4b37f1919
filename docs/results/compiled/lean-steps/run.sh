#!/usr/bin/env bash
# Tree steps with fewer host ops around the packaged graphs: sibling draws ranked by one log per column (p / -log u,
# the Gumbel keys' order), q exponentiated on the draft vocabulary only, no rows x vocabulary fp32 cast when only the
# verifier reads the logits, a draft-free step's root appended to the drafter's pending chain directly, and the KV
# buffers' used length kept as one integer per layer (views made when read). Held-out ShareGPT prompts (the shipped
# drafter's dev split), bf16, 3 repeats (median kept), methods interleaved:
# 1. batch 1 at T=1 (six questions); 2. batch 4 greedy and T=1 (eight questions in left-padded batches of four);
# 3. batch 1 greedy beside OpenVINO GenAI's loop (six questions); 4. host milliseconds per step (host_time.py), the
# code before (commit 2520d473, in a worktree) between two passes of the code after.
# Packages go to $PACKAGE_CACHE (default /tmp/hf_treespec_lean_steps). Resumable: a part whose output exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_lean_steps}
OUT=docs/results/compiled/lean-steps
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ] || [ -e "$folder/batched.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --dataset sharegpt-dev --out "$folder" "$@"
}
C="@compile=true"
run b1-t1 --num-questions 6 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:dyspec$C@tree_budget=4,tree:dyspec$C@tree_budget=4@tree_depth=1"
run b4-greedy --num-questions 8 --batch-size 4 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2"
run b4-t1 --num-questions 8 --batch-size 4 --temperature 1.0 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:dyspec$C@tree_budget=4"
run b1-greedy --num-questions 6 --methods \
  "plain,openvino,plain$C,tree:salf$C,tree:salf$C@tree_budget=4"
# 4. host work per step: after, before (its own packages, built on its first pass), after again
[ -e $OUT/host_time.txt ] || python $OUT/host_time.py > $OUT/host_time.txt
if [ ! -e $OUT/host_time_before.txt ]; then
  before=$(mktemp -d); git worktree add -q --detach "$before" 2520d473
  PYTHONPATH="$before" python $OUT/host_time.py > $OUT/host_time_before.txt.part
  mv $OUT/host_time_before.txt.part $OUT/host_time_before.txt; git worktree remove --force "$before"
fi
# 5. after a fix of the batch path (commit b9660f04: a view made per keys / values read in RaggedKV's
# commit): host time per step again, and the batch-4 greedy bench
[ -e $OUT/host_time_2.txt ] || python $OUT/host_time.py > $OUT/host_time_2.txt
run b4-greedy-2 --num-questions 8 --batch-size 4 --methods \
  "plain$C,tree:salf$C,tree:salf$C@tree_budget=1,tree:salf$C@tree_budget=2"
