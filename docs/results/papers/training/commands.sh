#!/usr/bin/env bash
# Small equal-data drafter-training ablations (SmolLM2-135M-Instruct target, EAGLE-3 inputs, fp32, 1 thread).
# Every run in one ablation uses the same prepared data, steps, batch size, learning rate and seed (42).
set -euo pipefail
HF="hf-treespec"; D=/tmp/ablate/data; R=/tmp/ablate/runs
# data: 40 ShareGPT train conversations (30 kept, 13,817 tokens) without trees, for EAGLE
$HF train prepare --split train --num-conversations 40 --max-length 512 --chunk-size 40 --input-mode eagle3 \
    --tree-policy none --threads 1 --output $D/n40
# TALF data: the first 16 train conversations (7,802 tokens), EAGLE-2 target trees (depth 3) at 64 sampled roots,
# tree top-k 1 / 2 / 4
for K in 1 2 4; do
  $HF train prepare --split train --num-conversations 16 --max-length 512 --chunk-size 16 --input-mode eagle3 \
      --tree-policy eagle2 --tree-topk $K --tree-depth 3 --tree-positions 64 --threads 1 --output $D/k${K}p64
done
# held-out data: 20 ShareGPT dev conversations (19 kept, 9,236 tokens), the target's greedy 4-chain at every position
$HF train prepare --split dev --num-conversations 20 --max-length 512 --input-mode eagle3 --tree-policy chain \
    --tree-depth 4 --tree-positions all --threads 1 --output $D/dev
COMMON="--threads 1 --seed 42 --save-strategy no --report-to none --batch-size 2"
# 1. EAGLE loss weights: default (CE 0.1, regression 1) vs the SALF & TALF paper's (CE 10, regression 1), 3 epochs
$HF train eagle --data $D/n40 --output-dir $R/eagle_def $COMMON --lr 1e-3 --epochs 3 --ce-weight 0.1 --feature-weight 1
$HF train eagle --data $D/n40 --output-dir $R/eagle_pap $COMMON --lr 1e-3 --epochs 3 --ce-weight 10 --feature-weight 1
# 3. TALF tree top-k: 8 steps (1 epoch) of TALF from the default EAGLE warm-up, TALF defaults otherwise
for K in 1 2 4; do
  $HF train talf --data $D/k${K}p64 --init $R/eagle_def --output-dir $R/talf_k${K}p64 $COMMON --max-steps 8
done
# evaluation: held-out top-1 per depth and greedy chain tau on ShareGPT dev; SALF tau on MT-bench (fixed budget 32)
for RUN in eagle_def eagle_pap talf_k1p64 talf_k2p64 talf_k4p64; do
  $HF train evaluate --data $D/dev --drafter $R/$RUN --threads 1 --output $R/$RUN/acceptance.json
done
$HF bench --drafter $R/eagle_def --methods "tree:salf@drafter=$R/eagle_def,tree:salf@drafter=$R/eagle_pap" \
    --set tree.tree_budget=32 --dataset mtbench --num-questions 10 --max-new-tokens 64 --dtype fp32 --threads 1 \
    --repeats 1 --out /tmp/ablate/bench/eagle
