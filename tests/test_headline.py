"""The headline table quoted by BENCHMARKS and the shipped drafter's model card is rendered from the committed
``bench`` outputs under docs/results, so the two files can never quote different numbers (README links BENCHMARKS'
copy and summarises the same runs in its own table, which tests/test_doc_numbers.py checks against them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_treespec.benchmark import summary

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "headline"
QUOTING = [ROOT / "BENCHMARKS.md",
           ROOT / "hf_treespec" / "assets_data" / "drafters" / "smollm2-135m-instruct" / "README.md"]


def test_every_file_quotes_the_committed_results():
    block = summary.render(summary.load_runs(RESULTS))
    assert "tree:salf" in block and "assisted_lookup" in block
    assert summary.sync_files(QUOTING, block, write=False) == [], (
        "re-render with: python -m hf_treespec.benchmark.summary docs/results/headline --write BENCHMARKS.md "
        "hf_treespec/assets_data/drafters/smollm2-135m-instruct/README.md")


def _run(methods, temperature=0.0):
    return {"settings": {"hardware_summary": "CPU X (avx2; 2 threads)", "dtype": "float32", "temperature": temperature,
                         "num_questions": 3, "max_new_tokens": 8, "date": "2026-01-02 03:04:05", "commit": "abc1234",
                         "torch": "2", "transformers": "5", "command": "hf-treespec bench --quick", "repeats": 3},
            "methods": [{"method": name, "tokens_per_s": 10.0 * speed, "speedup": speed, "tau": tau,
                         "identical": 3, "compared": 3 if temperature == 0 else None} for name, speed, tau in methods]}


def test_render_picks_plain_the_tree_and_the_best_peer():
    run = _run([("plain", 1.0, 1.0), ("assisted_lookup", 1.1, 1.3), ("assisted_drafter", 0.9, 1.8),
                ("tree:salf", 1.4, 2.2)])
    block = summary.render([run])
    assert "tree:salf: **1.40x** (tau 2.20)" in block
    assert "assisted_lookup: **1.10x**" in block and "assisted_drafter" not in block
    assert "| 10.0 |" in block and "3/3" in block and "abc1234" in block and "hf-treespec bench --quick" in block
    assert "n/a (sampled)" in summary.render([_run([("plain", 1, 1), ("tree:salf", 1.1, 1.5)], temperature=1.0)])


def test_the_engine_peer_has_its_column_and_single_repeats_are_refused():
    run = _run([("plain", 1.0, 1.0), ("openvino", 2.5, 1.0), ("tree:salf", 1.4, 2.2)])
    run["methods"][1]["tau"] = float("nan")  # another engine: no target forwards to count
    assert "| openvino: **2.50x** |" in summary.render([run])
    run["settings"]["repeats"] = 1
    with pytest.raises(ValueError, match="median of 1 repeat.*at least 3"):
        summary.render([run])


def test_a_run_without_plain_or_tree_is_refused():
    with pytest.raises(ValueError, match="no plain and tree"):
        summary.headline(_run([("plain", 1.0, 1.0), ("assisted_lookup", 1.1, 1.3)]))


def test_markers_must_appear_once(tmp_path):
    good = tmp_path / "a.md"
    good.write_text(f"x\n{summary.BEGIN}\nold\n{summary.END}\ny\n")
    assert summary.sync_files([good], f"{summary.BEGIN}\nnew\n{summary.END}", write=True) == [str(good)]
    assert good.read_text() == f"x\n{summary.BEGIN}\nnew\n{summary.END}\ny\n"
    assert summary.sync_files([good], f"{summary.BEGIN}\nnew\n{summary.END}", write=False) == []
    bad = tmp_path / "b.md"
    bad.write_text(f"{summary.BEGIN}\n{summary.END}\n{summary.BEGIN}\n{summary.END}\n")
    with pytest.raises(ValueError, match="exactly one"):
        summary.sync_files([bad], "x", write=False)


def test_corrupt_or_missing_results_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*/summary.json"):
        summary.load_runs(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps(_run([("plain", 1, 1)]))[:40])
    with pytest.raises(ValueError, match="run/summary.json is not valid JSON"):
        summary.load_runs(tmp_path)
