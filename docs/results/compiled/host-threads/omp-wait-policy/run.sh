#!/usr/bin/env bash
# A/B of OpenMP wait policy: default vs PASSIVE, alternating, GenAI as the steady reference
cd "$(dirname "$0")/../../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
M="openvino,plain@compile=openvino,tree:salf@compile=openvino@tree_budget=4"
for i in 1 2; do
  for v in default passive; do
    out=docs/results/compiled/host-threads/omp-wait-policy/${v}$i; [ -e $out/summary.json ] && continue
    if [ $v = passive ]; then export OMP_WAIT_POLICY=PASSIVE; else unset OMP_WAIT_POLICY; fi
    hf-treespec bench --num-questions 3 --max-new-tokens 64 --repeats 3 --no-progress --dtype bf16 --out $out --methods "$M" > $out.log 2>&1
  done
done
