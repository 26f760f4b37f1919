"""Per-question tau differences (mean +- standard error) against the shipped drafter, same questions, same run."""
import json
import statistics as st
from collections import defaultdict
from pathlib import Path

for run in ("bench_t0", "bench_t1"):
    tau = defaultdict(dict)
    for line in (Path(__file__).parent / run / "per_question.jsonl").open():
        row = json.loads(line)
        tau[row["method"]][row["question_id"]] = row["new_tokens"] / row["target_forwards"]
    base = tau["tree:salf"]
    for method in ("tree:salf@drafter=talf-p0", "tree:salf@drafter=talf2-p0"):
        diff = [tau[method][q] - base[q] for q in base]
        print(f"{run} {method}: {st.mean(diff):+.3f} +- {st.stdev(diff) / len(diff) ** 0.5:.3f} (n={len(diff)})")
