"""Learning curve of trained drafters: held-out acceptance and SALF tau against the training tokens they saw.

Each point is a drafter folder written by ``hf-treespec train ...``; its training tokens and wall time come from its
``training_summary.json``. ``DIR+INIT`` names a drafter trained from another one's weights (``--init``, e.g. TALF after
an EAGLE warm-up): the time of both is counted, the tokens are the data of the first. A drafter without a summary (the
shipped one) takes ``--tokens DIR=N`` (and optionally ``--seconds DIR=S``). Chain tau and per-depth top-1 come from the
``train evaluate --output`` JSON, SALF tau from the ``bench`` summary whose rows ran each drafter
(``tree:salf@drafter=DIR``; the bench's own ``--drafter`` for plain ``tree:salf``). ``SERIES::DIR`` puts a point on a
named curve (e.g. ``original::``, ``regenerated::``, ``eagle3::``) so several data sources or layouts share one plot.
Relative drafter folders inside those files are resolved against the folder the run was started in, taken to be the
one holding its output (``train evaluate --output acceptance.json``, ``bench --out bench_t0``) when the drafter is
found there, else the current directory: runs from several working folders combine.

    python examples/plot_learning_curve.py --acceptance runs/curve/acceptance.json --bench runs/curve/bench_mt/summary.json \\
        --point runs/curve/talf-c1+runs/curve/eagle-c1 ... --point "$SHIPPED" --tokens "$SHIPPED=411547" \\
        --out docs/img/learning_curve.png

``--level "LABEL=TAU"`` draws a horizontal reference, e.g. a goal or the ceiling a perfect drafter reaches with
the same trees (``hf-treespec bench --drafter oracle``).

Prints a Markdown table (tokens, training time, depth-1 top-1, chain tau, SALF tau), each series' least-squares slope
of tau per 10x of training tokens, and writes the PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from hf_treespec.assets import shipped_drafter_path


SERIES_SEP = "::"


@dataclass
class Point:
    series: str
    drafter: str
    tokens: int
    seconds: float | None
    top1_d1: float | None
    chain_tau: float | None
    salf_tau: float | None


def _summary(folder: str) -> dict | None:
    path = Path(folder) / "training_summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _pairs(values: list[str], name: str) -> dict[str, float]:
    pairs = {}
    for value in values:
        folder, sep, number = value.rpartition("=")
        if not sep:
            raise SystemExit(f"{name} expects DIR=NUMBER, got {value!r}")
        pairs[str(Path(folder).resolve())] = float(number)
    return pairs


def _resolve(folder: str, started_in: Path) -> str:
    """``folder`` as written by a run started in ``started_in`` (if it is there), else relative to the current one."""
    candidate = started_in / folder
    return str((candidate if candidate.exists() else Path(folder)).resolve())


def _salf_taus(bench_summary: dict, started_in: Path) -> dict[str, float]:
    """drafter folder (resolved) -> tau of its tree:salf row in one bench summary."""
    settings = bench_summary["settings"]
    default = settings.get("drafter")
    default = str(shipped_drafter_path()) if default in (None, "default") else default
    row_drafters = settings.get("method_drafters") or {}
    taus = {}
    for method in bench_summary["methods"]:
        if method["base_method"].split("@")[0] != "tree:salf" or method.get("sweep_value") is not None:
            continue
        folder = row_drafters.get(method["method"], default)
        taus[_resolve(folder, started_in)] = method["tau"]
    return taus


def collect(points: list[str], acceptance: dict, salf: dict[str, float], tokens: dict[str, float],
            seconds: dict[str, float]) -> list[Point]:
    out = []
    for spec in points:
        series, _, spec = spec.rpartition(SERIES_SEP)  # no prefix: series ""
        folders = [str(Path(f).resolve()) for f in spec.split("+")]
        main = folders[0]
        summaries = [_summary(f) for f in folders]
        if main in tokens:
            n = int(tokens[main])
        elif summaries[0] is not None and "tokens" in summaries[0]:
            n = int(summaries[0]["tokens"])
        else:
            raise SystemExit(f"{main} has no training_summary.json with a token count: give --tokens {main}=N")
        if main in seconds:
            time = seconds[main]
        elif all(s is not None for s in summaries):
            time = sum(s["seconds"] for s in summaries)
        else:
            time = None
        row = acceptance.get(main, {})
        out.append(Point(series, main, n, time, row.get("top1_d1"), row.get("tau_chain"), salf.get(main)))
    return sorted(out, key=lambda p: (p.series, p.tokens))


def table(points: list[Point]) -> str:
    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    lines = ["| series | drafter | training tokens | training time (s) | top-1 depth 1 | chain tau (dev) | "
             "SALF tau (MT-bench) |", "|---|---|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p.series} | {Path(p.drafter).name} | {p.tokens:,} | {fmt(p.seconds, '.0f')} | {fmt(p.top1_d1, '.3f')} | "
                     f"{fmt(p.chain_tau, '.3f')} | {fmt(p.salf_tau, '.3f')} |")
    return "\n".join(lines)


def _curves(points: list[Point]):
    """(series, metric attribute, label, tokens, values) for every series and metric with at least one value."""
    for series in dict.fromkeys(p.series for p in points):
        for attr, label in (("salf_tau", "SALF tau, MT-bench"), ("chain_tau", "chain tau, ShareGPT dev")):
            members = [p for p in points if p.series == series and getattr(p, attr) is not None]
            if members:
                yield series, attr, label, [p.tokens for p in members], [getattr(p, attr) for p in members]


def fits(points: list[Point]) -> list[str]:
    """Least-squares line of each series' tau against log10(tokens): what the next 10x of data buys if it stays straight."""
    lines = []
    for series, _, label, tokens, values in _curves(points):
        if len(set(tokens)) < 2:
            continue
        slope, intercept = statistics.linear_regression([math.log10(n) for n in tokens], values)
        lines.append(f"{series or 'all'}: {label.split(',')[0]} {slope:+.3f} per 10x of data "
                     f"(= {intercept:.3f} {slope:+.3f} log10 tokens, {len(values)} points)")
    return lines


def levels(values: list[str]) -> dict[str, float]:
    """``--level "LABEL=TAU"`` -> {label: tau}: horizontal references such as a goal or a perfect drafter's tau."""
    found = {}
    for value in values:
        label, sep, number = value.rpartition("=")
        try:
            found[label] = float(number)
        except ValueError:
            sep = ""
        if not sep or not label:
            raise SystemExit(f"--level expects LABEL=TAU, got {value!r}")
    return found


def plot(points: list[Point], out: str, title: str, references: dict[str, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(9.5, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of = {series: colors[i % len(colors)] for i, series in enumerate(dict.fromkeys(p.series for p in points))}
    for series, attr, label, tokens, values in _curves(points):
        style = "o-" if attr == "salf_tau" else "s--"
        axis.plot(tokens, values, style, color=color_of[series], label=f"{series}: {label}" if series else label)
    for index, (label, tau) in enumerate((references or {}).items()):
        axis.axhline(tau, color="0.35", linestyle=(0, (1, 2 + index)), linewidth=1, label=label)
    axis.set_xscale("log")
    axis.set(xlabel="training tokens", ylabel="tau (tokens per target forward)", title=title)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # never over the points
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--point", action="append", required=True,
                        help="[SERIES::]DIR or DIR+INIT_DIR, one per drafter")
    parser.add_argument("--acceptance", action="append", default=[],
                        help="JSON written by `hf-treespec train evaluate --output` (repeat for several)")
    parser.add_argument("--bench", action="append", default=[], help="summary.json of a bench with tree:salf rows")
    parser.add_argument("--tokens", action="append", default=[], help="DIR=N for a drafter without a summary")
    parser.add_argument("--seconds", action="append", default=[], help="DIR=S training time, overriding the summary")
    parser.add_argument("--level", action="append", default=[],
                        help="LABEL=TAU, a horizontal reference line (a goal, the tau of `bench --drafter oracle`)")
    parser.add_argument("--out", default="learning_curve.png")
    parser.add_argument("--title", default="drafter acceptance vs training data")
    args = parser.parse_args()

    acceptance: dict = {}
    for path in map(Path, args.acceptance):  # written by `train evaluate --output` into the folder it ran in
        acceptance.update({_resolve(k, path.parent): v for k, v in json.loads(path.read_text()).items()})
    salf: dict[str, float] = {}
    for path in map(Path, args.bench):  # <folder it ran in>/<--out>/summary.json
        salf.update(_salf_taus(json.loads(path.read_text()), path.parent.parent))
    points = collect(args.point, acceptance, salf, _pairs(args.tokens, "--tokens"), _pairs(args.seconds, "--seconds"))
    print(table(points))
    for line in fits(points):
        print(line)
    plot(points, args.out, args.title, levels(args.level))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
