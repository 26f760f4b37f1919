#!/usr/bin/env bash
# Learning curve of the SmolLM2 drafter: held-out acceptance (ShareGPT dev chain tau, per-depth top-1) and SALF tau
# on MT-bench vs training data, for original vs regenerated data and EAGLE-1 (fc, last layer) vs EAGLE-3 (low / mid /
# high layers) inputs, all trained with the same objective (`ttt`: 7-step training-time test + TALF trees).
#
# Data sizes are nested: the largest set is extracted once and each smaller one is its first chunks, linked into a
# folder of its own (no extraction twice). With CHUNK=125 prompts, SIZES in prompts must be multiples of 125.
# Resumable like every step: rerun after an interruption. Results: $RUNS/curve/*/acceptance.json, bench-*/table.md,
# training_summary.json (seconds per point).
#
#   RUNS=runs SIZES="250 500 1000 2500" THREADS=2 bash examples/learning_curve.sh
set -euo pipefail
RUNS=${RUNS:-runs}
SIZES=${SIZES:-"250 500 1000 2500"}   # prompts (regenerated) / conversations (original): 10x from first to last
CHUNK=${CHUNK:-125}
MAX_NEW=${MAX_NEW:-256}
EPOCHS=${EPOCHS:-3}
THREADS=${THREADS:-2}
HF=${HF:-"python -m hf_treespec.cli"}
DTYPE=${DTYPE:-auto}                 # the fast dtype: bf16 on GPUs / avx512_bf16 CPUs, fp32 elsewhere
LARGEST=$(echo $SIZES | tr ' ' '\n' | sort -n | tail -1)
TREES="--tree-policy eagle2 --tree-topk 4 --tree-depth 3 --tree-positions 32"

# the target's own answers to the first $LARGEST train prompts (greedy + T=0.8: two answers per prompt)
$HF train regenerate --num-prompts "$LARGEST" --temperature 0,0.8 --max-new-tokens "$MAX_NEW" --max-prompt-tokens 1024 \
    --dtype "$DTYPE" --batch-size 32 --chunk-size "$CHUNK" --threads "$THREADS" --output "$RUNS/regen/curve"

for MODE in fc eagle3; do
    # held-out data with the same target layers: the target's greedy 5-chain at every assistant position
    $HF train prepare --split dev --num-conversations 100 --max-length 512 --input-mode $MODE --dtype "$DTYPE" \
        --tree-policy chain --tree-depth 5 --tree-positions all --threads "$THREADS" --output "$RUNS/data/dev-$MODE"
    # largest sets, chunked so that the smaller sets are prefixes (regenerated: 2 answers per prompt)
    $HF train prepare --data-file "$RUNS/regen/curve" --num-conversations $((2 * LARGEST)) --max-length 1024 \
        --input-mode $MODE --dtype "$DTYPE" --chunk-size $((2 * CHUNK)) $TREES --threads "$THREADS" \
        --output "$RUNS/data/regen-$MODE"
    $HF train prepare --split train --num-conversations "$LARGEST" --max-length 1024 --input-mode $MODE \
        --dtype "$DTYPE" --chunk-size "$CHUNK" $TREES --threads "$THREADS" --output "$RUNS/data/orig-$MODE"
    for SOURCE in orig regen; do
        for N in $SIZES; do
            DATA="$RUNS/data/$SOURCE-$MODE-n$N"
            mkdir -p "$DATA"
            ln -sfn "$(realpath "$RUNS/data/$SOURCE-$MODE/prepare_config.json")" "$DATA/prepare_config.json"
            for ((i = 0; i < N / CHUNK; i++)); do
                NAME=$(printf "chunk-%05d" $i)
                ln -sfn "$(realpath "$RUNS/data/$SOURCE-$MODE/$NAME")" "$DATA/$NAME"
            done
            OUT="$RUNS/curve/$SOURCE-$MODE-n$N"
            $HF train ttt --data "$DATA" --input-mode $MODE --ttt-steps 7 --epochs "$EPOCHS" --batch-size 4 \
                --draft-vocab-size 8192 --save-strategy steps --save-steps 200 --resume --threads "$THREADS" --output-dir "$OUT"
            [ -f "$OUT/acceptance.json" ] || $HF train evaluate --data "$RUNS/data/dev-$MODE" --drafter "$OUT" \
                --threads "$THREADS" --output "$OUT/acceptance.json"
            [ -f "$OUT/bench/table.md" ] || $HF bench --drafter "$OUT" --methods plain,tree:salf --num-questions 40 \
                --max-new-tokens 128 --dtype "$DTYPE" --threads "$THREADS" --repeats 1 --out "$OUT/bench"
        done
    done
done
