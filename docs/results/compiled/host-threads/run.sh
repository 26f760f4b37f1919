#!/usr/bin/env bash
# torch's threads on the OpenVINO step's draft-free steps: one (the package's choice) vs the caller's two, paired.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
lscpu | grep -E "Model name"; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
git rev-parse --short HEAD
python docs/results/compiled/host-threads/ab.py --repeats 4
