"""Per-question tau differences (mean +- standard error), same questions, same run: each trained drafter against the
shipped one, and the longer run against the shorter."""
import json
import statistics as st
from collections import defaultdict
from pathlib import Path

PAIRS = [("tree:salf@drafter=talf-p0", "tree:salf"), ("tree:salf@drafter=talf-p01-e3", "tree:salf"),
         ("tree:salf@drafter=talf-p01-e3", "tree:salf@drafter=talf-p0")]
for run in ("bench_t0", "bench_t1"):
    tau = defaultdict(dict)
    for line in (Path(__file__).parent / run / "per_question.jsonl").open():
        row = json.loads(line)
        tau[row["method"]][row["question_id"]] = row["new_tokens"] / row["target_forwards"]
    for method, base in PAIRS:
        diff = [tau[method][q] - tau[base][q] for q in tau[base]]
        print(f"{run} {method} vs {base}: {st.mean(diff):+.3f} +- {st.stdev(diff) / len(diff) ** 0.5:.3f} "
              f"(n={len(diff)})")
