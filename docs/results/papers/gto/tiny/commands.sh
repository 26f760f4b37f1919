#!/usr/bin/env bash
# GTO's Table 2 (GTO on top of EAGLE / HASS / TALF initial drafters) and Table 4 (group size) at tiny scale, plus
# HASS's loss weights (ours vs the SALF & TALF paper's), on SmolLM2-135M-Instruct, fp32, 1 thread.
# New one-layer EAGLE-3-input drafters on 30 ShareGPT train conversations (13,817 tokens), as in section 7.1.
set -euo pipefail
HF=hf-treespec; D=runs/gto-tiny/data; R=runs/gto-tiny/runs
$HF train prepare --split train --num-conversations 40 --max-length 512 --chunk-size 40 --input-mode eagle3 \
    --tree-policy none --threads 1 --output $D/n40
$HF train prepare --split train --num-conversations 16 --max-length 512 --chunk-size 16 --input-mode eagle3 \
    --tree-policy eagle2 --tree-topk 4 --tree-depth 3 --tree-positions 64 --threads 1 --output $D/k4p64
C="--threads 1 --seed 42 --save-strategy no --report-to none --batch-size 2"
# initial drafters: EAGLE (3 epochs), HASS on from EAGLE (1 epoch; our weights and the paper's), TALF on from EAGLE
$HF train eagle --data $D/n40 --output-dir $R/eagle $C --lr 1e-3 --epochs 3
$HF train hass --data $D/n40 --init $R/eagle --output-dir $R/hass $C --lr 3e-4 --epochs 1
$HF train hass --data $D/n40 --init $R/eagle --output-dir $R/hass_pap $C --lr 3e-4 --epochs 1 \
    --ce-weight 10 --distill-weight 10 --feature-weight 1
$HF train talf --data $D/k4p64 --init $R/eagle --output-dir $R/talf $C --max-steps 8
# GTO: 30 steps of 2 sequences, 4 groups of m positions each, EAGLE-2 trees of 24 nodes / depth 5, lr 1e-4
G="--data $D/n40 --max-steps 30 --lr 1e-4 --warmup-steps 3 --per-device-train-batch-size 1 --gradient-accumulation-steps 2 \
   --num-groups 4 --tree-budget 24 --tree-depth 5 --save-strategy no --report-to none --logging-steps 2 --threads 1 --seed 0"
for init in eagle hass talf; do $HF train gto $G --group-size 4 --init $R/$init --output-dir $R/gto_$init; done
for m in 2 8; do $HF train gto $G --group-size $m --init $R/eagle --output-dir $R/gto_eagle_m$m; done
# evaluation: MT-bench 10 q x 64 tokens, greedy, EAGLE-2 trees of 24 nodes / depth 5, every drafter in one run
M=""; for d in eagle gto_eagle gto_eagle_m2 gto_eagle_m8 hass gto_hass hass_pap talf gto_talf; do
  M="$M,tree:eagle2@drafter=$R/$d"; done
$HF bench --drafter $R/eagle --dtype fp32 --threads 1 --num-questions 10 --max-new-tokens 64 --temperature 0 \
    --set tree.tree_budget=24 --set eagle2.tree_depth=5 --methods "plain$M" --out runs/gto-tiny/bench_mt_t0
