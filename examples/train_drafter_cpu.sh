#!/usr/bin/env bash
# Train a TreeSpec feature drafter for SmolLM2-135M-Instruct on one CPU machine: extract target states (with TALF
# target trees) once, EAGLE warm-up, then TALF (or HASS) from the warm-up, then held-out acceptance per depth.
# This is the first stage of the shipped drafter's recipe (EAGLE-3 inputs, 10 + 2 epochs over 1024 ShareGPT train
# records: 1,353 s of extraction and 1,515 + 463 s of EAGLE + TALF training on a 2-core AMD EPYC with avx512_bf16,
# bf16, 2026-11-24, docs/history.md "2026-11-24: Learning curve, fourth run"); the shipped drafter then trained on
# with the target's own answers (`train regenerate`, BENCHMARKS.md section 6 and docs/history.md).
# Every step is resumable: rerun the same command after an interruption (finished data chunks are skipped;
# --resume continues from the last checkpoint).
set -euo pipefail
RUNS=${RUNS:-runs}

# 1. training data: hidden states + EAGLE-2 (k=4, depth 3) target trees at 32 sampled positions per conversation
hf-treespec train prepare --split train --num-conversations 1024 --max-length 512 --chunk-size 64 --input-mode eagle3 \
    --tree-policy eagle2 --tree-topk 4 --tree-depth 3 --tree-positions 32 --output "$RUNS/data/train"
# held-out data for evaluation: the target's greedy chain (depth 4) at every assistant position
hf-treespec train prepare --split dev --num-conversations 40 --max-length 512 --input-mode eagle3 \
    --tree-policy chain --tree-depth 4 --tree-positions all --output "$RUNS/data/dev"

# 2. EAGLE warm-up (new drafter: one decoder layer, 8k-token draft vocabulary, target embedding / LM head shared),
#    held-out top-1 logged after every epoch
hf-treespec train eagle --data "$RUNS/data/train" --eval-data "$RUNS/data/dev" --output-dir "$RUNS/eagle" --epochs 10 \
    --lr 1e-3 --resume

# 3. tree-aware fine-tuning from the warm-up (TALF defaults: lr 3e-4, cosine with warm-up, AdamW betas 0.9/0.95)
hf-treespec train talf --data "$RUNS/data/train" --init "$RUNS/eagle" --output-dir "$RUNS/talf" --epochs 2 --resume
hf-treespec train hass --data "$RUNS/data/train" --init "$RUNS/eagle" --output-dir "$RUNS/hass" --epochs 2 --resume

# 4. top-1 acceptance per depth along the target's greedy continuation, and tau of greedy chain drafting
hf-treespec train evaluate --data "$RUNS/data/dev" \
    --drafter "$RUNS/eagle" --drafter "$RUNS/hass" --drafter "$RUNS/talf" --output "$RUNS/acceptance.json"

# 5. end to end: tree speculation with SALF behind model.generate, against plain generate
hf-treespec bench --drafter "$RUNS/talf" --methods plain,tree:salf --num-questions 5
