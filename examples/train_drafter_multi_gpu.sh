#!/usr/bin/env bash
# The same pipeline on several GPUs with accelerate (one process per GPU, DDP). Extraction runs on one GPU (it is a
# no-grad target pass); the trainers are plain transformers Trainers, so `accelerate launch` / `torchrun` shard the
# batches and loss normalisation counts scored items across devices (average_tokens_across_devices).
set -euo pipefail
RUNS=${RUNS:-runs}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
TRAIN="accelerate launch --num_processes $NGPU --mixed_precision bf16 -m hf_treespec.cli train"

CUDA_VISIBLE_DEVICES=0 hf-treespec train prepare --split train --num-conversations 16000 --max-length 2048 \
    --batch-tokens 32768 --chunk-size 256 --tree-positions all --output "$RUNS/data/train"
CUDA_VISIBLE_DEVICES=0 hf-treespec train prepare --split dev --num-conversations 200 --max-length 2048 \
    --tree-policy chain --tree-depth 5 --tree-positions all --output "$RUNS/data/dev"

$TRAIN eagle --data "$RUNS/data/train" --eval-data "$RUNS/data/dev" --output-dir "$RUNS/eagle" \
    --epochs 10 --batch-size 8 --resume
$TRAIN talf --data "$RUNS/data/train" --eval-data "$RUNS/data/dev" --init "$RUNS/eagle" \
    --output-dir "$RUNS/talf" --epochs 3 --batch-size 8 --resume
$TRAIN hass --data "$RUNS/data/train" --eval-data "$RUNS/data/dev" --init "$RUNS/eagle" \
    --output-dir "$RUNS/hass" --epochs 3 --batch-size 8 --resume

hf-treespec train evaluate --data "$RUNS/data/dev" \
    --drafter "$RUNS/eagle" --drafter "$RUNS/hass" --drafter "$RUNS/talf" --output "$RUNS/acceptance.json"
