#!/usr/bin/env bash
# BEFORE: a checkout of f74c7e9, AFTER: a checkout of f894de8, OUT: this folder
# paired before/after: before = f74c7e9 (two loops, lockstep threads), after = main HEAD; A B A B
set -u
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
Q="bench --num-questions 5 --max-new-tokens 64 --methods plain,assisted_lookup,tree:salf@tree_budget=auto,tree:salf@tree_budget=16 --no-progress"
B="bench --batch-size 1,4 --num-questions 8 --max-new-tokens 64 --methods plain,tree:salf@tree_budget=16 --no-progress"
for rep in 1 2; do
  for side in before after; do
    dir=$BEFORE; [ $side = after ] && dir=$AFTER
    (cd $dir && /usr/bin/time -f "%e" python -m hf_treespec.cli $Q --out $OUT/quick-$side-$rep) > $OUT/quick-$side-$rep.log 2>&1
  done
done
for rep in 1 2; do
  for side in before after; do
    dir=$BEFORE; [ $side = after ] && dir=$AFTER
    (cd $dir && /usr/bin/time -f "%e" python -m hf_treespec.cli $B --out $OUT/batched-$side-$rep) > $OUT/batched-$side-$rep.log 2>&1
  done
done
echo done > $OUT/DONE
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
for rep in 1 2; do for side in before after; do
  dir=$BEFORE; [ $side = after ] && dir=$AFTER
  (cd $dir && PYTHONPATH=. python examples/host_overhead.py --policy salf --num-questions 5 --max-new-tokens 64 --set tree_budget=16 --dtype fp32) > host-$side-$rep.log 2>&1
done; done
for rep in 1 2; do for side in before after; do
  dir=$BEFORE; [ $side = after ] && dir=$AFTER
  (cd $dir && PYTHONPATH=. python examples/host_overhead.py --policy salf --num-questions 5 --max-new-tokens 64 --set tree_budget=16 --dtype bf16 --threads 2) > hostbf16-$side-$rep.log 2>&1
done; done
# alternating whole-process runs (after, before, after, before, ...; one warm-up each, then 4 counted), bf16, 2 threads:
#   (cd $AFTER && python examples/host_overhead.py --policy salf --num-questions 5 --max-new-tokens 64 \
#      --set tree_budget=16 --dtype bf16 --threads 2) >> alternating-after.log
#   (cd $BEFORE && PYTHONPATH=. python examples/host_overhead.py ... same ...) >> alternating-before.log
