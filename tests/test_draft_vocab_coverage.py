"""examples/draft_vocab_coverage.py: share of regenerated answer tokens inside a drafter's / a top-K draft vocabulary."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_treespec.trainers.data.chunks import write_chunk
from hf_treespec.trainers.data.regenerate import CONFIG_FILE, chunk_path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "draft_vocab_coverage.py"


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location("draft_vocab_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _answers(folder: Path) -> None:
    folder.mkdir()
    (folder / CONFIG_FILE).write_text("{}")  # what marks a `train regenerate` folder
    records = [{"temperature": 0.0, "output_ids": [1, 2, 3, 4]}, {"temperature": 0.8, "output_ids": [5, 6]},
               {"temperature": 0.0, "output_ids": [1, 1, 9, 9]}, {"temperature": 0.8, "output_ids": [1, 7]}]
    write_chunk(chunk_path(folder, 0), records, 0, 2)


def test_coverage_per_temperature_and_drafter(coverage, tmp_path, monkeypatch, capsys):
    _answers(tmp_path / "regen")
    ids = coverage.answer_ids(str(tmp_path / "regen"), skip=2)  # the first prompt's two answers skipped
    assert {t: v.tolist() for t, v in ids.items()} == {0.0: [1, 1, 9, 9], 0.8: [1, 7]}
    (tmp_path / "drafter").mkdir()
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[[1, 7]] = True
    save_file({"t2d": t2d, "d2t": torch.tensor([1, 6])}, str(tmp_path / "drafter" / "model.safetensors"))
    monkeypatch.setattr(sys, "argv", ["x", "--answers", str(tmp_path / "regen"), "--skip", "2",
                                      "--drafter", str(tmp_path / "drafter")])
    assert coverage.main() == 0
    assert "| 50.0% | 100.0% |" in capsys.readouterr().out  # T 0: two of 1, 1, 9, 9; T 0.8: both of 1, 7


def test_bad_inputs_name_what_is_wrong(coverage, tmp_path):
    _answers(tmp_path / "regen")
    with pytest.raises(SystemExit, match="no answers after the first 9"):
        coverage.answer_ids(str(tmp_path / "regen"), skip=9)
    with pytest.raises(SystemExit, match="model.safetensors not found"):
        coverage.drafter_mask(str(tmp_path))
