#!/usr/bin/env bash
# The OpenVINO target step beside OpenVINO GenAI's greedy loop, inductor's compiled step and plain `generate`: six
# MT-bench questions x 64 new tokens, greedy, bf16 on this CPU, 3 repeats (median kept), methods interleaved per
# question. Resumable: a configuration whose summary exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=docs/results/compiled/openvino-step
lscpu | grep -E "Model name" ; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
run() {  # $1: folder, rest: bench arguments
  local folder=$OUT/$1; shift
  if [ -e "$folder/summary.json" ]; then echo "done: $folder"; return; fi
  hf-treespec bench --num-questions 6 --max-new-tokens 64 --repeats 3 --no-progress --out "$folder" "$@"
}
run bf16-greedy --dtype bf16 --methods "plain,openvino,plain@compile=openvino,tree:salf@compile=openvino,tree:salf@compile=openvino@tree_budget=4,tree:salf@compile=openvino@tree_budget=8,plain@compile=true,tree:salf@compile=true@tree_budget=4"
run bf16-t1 --dtype bf16 --temperature 1.0 --methods "plain,plain@compile=openvino,tree:salf@compile=openvino,tree:salf@compile=openvino@tree_budget=4,tree:dyspec@compile=openvino,plain@compile=true,tree:salf@compile=true@tree_budget=4"
python docs/results/compiled/openvino-step/drafter_ab.py "$OUT/drafter_ab.json"
python docs/results/compiled/openvino-step/steps.py "$OUT/steps.json"
