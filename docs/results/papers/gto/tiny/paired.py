"""Per-question tau differences (mean +- standard error) between drafters of bench_mt_t0: same questions, same run."""
import json
import statistics as st
from collections import defaultdict
from pathlib import Path

tau = defaultdict(dict)
for line in (Path(__file__).parent / "per_question.jsonl").open():
    row = json.loads(line)
    tau[row["method"].split("runs/")[-1]][row["question_id"]] = row["new_tokens"] / row["target_forwards"]
PAIRS = [("gto_eagle", "eagle"), ("gto_hass", "hass"), ("gto_talf", "talf"), ("gto_eagle_m2", "eagle"),
         ("gto_eagle_m8", "eagle"), ("hass_pap", "hass"), ("hass", "eagle"), ("talf", "eagle")]
for new, old in PAIRS:
    diff = [tau[new][q] - tau[old][q] for q in tau[old]]
    print(f"{new:13s} - {old:6s}: {st.mean(diff):+.3f} +- {st.stdev(diff) / len(diff) ** 0.5:.3f} (n={len(diff)})")
