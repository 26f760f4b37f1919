#!/usr/bin/env bash
# GTO (Group Tree Optimization) fine-tuning of the drafter shipped for SmolLM2-135M-Instruct: the drafter grows its
# EAGLE-2 decoding trees at sampled training positions, the target scores them online, and the drafter is trained on
# the expected acceptance length of its own trees (debiased against a frozen copy of the initial drafter), plus the
# EAGLE-3 token loss. Resumable: rerun with the same command (--resume continues from the last checkpoint).
#
# The paper's settings (AdamW 0.9/0.95, lr 5e-6 with 1000 warm-up steps, grad clip 0.5, K=16 windows of m=8
# positions, trees top-k 10 / 60 tokens / depth 7) are the defaults; they are GPU-sized. SMALL=1 runs a CPU-sized
# variant (fewer windows, smaller trees, fewer warm-up steps) that finishes in minutes. TINY=1 runs the SMALL variant
# on two short conversations for two steps (what the tests run: it checks the recipe, it trains nothing useful).
#
#   SMALL=1 RUNS=runs bash examples/train_gto.sh
set -euo pipefail
RUNS=${RUNS:-runs}
HF=${HF:-hf-treespec}                   # or "python -m hf_treespec.cli"
if [[ "${TINY:-0}" == "1" ]]; then
    SMALL=1; CONVERSATIONS=2; MAX_LENGTH=128; MAX_STEPS=2; QUESTIONS=1; BENCH_TOKENS=8; THREADS=${THREADS:-1}
fi
MAX_LENGTH=${MAX_LENGTH:-1024}
THREADS_OPT=${THREADS:+--threads $THREADS}

# 1. training data: target hidden states only (GTO builds its trees online), ShareGPT train split, in the shipped
#    drafter's layout (EAGLE-3 inputs: the target's layers 1, 14 and 26)
$HF train prepare --split train --num-conversations "${CONVERSATIONS:-400}" --max-length "$MAX_LENGTH" \
    --input-mode eagle3 --tree-policy none --dtype fp32 $THREADS_OPT --no-progress --output "$RUNS/data/gto-train"

# 2. GTO from the shipped drafter (its frozen copy is the reference)
if [[ "${SMALL:-0}" == "1" ]]; then
    $HF train gto --data "$RUNS/data/gto-train" --output-dir "$RUNS/gto" --max-steps "${MAX_STEPS:-100}" \
        --lr 2e-5 --warmup 10 --num-groups 2 --group-size 4 --tree-budget 24 --tree-depth 5 --save-strategy steps \
        --save-steps 20 --resume $THREADS_OPT
else
    $HF train gto --data "$RUNS/data/gto-train" --output-dir "$RUNS/gto" --epochs 5 --save-strategy steps \
        --save-steps 500 --resume $THREADS_OPT
fi

# 3. ablations (aggregation of the sequence acceptance lengths; no debiasing)
# hf-treespec train gto --data "$RUNS/data/gto-train" --output-dir "$RUNS/gto-max"  --reward-aggregation max --resume
# hf-treespec train gto --data "$RUNS/data/gto-train" --output-dir "$RUNS/gto-mean" --reward-aggregation mean --resume
# hf-treespec train gto --data "$RUNS/data/gto-train" --output-dir "$RUNS/gto-nodebias" --no-debias --resume

# 4. tau and speedup against the reference drafter, same policy
for DRAFTER in "$RUNS/gto" default; do
    $HF bench --drafter "$DRAFTER" --methods plain,tree:eagle2,tree:salf --num-questions "${QUESTIONS:-40}" \
        --max-new-tokens "${BENCH_TOKENS:-128}" --dtype fp32 $THREADS_OPT --no-progress \
        --out "$RUNS/bench-$(basename "$DRAFTER")"
done
