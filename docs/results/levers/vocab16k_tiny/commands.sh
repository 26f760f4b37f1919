#!/usr/bin/env bash
# lever: a 16k draft vocabulary trained from the start, against the 8k EAGLE drafter of section 7.2 (same data, seed, epochs)
set -euo pipefail
cd runs/gto-tiny   # data/ and runs/: those of docs/results/papers/gto/tiny/commands.sh
C="--threads 1 --seed 42 --save-strategy no --report-to none --batch-size 2"
hf-treespec train eagle --data data/n40 --output-dir runs/eagle_v16k $C --lr 1e-3 --epochs 3 --draft-vocab-size 16384 --no-progress
hf-treespec bench --drafter runs/eagle --dtype fp32 --threads 1 --num-questions 10 --max-new-tokens 64 --temperature 0 \
    --set tree.tree_budget=24 --set eagle2.tree_depth=5 --no-progress \
    --methods "plain,tree:eagle2@drafter=runs/eagle,tree:eagle2@drafter=runs/eagle_v16k" --out bench_vocab16k
