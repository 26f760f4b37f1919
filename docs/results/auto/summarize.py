"""auto against the best of the fixed sizes and plain decoding through the same forward, per configuration of
`run.sh`: writes auto_vs_best.json and prints the markdown table BENCHMARKS quotes (python docs/results/auto/summarize.py)."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = {"b1-compiled-greedy": "batch 1, compiled, greedy", "b1-compiled-t1": "batch 1, compiled, T=1",
           "b4-eager-greedy": "batch 4, eager, greedy", "b4-eager-t1": "batch 4, eager, T=1"}
SIZES = (2, 4, 8, 16)


def rows_of(folder: Path) -> tuple[dict, dict]:
    """method -> (speed over plain decoding through the same forward, tau), and the run's settings."""
    if (folder / "summary.json").exists():  # batch 1: over compiled plain
        data = json.loads((folder / "summary.json").read_text())
        return {m["method"].replace("@compile=true", ""): (m["speedup_compiled"], m["tau"]) for m in data["methods"]
                if m["method"] != "plain"}, data["settings"]
    data = json.loads((folder / "batched.json").read_text())  # batch 4: over plain batched generate
    return {r["method"]: (r["speedup"], r["tau"] or 1.0) for r in data["rows"]}, data["settings"]


def main() -> None:
    table = ["| configuration | auto | 2 nodes | 4 nodes | 8 nodes | 16 nodes | auto over the best |",
             "|---|---|---|---|---|---|---:|"]
    summary = {}
    for name, label in CONFIGS.items():
        rows, settings = rows_of(HERE / name)
        plain = "plain@compile=true" if "plain@compile=true" in rows else "plain"
        fixed = {n: rows[f"tree:salf@tree_budget={n}"] for n in SIZES}
        auto = rows["tree:salf"]
        best_name, best = max([("plain", 1.0)] + [(f"{n} nodes", fixed[n][0]) for n in SIZES], key=lambda x: x[1])
        summary[name] = {"auto_speedup": auto[0], "best": best_name, "best_speedup": best,
                         "speedup_auto_over_best": auto[0] / best, "commit": settings.get("commit"), "date": settings.get("date")}
        cells = [f"{auto[0]:.2f}x ({auto[1]:.2f})"] + [f"{fixed[n][0]:.2f}x ({fixed[n][1]:.2f})" for n in SIZES]
        table.append(f"| {label} | " + " | ".join(cells) + f" | {auto[0] / best:.2f}x of {best_name} |")
        assert plain in rows or plain == "plain"
    (HERE / "auto_vs_best.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
