#!/usr/bin/env bash
# The compiled target step three ways in one process (previous graph / lean attention / lean attention without oneDNN
# weight prepacking), then a second process that compiles the no-prepack variant again from inductor's on-disk cache,
# then lean attention called through inductor's Python wrapper or its C++ one (cpp_wrapper). Resumable: each part is
# skipped when its output exists.
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/hf_treespec/inductor}"
[ -e steps.json ] || OUT=steps.json python step_variants.py > steps.log 2>&1
[ -e second_process.json ] || OUT=second_process.json python step_variants.py lean_noprepack > second_process.log 2>&1
[ -e cpp_wrapper.json ] || OUT=cpp_wrapper.json python step_variants.py lean lean_cppwrap > cpp_wrapper.log 2>&1
