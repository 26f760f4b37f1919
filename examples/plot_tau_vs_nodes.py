"""Scatter of tau against verified nodes per step (and the wall-clock consequence) from `hf-treespec bench` runs.

One point per tree method of the runs' ``summary.json``; points of one policy are joined in order of tree size, so
C2T across thresholds and EAGLE-2 across budgets read as two trade-off curves. The right panel shows the speedup
against plain ``generate`` of the same run.

    python examples/plot_tau_vs_nodes.py runs/c2t_scatter/summary.json --out docs/img/c2t_vs_eagle2.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def points(paths: list[str]) -> dict[str, list[tuple[float, float, float, str]]]:
    """policy -> [(nodes per step, tau, speedup, label)] sorted by nodes."""
    curves: dict[str, list[tuple[float, float, float, str]]] = defaultdict(list)
    for path in paths:
        summary = json.loads(Path(path).read_text())
        for method in summary["methods"]:
            if method.get("mean_tree_size") is None:
                continue  # plain and the peers verify no tree
            policy = method["base_method"].split("@")[0]
            label = method["method"].split("@", 1)[1] if "@" in method["method"] else "default"
            curves[policy].append((method["mean_tree_size"], method["tau"], method["speedup"], label))
    return {policy: sorted(values) for policy, values in curves.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summaries", nargs="+", help="summary.json files of hf-treespec bench runs")
    parser.add_argument("--out", default="tau_vs_nodes.png")
    parser.add_argument("--title", default="tau and speedup vs verified nodes per step")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = points(args.summaries)
    if not curves:
        raise SystemExit(f"no tree methods in {args.summaries}")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, values in curves.items():
        nodes, tau, speed, labels = zip(*values)
        left.plot(nodes, tau, "o-", label=policy)
        right.plot(nodes, speed, "o-", label=policy)
        for x, y, text in zip(nodes, tau, labels):
            left.annotate(text.replace("c2t_threshold=", "b=").replace("tree_budget=", "N="), (x, y), fontsize=7,
                          xytext=(3, 3), textcoords="offset points")
    left.set(xlabel="verified nodes per step", ylabel="tau (tokens per target forward)", title="acceptance")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set(xlabel="verified nodes per step", ylabel="speedup vs plain generate", title="wall clock (same run)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(json.dumps({policy: [(round(n, 1), round(t, 2), round(s, 2), lab) for n, t, s, lab in v]
                      for policy, v in curves.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
