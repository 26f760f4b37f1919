#!/usr/bin/env bash
# The shipped drafter trained on (TALF, fp32 master weights) over the first two quarters of the target's answers
# regenerated on an H100 (greedy and T 1; regen_p0: ShareGPT train records 2,210-2,851, regen_p1: 5,684-6,330;
# 648,563 tokens as trained, prompts included), 3 epochs: twice the data and 3x the token-steps of the "new data
# alone" row (talf-p0, in ../new_data_second_layer, measured again here in the same runs). 2-core AMD EPYC (avx2 only), fp32, 2 threads,
# transformers 5.24.0, torch 2.13.0.
set -euo pipefail
SHIP=$(python -c "from hf_treespec.assets.drafters import shipped_drafter_path as p; print(p())")
# the answers: processes 0 and 1 of the H100 regeneration in docs/history.md ("Fifteen minutes of one H100"); the same
# command on any machine (process 1 with the --skip of the second quarter of records 2,210-16,000; its first answered
# record is 5,684):
#   hf-treespec train regenerate --split train --skip 2210 --num-prompts 576 --max-new-tokens 256 \
#     --max-prompt-tokens 512 --temperature 0,1.0 --output regen_p0
P="--num-conversations 0 --max-length 512 --chunk-size 64 --input-mode eagle3 --tree-policy eagle2 --tree-topk 4
   --tree-depth 3 --tree-positions 8 --threads 2"
hf-treespec train prepare --data-file regen_p0 $P --output data-p0-e3                   # 1,657 s
hf-treespec train prepare --data-file regen_p1 $P --output data-p1-e3                   # 1,270 s
T="--init $SHIP --lr 3e-4 --batch-size 4 --threads 2 --resume --save-total-limit 1"
hf-treespec train talf --data data-p0-e3 --epochs 2 $T --output-dir talf-p0              # 874 s
hf-treespec train talf --data data-p0-e3 data-p1-e3 --epochs 3 $T --output-dir talf-p01-e3   # 2,777 s
M="plain,tree:salf,tree:salf@drafter=talf-p0,tree:salf@drafter=talf-p01-e3"
hf-treespec bench --drafter $SHIP --num-questions 40 --max-new-tokens 128 --set tree.tree_budget=16 --threads 2 \
  --methods "$M" --out bench_t0
hf-treespec bench --drafter $SHIP --num-questions 40 --max-new-tokens 64 --temperature 1 --seed 0 \
  --set tree.tree_budget=16 --threads 2 --methods "$M" --out bench_t1
hf-treespec train prepare --split dev --num-conversations 32 --max-length 512 --chunk-size 32 --input-mode eagle3 \
  --tree-policy chain --tree-depth 4 --tree-positions 64 --threads 2 --output data-dev-e3
hf-treespec train evaluate --data data-dev-e3 --drafter $SHIP --drafter talf-p0 --drafter talf-p01-e3 --threads 2 \
  --output acceptance.json
python paired.py    # per-question tau differences (paired.txt)
