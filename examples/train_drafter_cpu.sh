#!/usr/bin/env bash
# Train a TreeSpec feature drafter for SmolLM2-135M-Instruct on one CPU machine: extract target states (with TALF
# target trees) once, EAGLE warm-up, then TALF (or HASS) from the warm-up, then held-out acceptance per depth.
# This is the first stage of the shipped drafter's recipe (EAGLE-3 inputs, 10 + 2 epochs over 1024 ShareGPT train
# records: 1,353 s of extraction and 1,515 + 463 s of EAGLE + TALF training on a 2-core AMD EPYC with avx512_bf16,
# bf16, 2026-11-24, docs/history.md "2026-11-24: Learning curve, fourth run"); the shipped drafter then trained on
# with the target's own answers (`train regenerate`, BENCHMARKS.md section 6 and docs/history.md).
# Every step is resumable: rerun the same command after an interruption (finished data chunks are skipped;
# --resume continues from the last checkpoint).
#
#   bash examples/train_drafter_cpu.sh                  # the recipe (hours on 2 cores)
#   TINY=1 RUNS=/tmp/tiny bash examples/train_drafter_cpu.sh   # every step on a handful of tokens (what the tests run)
set -euo pipefail
RUNS=${RUNS:-runs}
HF=${HF:-hf-treespec}                   # or "python -m hf_treespec.cli"
if [[ "${TINY:-0}" == "1" ]]; then      # the same commands on a few short conversations: checks the recipe runs
    CONVERSATIONS=2; DEV_CONVERSATIONS=1; MAX_LENGTH=96; CHUNK=2; EAGLE_EPOCHS=1; TALF_EPOCHS=1; QUESTIONS=1
    BENCH_TOKENS=8; THREADS=${THREADS:-1}
fi
CONVERSATIONS=${CONVERSATIONS:-1024}; DEV_CONVERSATIONS=${DEV_CONVERSATIONS:-40}; MAX_LENGTH=${MAX_LENGTH:-512}
CHUNK=${CHUNK:-64}; EAGLE_EPOCHS=${EAGLE_EPOCHS:-10}; TALF_EPOCHS=${TALF_EPOCHS:-2}; QUESTIONS=${QUESTIONS:-5}
BENCH_TOKENS=${BENCH_TOKENS:-128}
THREADS_OPT=${THREADS:+--threads $THREADS}

# 1. training data: hidden states + EAGLE-2 (k=4, depth 3) target trees at 32 sampled positions per conversation
$HF train prepare --split train --num-conversations "$CONVERSATIONS" --max-length "$MAX_LENGTH" --chunk-size "$CHUNK" \
    --input-mode eagle3 --tree-policy eagle2 --tree-topk 4 --tree-depth 3 --tree-positions 32 $THREADS_OPT \
    --no-progress --output "$RUNS/data/train"
# held-out data for evaluation: the target's greedy chain (depth 4) at every assistant position
$HF train prepare --split dev --num-conversations "$DEV_CONVERSATIONS" --max-length "$MAX_LENGTH" --input-mode eagle3 \
    --tree-policy chain --tree-depth 4 --tree-positions all $THREADS_OPT --no-progress --output "$RUNS/data/dev"

# 2. EAGLE warm-up (new drafter: one decoder layer, 8k-token draft vocabulary, target embedding / LM head shared),
#    held-out top-1 logged after every epoch
$HF train eagle --data "$RUNS/data/train" --eval-data "$RUNS/data/dev" --output-dir "$RUNS/eagle" \
    --epochs "$EAGLE_EPOCHS" --lr 1e-3 --resume $THREADS_OPT

# 3. tree-aware fine-tuning from the warm-up (TALF defaults: lr 3e-4, cosine with warm-up, AdamW betas 0.9/0.95)
$HF train talf --data "$RUNS/data/train" --init "$RUNS/eagle" --output-dir "$RUNS/talf" --epochs "$TALF_EPOCHS" \
    --resume $THREADS_OPT
$HF train hass --data "$RUNS/data/train" --init "$RUNS/eagle" --output-dir "$RUNS/hass" --epochs "$TALF_EPOCHS" \
    --resume $THREADS_OPT

# 4. top-1 acceptance per depth along the target's greedy continuation, and tau of greedy chain drafting
$HF train evaluate --data "$RUNS/data/dev" \
    --drafter "$RUNS/eagle" --drafter "$RUNS/hass" --drafter "$RUNS/talf" $THREADS_OPT --output "$RUNS/acceptance.json"

# 5. end to end: tree speculation with SALF behind model.generate, against plain generate
$HF bench --drafter "$RUNS/talf" --methods plain,tree:salf --num-questions "$QUESTIONS" --max-new-tokens "$BENCH_TOKENS" \
    $THREADS_OPT --no-progress --out "$RUNS/bench"
