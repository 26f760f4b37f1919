"""Builds the C2T ablation tables (tables.md, results.json) from `hf-treespec bench` output folders.

Every row is restricted to the questions all folders share, so rows from different runs compare on the same
prompts (greedy fp32 decoding is deterministic, so a method's per-question numbers do not depend on its run).
Usage: python tables.py OUT_DIR BENCH_DIR [BENCH_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CLF = "runs/c2t/clf/"


def load(folders: list[Path]) -> dict[str, list[dict]]:
    rows: dict[str, dict] = {}
    per_folder_ids = []
    for folder in folders:
        ids = set()
        for line in (folder / "per_question.jsonl").read_text().splitlines():
            r = json.loads(line)
            rows.setdefault(r["method"], {})[r["question_id"]] = r
            ids.add(r["question_id"])
        per_folder_ids.append(ids)
    shared = set.intersection(*per_folder_ids)
    return {m: [q[i] for i in sorted(shared)] for m, q in rows.items()}


def stats(records: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in records)
    forwards = sum(r["target_forwards"] for r in records)
    steps = sum(r["target_forwards"] - 1 for r in records)  # the prefill forward drafts nothing
    nodes = sum((r["mean_tree_size"] or 0) * (r["target_forwards"] - 1) for r in records)
    return {"questions": len(records), "new_tokens": tokens, "tau": round(tokens / forwards, 3),
            "nodes_per_step": round(nodes / max(steps, 1), 2), "total_nodes": round(nodes),
            "nodes_per_token": round(nodes / tokens, 3),
            "identical_to_plain": all(r["identical"] for r in records if r["identical"] is not None)}


def name(method: str) -> str:
    return method.replace("tree:c2t@c2t_classifier=" + CLF, "c2t ").replace("@", " ")


def table(title: str, methods: list[tuple[str, str]], data: dict) -> str:
    lines = [f"### {title}", "", "| setting | method (bench row) | tau | nodes / step | drafted nodes (total) | identical |",
             "|---|---|---:|---:|---:|---|"]
    for label, method in methods:
        if method not in data:
            lines.append(f"| {label} | `{method}` | not run | | | |")
            continue
        s = data[method]
        lines.append(f"| {label} | `{name(method)}` | {s['tau']:.2f} | {s['nodes_per_step']:.1f} | {s['total_nodes']} | "
                     f"{'yes' if s['identical_to_plain'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(out: str, *folders: str) -> None:
    rows = load([Path(f) for f in folders])
    data = {m: stats(r) for m, r in rows.items()}
    c = "tree:c2t@c2t_classifier=" + CLF
    phd = c + "PHd"
    eagle = [(f"EAGLE-2 budget {b}", f"tree:eagle2@tree_budget={b}") for b in (10, 20, 40)]
    t1 = eagle + [(f"C2T {lab}", c + f) for lab, f in
                  [("P+H+d", "PHd"), ("P+H", "PH"), ("P+d", "Pd"), ("H+d", "Hd"), ("P", "P"), ("H", "H"), ("d", "d")]]
    t3 = [(f"chain, length {d}", f"tree:chain@tree_depth={d}") for d in range(5, 10)]
    t3 += [("DyMax (stop when top q < 0.5), max 10", "tree:chain@tree_depth=10@chain_min_prob=0.5"),
           ("DyJoint (stop when joint q < 0.3), max 10", "tree:chain@tree_depth=10@chain_min_joint=0.3")]
    t3 += [(f"C2T chain mode (tree_topk=1), beta {b}, max 10", phd + f"@tree_topk=1@tree_depth=10@c2t_threshold={b}")
           for b in (0.3, 0.5)]
    t5 = [(f"beta 0.5, second top-K {k or 'none'}", phd if k == 15 else phd + f"@c2t_topk={k}") for k in (15, 20, 0)]
    t5 += [(f"beta 0.3, second top-K {k or 'none'}", phd + f"@c2t_threshold=0.3@c2t_topk={k}") for k in (15, 20, 0)]
    t6 = [(f"entropy over top {n}", phd if n == 1000 else phd + f"@c2t_entropy_top={n}")
          for n in (100, 500, 1000, 49152)]
    questions = next(iter(data.values()))["questions"]
    text = (f"MT-bench, first {questions} questions x 64 new tokens, greedy, fp32, `--threads 1`. tau = new tokens per "
            "target forward (the bonus token included; the C2T paper's accept length excludes it); nodes = draft "
            "tokens verified per step (root excluded), the paper's candidate-token count N summed over the run.\n\n")
    text += table("Table 1: classifier features (beta 0.5, second top-K 15)", t1, data) + "\n"
    text += table("Table 3: chain mode", t3, data) + "\n"
    text += table("Table 5: second top-K", t5, data) + "\n"
    text += table("Table 6: entropy over the top N (classifier trained with N = 1000; 49152 = the whole vocabulary)",
                  t6, data)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "tables.md").write_text(text)
    (Path(out) / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main(*sys.argv[1:])
