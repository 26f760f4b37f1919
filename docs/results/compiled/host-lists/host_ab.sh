#!/usr/bin/env bash
# Host time a step (`host_ab.py`) of the code before the host-list changes (commit $BEFORE) and of this code, two
# rounds of alternating processes per case, after run.sh built this code's packages. Output: host_ab.txt.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_TREESPEC_COMPILED_CACHE=${PACKAGE_CACHE:-/tmp/hf_treespec_host_lists}
OUT=docs/results/compiled/host-lists
BEFORE=${BEFORE:-472f357}
[ -e "$OUT/host_ab.txt" ] && { echo "done: $OUT/host_ab.txt"; exit 0; }
before=$(mktemp -d)/before
git worktree add -q --detach "$before" "$BEFORE"
trap 'git worktree remove --force "$before"' EXIT
export HOST_AB_DIGEST=$(python -c "from hf_treespec.compiled import packaged; print(packaged._source_digest())")
{
  echo "before: $BEFORE, after: $(git rev-parse --short HEAD)"
  for round in 1 2 3 4; do
    for case in b1-t1-dyspec-3 b4-greedy-salf-2; do
      echo "round $round, before: $(PYTHONPATH=$before python "$OUT/host_ab.py" $case 2>/dev/null | tail -1)"
      echo "round $round, after:  $(PYTHONPATH=$PWD python "$OUT/host_ab.py" $case 2>/dev/null | tail -1)"
    done
  done
} > "$OUT/host_ab.tmp"
mv "$OUT/host_ab.tmp" "$OUT/host_ab.txt"
