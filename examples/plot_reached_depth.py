"""Acceptance by draft depth from `hf-treespec bench` runs (the delayed-expansion paper's Figure 1, as measured in
decoding): per tree method, the share of steps that accepted at least d drafts (``reached_depth`` in summary.json)
and the acceptance at depth d given depth d - 1 (their ratio). One column of panels per summary.json (e.g. one per
temperature); a markdown table of the same numbers goes to ``--table``.

    python examples/plot_reached_depth.py runs/depth_t0.6/summary.json runs/depth_t1.0/summary.json \\
        --out docs/results/papers/delayed_expansion/reached_depth.png --table reached_depth.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def depth_rows(summary: dict) -> list[dict]:
    """Per tree method of one summary: its label, tau, nodes per step, reached share and conditional acceptance."""
    rows = []
    for method in summary["methods"]:
        reached = method.get("reached_depth")
        if not reached:
            continue
        previous = [1.0, *reached[:-1]]
        conditional = [r / p if p > 0 else None for r, p in zip(reached, previous)]
        label = method["method"].split("@", 1)[1] if "@" in method["method"] else method["method"]
        rows.append({"method": label, "tau": method["tau"], "nodes": method["mean_tree_size"],
                     "reached": reached, "conditional": conditional})
    return rows


def table(summaries: dict[str, dict], depths: int) -> str:
    reach = " | ".join(f"reach d={d}" for d in range(1, depths + 1))
    accept = " | ".join(f"accept d={d} given d-1" for d in range(1, depths + 1))
    lines = [f"| run | method | tau | {reach} | {accept} |", "|---|---|---:|" + "---:|" * (2 * depths)]
    for name, summary in summaries.items():
        for row in depth_rows(summary):
            cells = [_cell(row["reached"], d) for d in range(depths)] + [_cell(row["conditional"], d)
                                                                        for d in range(depths)]
            lines.append(f"| {name} | {row['method']} | {row['tau']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(values: list, index: int) -> str:
    value = values[index] if index < len(values) else None
    return "" if value is None else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summaries", nargs="+", help="summary.json files of hf-treespec bench runs")
    parser.add_argument("--out", default="reached_depth.png")
    parser.add_argument("--table", default=None, help="also write the numbers as a markdown table here")
    parser.add_argument("--depths", type=int, default=4, help="depths shown")
    args = parser.parse_args()

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summaries = {}
    for path in args.summaries:
        summary = json.loads(Path(path).read_text())
        settings = summary["settings"]
        summaries[f"T={settings['temperature']:g}"] = summary
    figure = Figure(figsize=(5.0 * len(summaries), 7.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, len(summaries), squeeze=False)
    for column, (name, summary) in enumerate(summaries.items()):
        for row in depth_rows(summary):
            xs = list(range(1, min(len(row["reached"]), args.depths) + 1))
            axes[0][column].plot(xs, row["reached"][: len(xs)], marker="o", label=f"{row['method']} (tau {row['tau']:.2f})")
            axes[1][column].plot(xs, row["conditional"][: len(xs)], marker="o", label=row["method"])
        axes[0][column].set_title(f"{name}: share of steps reaching depth d")
        axes[1][column].set_title(f"{name}: acceptance at depth d given d - 1")
        for ax in axes[:, column]:
            ax.set_xlabel("draft depth d")
            ax.set_ylim(0, 1)
            ax.legend(fontsize=7)
    figure.savefig(args.out, dpi=110)
    if args.table:
        Path(args.table).write_text(table(summaries, args.depths))
    print(table(summaries, args.depths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
