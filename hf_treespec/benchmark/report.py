"""Benchmark output: per-question JSONL, summary JSON, a markdown table and PNG plots.

Plots use matplotlib's object API with the Agg canvas (no pyplot), so no global backend state is touched and the
report works on headless machines.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .results import BASELINE, COMPILED_BASELINE, BenchmarkResult, MethodSummary, identity_text

PER_QUESTION_FILE = "per_question.jsonl"
SUMMARY_FILE = "summary.json"
TABLE_FILE = "table.md"
PLOT_FILE = "plot.png"
SWEEP_PLOT_FILE = "sweep.png"
COST_PLOT_FILE = "cost_curves.png"


def write_report(result: BenchmarkResult, out: str | os.PathLike, echo: bool = False) -> Path:
    """Writes every output file under ``out`` (created if needed); with ``echo`` also prints the markdown table."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    summaries = result.summaries()
    with open(folder / PER_QUESTION_FILE, "w", encoding="utf-8") as handle:
        for record in result.records:
            handle.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
    summary = {"settings": result.settings, "skipped": result.skipped, "methods": [asdict(s) for s in summaries]}
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    table = markdown_report(result, summaries)
    (folder / TABLE_FILE).write_text(table, encoding="utf-8")
    plot_methods([s for s in summaries if s.method not in result.sweep_methods], folder / PLOT_FILE)
    if result.sweep is not None:
        plot_sweep(result, summaries, folder / SWEEP_PLOT_FILE)
    curves = {name: result.settings.get(key) for name, key in (("eager", "cost_curve"),
                                                                ("compiled", "compiled_cost_curve"))}
    if all(curves.values()):
        from ..cost.curve import CostCurve

        plot_cost_curves({name: CostCurve.from_json(c) for name, c in curves.items()}, folder / COST_PLOT_FILE,
                         title=result.settings.get("hardware_summary", ""))
    if echo:
        print(table)
    return folder


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:{spec}}{suffix}"


def _split(s: MethodSummary) -> str:
    """draft / verify / other as percentages of the method's wall time."""
    if s.draft_seconds is None or s.seconds <= 0:
        return "n/a"
    parts = (s.draft_seconds, s.verify_seconds, s.other_seconds)
    return " / ".join(f"{100 * p / s.seconds:.0f}%" for p in parts)


def _identity(s: MethodSummary, greedy: bool) -> str:
    if not greedy:
        return "n/a (sampling)"
    if s.method == BASELINE:
        return "reference"
    return identity_text(s.identical, s.compared, None if s.method == COMPILED_BASELINE else s.identical_eager)


def _max_gap(s: MethodSummary) -> str:
    gaps = [d["top2_gap"] for d in s.divergences if d.get("top2_gap") is not None]
    return _fmt(max(gaps), ".3f") if gaps else ""


def _header(settings: dict[str, Any]) -> str:
    sampling = "greedy" if settings["temperature"] == 0 else f"temperature {settings['temperature']}"
    if settings["temperature"] and settings.get("top_p"):
        sampling += f", top-p {settings['top_p']}"
    source = settings["questions"] or settings["dataset"]
    lines = [
        "# hf-treespec bench",
        "",
        f"- target `{settings['model']}` ({settings['model_class']}, {settings['model_dtype']}), "
        f"drafter `{settings['drafter']}` ({settings['drafter_class']})",
        f"- {source}: {settings['num_questions']} questions (first turn, chat template), "
        f"max_new_tokens {settings['max_new_tokens']}, {sampling}",
        f"- threads: {settings['threads']}, median of {settings['repeats']} repeat(s), device {settings['device']} "
        f"({settings['processor']}), torch {settings['torch']}, transformers {settings['transformers']}, "
        f"{settings['date']}",
    ]
    if settings.get("hardware_summary"):
        lines.append(f"- hardware: {settings['hardware_summary']}; dtype {settings.get('dtype')}"
                     + (" (auto: this machine's fast dtype)" if settings.get("dtype_requested") == "auto" else ""))
    if settings["overrides"]:
        lines.append(f"- overrides: {', '.join(f'`{o}`' for o in settings['overrides'])}")
    return "\n".join(lines)


def markdown_report(result: BenchmarkResult, summaries: list[MethodSummary] | None = None) -> str:
    summaries = summaries if summaries is not None else result.summaries()
    greedy = result.settings["temperature"] == 0
    main = [s for s in summaries if s.method not in result.sweep_methods]
    both = any(s.speedup_compiled is not None for s in main)
    second = " vs compiled plain |" if both else ""
    lines = [
        _header(result.settings),
        "",
        f"| method | tokens/s | ms/token | speedup |{second} tau | draft / verify / other | nodes/step | identical | "
        "max top-2 gap |",
        "|---|---:|---:|---:|" + ("---:|" if both else "") + "---:|---|---:|---|---:|",
    ]
    for s in main:
        extra = f" {_fmt(s.speedup_compiled, '.2f', 'x')} |" if both else ""
        lines.append(
            f"| {s.method} | {_fmt(s.tokens_per_s, '.1f')} | {_fmt(s.ms_per_token, '.1f')} | "
            f"{_fmt(s.speedup, '.2f', 'x')} |{extra} {_fmt(s.tau)} | "
            f"{_split(s)} | {_fmt(s.mean_tree_size, '.1f')} | {_identity(s, greedy)} | {_max_gap(s)} |"
        )
    compiled_note = (" vs compiled plain = tokens/s over `plain@compile=true`'s (plain decoding through the same "
                     "compiled target forward; `@compile=true` rows run the target's steps compiled);" if both else "")
    lines += [
        "",
        "tokens/s = new tokens / summed median wall time; ms/token = its inverse; speedup = tokens/s over plain "
        "`generate`'s in this run;"
        f"{compiled_note} "
        "tau = new tokens per target forward (forward hook on the target, prefill = 1 forward; n/a for another "
        "engine, which never runs the target module); time split from "
        "`TreeSpecGenerateOutput` (verify = target forward + verification; n/a for peers); identical = greedy "
        "outputs equal to plain decoding's token for token through the same forward (plain `generate`; for "
        "`@compile=true` rows, `plain@compile=true`, with the count against eager plain `generate` beside it); "
        "max top-2 gap = largest gap between that plain run's two best logits at a divergence (small = a near-tie "
        "decided by rounding).",
    ]
    drafted = [s for s in main if s.drafted_share is not None]
    if any(s.drafted_share < 1 for s in drafted):
        shares = ", ".join(f"{s.method} {100 * s.drafted_share:.0f}%" for s in drafted)
        lines += ["", "Steps that ran a draft tree (the rest were draft-free target steps chosen by "
                      f"`tree_budget='auto'`): {shares}"]
    if result.settings.get("cost_curve"):
        lines += ["", *cost_curve_lines(result.settings["cost_curve"])]
    if result.settings.get("compiled_cost_curve"):
        lines += ["", *cost_curve_lines(result.settings["compiled_cost_curve"], compiled=True)]
    if result.settings.get("compile_seconds"):
        spent = ", ".join(f"{name}: {seconds:.0f} s" for name, seconds in result.settings["compile_seconds"].items())
        lines += ["", f"Compiling the target forward, or loading its compiled packages (before timing): {spent}."]
    if result.settings.get("method_setup"):
        lines += ["", "Set up before timing:"]
        lines += [f"- {name}: {note}" for name, note in result.settings["method_setup"].items()]
    if result.skipped:
        lines += ["", "Skipped (cannot run in this setting):"]
        lines += [f"- {name}: {reason}" for name, reason in result.skipped.items()]
    divergences = [(s.method, d) for s in main for d in s.divergences]
    if divergences:
        lines += [
            "",
            "## Divergences from plain greedy generate",
            "",
            "| method | question | position | plain token | method token | top-2 gap | plain top-1 - method token |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for method, d in divergences:
            lines.append(
                f"| {method} | {d['question_id']} | {d['position']} | {d['plain_token']} | {d['method_token']} | "
                f"{_fmt(d['top2_gap'], '.3f')} | {_fmt(d['chosen_gap'], '.3f')} |"
            )
    if result.sweep is not None:
        key, _ = result.sweep
        lines += [
            "",
            f"## Sweep: {key}",
            "",
            f"| {key} | method | tokens/s | speedup | tau | nodes/step | identical |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for s in sorted((s for s in summaries if s.method in result.sweep_methods),
                        key=lambda s: (s.base_method, _sort_key(s.sweep_value))):
            lines.append(
                f"| {s.sweep_value} | {s.base_method} | {_fmt(s.tokens_per_s, '.1f')} | "
                f"{_fmt(s.speedup, '.2f', 'x')} | {_fmt(s.tau)} | {_fmt(s.mean_tree_size, '.1f')} | "
                f"{_identity(s, greedy)} |"
            )
    return "\n".join(lines) + "\n"


def cost_curve_lines(curve_json: dict, compiled: bool = False) -> list[str]:
    """The target's measured verification cost (ms per forward) and its ratio to a one-token step."""
    from ..cost.curve import CostCurve

    curve = CostCurve.from_json(curve_json)
    ratios = "| x one-token step | " + " | ".join(
        f"{s / curve.seconds[0][0]:.1f}" for s in curve.seconds[0]) + " |"
    title = ("## Compiled target cost curve on this machine (`hf-treespec calibrate --compile`)" if compiled
             else "## Target cost curve on this machine (`hf-treespec calibrate`)")
    return [
        title,
        "",
        f"ms per target forward with n new rows (root included); first ratio row at context {curve.contexts[0]}.",
        "",
        curve.table(),
        ratios,
    ]


def plot_cost_curve(curve, path: Path, title: str = "") -> None:
    """ms per target forward against rows, one line per context length, with the 1-row cost as a dotted floor."""
    fig, ax = _figure(1, 6.0)
    for context, row in zip(curve.contexts, curve.seconds):
        ax.plot(curve.sizes, [1000 * s for s in row], marker="o", label=f"context {context}")
    ax.axhline(1000 * curve.seconds[0][0], linestyle=":", color="grey", label="one-token step")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows verified in one forward (root included)")
    ax.set_ylabel("ms per target forward")
    ax.set_title(title or "target verification cost")
    ax.legend()
    fig.savefig(path, dpi=120)


def plot_cost_curves(curves: dict, path: Path, title: str = "") -> None:
    """ms per target forward against rows at the first context, one line per forward path (eager, compiled)."""
    fig, ax = _figure(1, 6.0)
    for name, curve in curves.items():
        ax.plot(curve.sizes, [1000 * s for s in curve.seconds[0]], marker="o",
                label=f"{name} (context {curve.contexts[0]})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows verified in one forward (root included)")
    ax.set_ylabel("ms per target forward")
    ax.set_title(f"eager vs compiled target cost\n{title}" if title else "eager vs compiled target cost")
    ax.legend()
    fig.savefig(path, dpi=120)


def _sort_key(value: Any) -> tuple:
    return (0, value, "") if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, 0, str(value))


def _figure(ncols: int, width: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(1, ncols)


def plot_methods(summaries: list[MethodSummary], path: Path) -> None:
    """Bars of tokens/s and of speedup over plain generate, one per method."""
    names = [s.method for s in summaries]
    figure, (rate_ax, speed_ax) = _figure(2, max(8.0, 1.1 * len(names) + 3))
    colors = ["#7f7f7f" if not n.startswith("tree:") else "#1f77b4" for n in names]
    rate_ax.bar(names, [s.tokens_per_s for s in summaries], color=colors)
    rate_ax.set_ylabel("tokens / s")
    rate_ax.set_title("throughput")
    speed_ax.bar(names, [s.speedup if s.speedup is not None else 0.0 for s in summaries], color=colors)
    speed_ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    speed_ax.set_ylabel("speedup vs plain generate")
    speed_ax.set_title("speedup")
    for ax in (rate_ax, speed_ax):
        ax.tick_params(axis="x", labelrotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    figure.savefig(path, dpi=120)


def plot_sweep(result: BenchmarkResult, summaries: list[MethodSummary], path: Path) -> None:
    """Cost curve: tokens/s and tau against the swept value, one line per tree method; plain as a reference line."""
    key, values = result.sweep
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    position = {v: (v if numeric else i) for i, v in enumerate(values)}
    figure, (rate_ax, tau_ax) = _figure(2, 10.0)
    variants = [s for s in summaries if s.method in result.sweep_methods]
    for base in dict.fromkeys(s.base_method for s in variants):
        line = sorted((s for s in variants if s.base_method == base), key=lambda s: _sort_key(s.sweep_value))
        xs = [position[s.sweep_value] for s in line]
        rate_ax.plot(xs, [s.tokens_per_s for s in line], marker="o", label=base)
        tau_ax.plot(xs, [s.tau for s in line], marker="o", label=base)
    plain = next((s for s in summaries if s.method == BASELINE), None)
    if plain is not None:
        rate_ax.axhline(plain.tokens_per_s, color="black", linewidth=0.8, linestyle="--", label="plain generate")
    rate_ax.set_ylabel("tokens / s")
    tau_ax.set_ylabel("tau (tokens per target forward)")
    for ax in (rate_ax, tau_ax):
        ax.set_xlabel(key)
        if not numeric:
            ax.set_xticks(list(position.values()), [str(v) for v in values])
        ax.legend(fontsize="small")
    figure.savefig(path, dpi=120)
