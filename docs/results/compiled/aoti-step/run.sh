#!/usr/bin/env bash
# Export + AOTInductor package of the target's step, then a second process that only loads it: bf16 (this CPU's fast
# dtype) and fp32. Resumable: each part is skipped when its log exists. Packages go to $PACKAGE_DIR (default /tmp).
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1
{ lscpu | grep -E "Model name|Family|Model:"; grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort -u
  python -c "import torch; print('torch', torch.__version__)"; } > cpu.txt
for dtype in bfloat16 float32; do
  [ -e "build_$dtype.log" ] || DTYPE=$dtype python aoti_step.py build > "build_$dtype.log" 2>&1
  [ -e "load_$dtype.log" ] || DTYPE=$dtype python aoti_step.py load > "load_$dtype.log" 2>&1
done
