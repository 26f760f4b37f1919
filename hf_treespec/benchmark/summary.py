"""The headline table that BENCHMARKS and the shipped drafter's model card quote (README summarises the same runs),
rendered from committed ``hf-treespec bench`` outputs, so every copy of a headline number comes from one ``summary.json``.

``python -m hf_treespec.benchmark.summary docs/results/headline --write BENCHMARKS.md <card>`` re-renders the table
between the ``<!-- headline:begin -->`` / ``<!-- headline:end -->`` markers of each file; ``--check`` only reports the
files whose table differs (the test suite runs the check on the committed files). A headline run is a median of at
least `MIN_REPEATS` timed repeats: one repeat on a shared 2-core machine has measured the same configuration 1.5x
apart on one day.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .report import SUMMARY_FILE
from .results import COMPILED_BASELINE, identity_text

BEGIN = "<!-- headline:begin -->"
END = "<!-- headline:end -->"
PEER_PREFIX = "assisted_"
TREE_PREFIX = "tree:"
#: the other engine a user would pick instead (its row when the run has one)
ENGINE = "openvino"
MIN_REPEATS = 3


def load_runs(root: str | Path) -> list[dict[str, Any]]:
    """Every ``summary.json`` one level under ``root`` (one folder per run), ordered by folder name."""
    files = sorted(Path(root).glob(f"*/{SUMMARY_FILE}"))
    if not files:
        raise FileNotFoundError(f"no */{SUMMARY_FILE} under {root}: run `hf-treespec bench --out {root}/<name>` first.")
    runs = []
    for path in files:
        try:
            runs.append(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}); re-run the benchmark that wrote it.") from None
    return runs


def headline(run: dict[str, Any]) -> dict[str, Any]:
    """One run's row: plain tokens/s (eager, and through the compiled target where the run has it), its fastest tree
    method and transformers' best assisted method."""
    settings, methods = run["settings"], {m["method"]: m for m in run["methods"]}
    trees = [m for name, m in methods.items() if name.startswith(TREE_PREFIX)]
    tree = max(trees, key=lambda m: m["speedup"] or 0.0) if trees else None
    peers = [m for name, m in methods.items() if name.startswith(PEER_PREFIX)]
    if "plain" not in methods or tree is None:
        raise ValueError(f"run of {settings.get('date')} has no plain and tree:<policy> rows: not a headline run.")
    repeats = int(settings.get("repeats") or 1)
    if repeats < MIN_REPEATS:
        raise ValueError(f"run of {settings.get('date')} is a median of {repeats} repeat(s); the headline quotes "
                         f"medians of at least {MIN_REPEATS} (re-run it with --repeats {MIN_REPEATS}).")
    compiled = methods.get(COMPILED_BASELINE)
    return {
        "hardware": settings.get("hardware_summary", ""),
        "dtype": settings["dtype"],
        "decoding": "greedy" if float(settings["temperature"]) == 0 else f"T={settings['temperature']:g}",
        "prompts": f"{settings['num_questions']} x {settings['max_new_tokens']}",
        "plain": methods["plain"]["tokens_per_s"],
        "compiled_plain": compiled["tokens_per_s"] if compiled else None,
        "tree": tree,
        "peer": max(peers, key=lambda m: m["speedup"] or 0.0) if peers else None,
        "engine": methods.get(ENGINE),
        "repeats": repeats,
        "date": str(settings.get("date", ""))[:10],
        "commit": settings.get("commit") or "n/a",
        "versions": f"torch {settings.get('torch', '?')}, transformers {settings.get('transformers', '?')}",
        "command": settings.get("command") or "n/a",
    }


def _cell(method: dict[str, Any] | None) -> str:
    if method is None:
        return "n/a"
    versus = method.get("speedup_compiled")
    compiled = f", {versus:.2f}x compiled plain" if versus is not None and method["method"] != COMPILED_BASELINE else ""
    tau = method.get("tau")
    tau = f" (tau {tau:.2f})" if tau is not None and tau == tau else ""  # another engine's tau is n/a (NaN)
    return f"{method['method']}: **{method['speedup']:.2f}x**{compiled}{tau}"


def _identical(method: dict[str, Any]) -> str:
    if not method.get("compared"):
        return "n/a (sampled)"
    return identity_text(method["identical"], method["compared"], method.get("identical_eager"))


def render(runs: list[dict[str, Any]]) -> str:
    """The markdown table (between the markers), one row per run, then each run's command."""
    rows = [headline(run) for run in runs]
    lines = [
        BEGIN,
        "| machine | dtype | decoding | prompts x new tokens, repeats | plain tokens/s (eager, compiled) "
        "| fastest tree (speedup, tau) | transformers' best assisted (speedup, tau) | OpenVINO GenAI (speedup) "
        "| greedy rows identical | date, commit |",
        "|---|---|---|---|---:|---|---|---|---|---|",
    ]
    for row in rows:
        compiled = f", {row['compiled_plain']:.1f}" if row["compiled_plain"] is not None else ""
        lines.append(f"| {row['hardware']} | {row['dtype']} | {row['decoding']} | {row['prompts']}, "
                     f"{row['repeats']} | {row['plain']:.1f}{compiled} | {_cell(row['tree'])} | {_cell(row['peer'])} "
                     f"| {_cell(row['engine'])} | {_identical(row['tree'])} | {row['date']}, {row['commit']} |")
    lines.append("")
    lines.append("Commands (" + "; ".join(sorted({r["versions"] for r in rows})) + "):")
    lines.append("")
    lines.append("```bash")
    lines.extend(row["command"] for row in rows)
    lines.append("```")
    lines.append(END)
    return "\n".join(lines)


def replace_block(text: str, block: str, name: str) -> str:
    """``text`` with its marked block replaced by ``block``; a file without exactly one marked block is refused."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{name} must hold exactly one {BEGIN} ... {END} block.")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def sync_files(files: Sequence[str | Path], block: str, write: bool) -> list[str]:
    """The files whose marked block differs from ``block`` (rewritten when ``write``)."""
    stale = []
    for path in map(Path, files):
        text = path.read_text(encoding="utf-8")
        updated = replace_block(text, block, str(path))
        if updated != text:
            stale.append(str(path))
            if write:
                path.write_text(updated, encoding="utf-8")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_treespec.benchmark.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="folder holding one bench output folder per headline run")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", nargs="+", metavar="FILE", help="re-render the marked table in these files")
    action.add_argument("--check", nargs="+", metavar="FILE", help="exit 1 if a file's marked table is stale")
    args = parser.parse_args(argv)
    block = render(load_runs(args.results))
    stale = sync_files(args.write or args.check, block, write=bool(args.write))
    for path in stale:
        print(f"{'rewrote' if args.write else 'stale'}: {path}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
