"""examples/plot_reached_depth.py: conditional acceptance from the reached-depth shares, and its table."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "plot_reached_depth.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("plot_reached_depth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_rows_and_table(script):
    summary = {"settings": {"temperature": 0.6}, "methods": [
        {"method": "plain", "tau": 1.0, "mean_tree_size": None, "reached_depth": None},
        {"method": "tree:iid@verifier=nss", "tau": 1.5, "mean_tree_size": 16.0, "reached_depth": [0.5, 0.2, 0.0]}]}
    (row,) = script.depth_rows(summary)
    assert row["method"] == "verifier=nss" and row["conditional"] == pytest.approx([0.5, 0.4, 0.0])
    text = script.table({"T=0.6": summary}, depths=4)
    assert "| T=0.6 | verifier=nss | 1.50 | 0.500 | 0.200 | 0.000 |  | 0.500 | 0.400 | 0.000 |  |" in text
