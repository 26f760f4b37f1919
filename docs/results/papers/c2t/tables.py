"""Builds the C2T ablation tables (tables.md, results.json) from `hf-treespec bench` output folders.

Within a table every row is restricted to the questions all its rows ran, so rows from different runs compare on
the same prompts (greedy fp32 decoding is deterministic, so a method's per-question numbers do not depend on its run).
Usage: python tables.py OUT_DIR TABLES BENCH_DIR [BENCH_DIR ...]  (TABLES: e.g. 1,3; a folder without
per_question.jsonl: its q*/ subfolders). Runs of different lengths must not share an invocation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CLF = "runs/c2t/clf/"


def load(folders: list[Path]) -> dict[str, dict]:
    """method -> question id -> record, over every folder (and the q*/ subfolders of a folder without records)."""
    rows: dict[str, dict] = {}
    files = []
    for folder in folders:
        own = folder / "per_question.jsonl"
        files += [own] if own.is_file() else sorted(folder.glob("q*/per_question.jsonl"))
    for path in files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            rows.setdefault(r["method"], {})[r["question_id"]] = r
    return rows


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


def table(title: str, methods: list[tuple[str, str]], rows: dict, results: dict) -> str:
    """The table on the questions all its rows ran; when some rows ran fewer questions than the rest (a run cut
    short), also the table without those rows on the questions the others share."""
    ran = [m for _, m in methods if m in rows]
    if not ran:
        return f"### {title}\n\nnot run\n"
    text = _table(title, methods, rows, results, sorted(set.intersection(*(set(rows[m]) for m in ran))))
    most = max(len(rows[m]) for m in ran)
    complete = [m for m in ran if len(rows[m]) == most]
    if len(complete) < len(ran):
        full = sorted(set.intersection(*(set(rows[m]) for m in complete)))
        text += "\n" + _table(title + ", rows that ran every question", [(lab, m) for lab, m in methods
                                                                          if m in complete], rows, results, full)
    return text


def _table(title: str, methods: list[tuple[str, str]], rows: dict, results: dict, shared: list) -> str:
    lines = [f"### {title} ({len(shared)} questions)", "",
             "| setting | method (bench row) | tau | nodes / step | drafted nodes (total) | identical |",
             "|---|---|---:|---:|---:|---|"]
    for label, method in methods:
        if method not in rows:
            lines.append(f"| {label} | `{name(method)}` | not run | | | |")
            continue
        s = stats([rows[method][q] for q in shared])
        results.setdefault(f"{title} ({len(shared)} questions)", {})[label] = {"method": method,
                                                                             "question_ids": shared, **s}
        lines.append(f"| {label} | `{name(method)}` | {s['tau']:.2f} | {s['nodes_per_step']:.1f} | {s['total_nodes']} | "
                     f"{'yes' if s['identical_to_plain'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(out: str, which: str, *folders: str) -> None:
    rows = load([Path(f) for f in folders])
    results: dict = {}
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
    text = ("MT-bench questions (the first ones; count per table) x 64 new tokens, greedy, fp32, `--threads 1`. tau = new tokens per "
            "target forward (the bonus token included; the C2T paper's accept length excludes it); nodes = draft "
            "tokens verified per step (root excluded), the paper's candidate-token count N summed over the run.\n\n")
    tokens = sorted({r["new_tokens"] for m in rows.values() for r in m.values()})
    text = text.replace("x 64 new tokens", f"x {'/'.join(map(str, tokens))} new tokens")
    tables = {"1": ("Table 1: classifier features (beta 0.5, second top-K 15)", t1), "3": ("Table 3: chain mode", t3),
              "5": ("Table 5: second top-K", t5),
              "6": ("Table 6: entropy over the top N (classifier trained with N = 1000; 49152 = the whole vocabulary)",
                    t6)}
    text += "\n".join(table(*tables[t], rows, results) for t in which.split(","))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"tables_{which.replace(',', '_')}.md").write_text(text)
    (Path(out) / f"results_{which.replace(',', '_')}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main(*sys.argv[1:])
