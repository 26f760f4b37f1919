"""examples/plot_learning_curve.py: points from training summaries + evaluations, series, and the per-10x fit."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "plot_learning_curve.py"


@pytest.fixture(scope="module")
def curve():
    spec = importlib.util.spec_from_file_location("plot_learning_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _drafter(root: Path, name: str, tokens: int, seconds: float) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "training_summary.json").write_text(json.dumps({"tokens": tokens, "seconds": seconds}))
    return folder


def test_series_tokens_time_and_fit(curve, tmp_path):
    small, big = _drafter(tmp_path, "a", 1_000, 10.0), _drafter(tmp_path, "b", 10_000, 30.0)
    warm = _drafter(tmp_path, "warm", 1_000, 5.0)
    other = _drafter(tmp_path, "c", 1_000, 7.0)
    acceptance = {str(small.resolve()): {"top1_d1": 0.1, "tau_chain": 1.1},
                  str(big.resolve()): {"top1_d1": 0.3, "tau_chain": 1.4}}
    salf = {str(small.resolve()): 1.2, str(big.resolve()): 1.7, str(other.resolve()): 1.5}
    points = curve.collect([f"orig::{big}", f"orig::{small}+{warm}", f"regen::{other}"], acceptance, salf, {}, {})
    assert [(p.series, Path(p.drafter).name, p.tokens) for p in points] == [
        ("orig", "a", 1_000), ("orig", "b", 10_000), ("regen", "c", 1_000)]
    assert points[0].seconds == 15.0  # the warm-up's time counts, its tokens do not
    assert points[2].chain_tau is None and points[2].salf_tau == 1.5
    fits = curve.fits(points)
    assert any(line.startswith("orig: SALF tau +0.500 per 10x") for line in fits)
    assert any(line.startswith("orig: chain tau +0.300 per 10x") for line in fits)
    assert not any(line.startswith("regen:") for line in fits)  # one point: no line
    table = curve.table(points)
    assert "| orig | a | 1,000 | 15 | 0.100 | 1.100 | 1.200 |" in table
    out = tmp_path / "curve.png"
    curve.plot(points, str(out), "t")
    assert out.stat().st_size > 0
    references = curve.levels(["goal=3.0", "perfect drafter, x=y=4.2"])
    assert references == {"goal": 3.0, "perfect drafter, x=y": 4.2}  # the label may hold '=' and ','
    curve.plot(points, str(out), "t", references)
    for bad in ("goal", "goal=x", "=3"):
        with pytest.raises(SystemExit, match="LABEL=TAU"):
            curve.levels([bad])


def test_missing_token_count_names_the_folder(curve, tmp_path):
    bare = tmp_path / "shipped"
    bare.mkdir()
    with pytest.raises(SystemExit, match="shipped.*--tokens"):
        curve.collect([str(bare)], {}, {}, {}, {})
    point, = curve.collect([str(bare)], {}, {}, {str(bare.resolve()): 5e5}, {})
    assert point.tokens == 500_000 and point.seconds is None


def test_relative_drafters_resolve_where_their_run_started(curve, tmp_path, monkeypatch):
    """Each run wrote drafter folders relative to its own working folder; the plot runs from yet another one."""
    run_a, run_b = tmp_path / "s1", tmp_path / "s2"
    run_a.mkdir(), run_b.mkdir()
    mine, theirs = _drafter(run_a, "talf", 100, 1.0), _drafter(run_b, "talf", 200, 2.0)
    (run_b / "bench").mkdir()
    summary = {"settings": {"drafter": "default", "method_drafters": {"tree:salf@drafter=talf": "talf",
                                                                     "tree:salf@drafter=../s1/talf": "../s1/talf"}},
               "methods": [{"method": "tree:salf@drafter=talf", "base_method": "tree:salf", "tau": 2.5},
                           {"method": "tree:salf@drafter=../s1/talf", "base_method": "tree:salf", "tau": 2.0}]}
    monkeypatch.chdir(tmp_path)
    taus = curve._salf_taus(summary, run_b)
    assert taus == {str(theirs.resolve()): 2.5, str(mine.resolve()): 2.0}
    assert curve._resolve("s1/talf", tmp_path / "elsewhere") == str(mine.resolve())  # not there: the current folder
