#!/usr/bin/env bash
# The shipped drafter trained on (TALF, fp32 master weights) over 1,152 new answers of the target to ShareGPT train
# records 2,210-2,851 (greedy and T 1, regenerated on an H100: regen_jsonl/regen_p0.jsonl, 326,808 tokens with their
# prompts), with its one decoder layer and deepened to two (`--num-layers 2`: the new layer starts as an identity).
# 2-core AMD EPYC (avx2 only), fp32, 2 threads, transformers 5.24.0, torch 2.13.0.
set -euo pipefail
SHIP=$(python -c "from hf_treespec.assets.drafters import shipped_drafter_path as p; print(p())")
# the answers: the first of the four H100 regeneration processes of docs/history.md ("Fifteen minutes of one H100"),
# bf16 on the GPU, stopped by its time limit after 576 prompts; the same command on any machine:
hf-treespec train regenerate --split train --skip 2210 --num-prompts 576 --max-new-tokens 256 --max-prompt-tokens 512 \
  --temperature 0,1.0 --output regen_p0
hf-treespec train prepare --data-file regen_p0 --num-conversations 0 --max-length 512 --chunk-size 64 \
  --input-mode eagle3 --tree-policy eagle2 --tree-topk 4 --tree-depth 3 --tree-positions 8 --threads 2 \
  --output data-p0-e3                                                         # 1,657 s
T="--data data-p0-e3 --init $SHIP --epochs 2 --lr 3e-4 --batch-size 4 --threads 2 --resume --save-total-limit 1"
hf-treespec train talf $T --output-dir talf-p0                                # 874 s
hf-treespec train talf $T --num-layers 2 --output-dir talf2-p0                # 1,137 s
hf-treespec bench --drafter $SHIP --num-questions 40 --max-new-tokens 128 --set tree.tree_budget=16 --threads 2 \
  --methods "plain,tree:salf,tree:salf@drafter=talf-p0,tree:salf@drafter=talf2-p0" --out bench_t0
hf-treespec bench --drafter $SHIP --num-questions 40 --max-new-tokens 64 --temperature 1 --seed 0 --set tree.tree_budget=16 \
  --threads 2 --methods "plain,tree:salf,tree:salf@drafter=talf-p0,tree:salf@drafter=talf2-p0" --out bench_t1
hf-treespec train prepare --split dev --num-conversations 32 --max-length 512 --chunk-size 32 --input-mode eagle3 \
  --tree-policy chain --tree-depth 4 --tree-positions 64 --threads 2 --output data-dev-e3
hf-treespec train evaluate --data data-dev-e3 --drafter $SHIP --drafter talf-p0 --drafter talf2-p0 --threads 2 \
  --output acceptance.json
python paired.py    # per-question tau differences against the shipped drafter (paired.txt)
