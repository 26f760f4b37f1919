"""Training across processes: ``hf-treespec train talf`` / ``gto`` under ``accelerate launch`` (two processes, DDP
over gloo on the CPU) train the same drafter as one process on the same global batch, save it once, and resume from
their own checkpoints.

The launched command is the one docs/training.md documents: ``accelerate launch --multi_gpu --num_processes 2 -m
hf_treespec.cli train ... --use_cpu`` (``--cpu`` alone starts a single process unless MPI is set up).
"""

from __future__ import annotations

import json
import os
import random
import socket
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version

pytest.importorskip("accelerate", reason="multi-process training launches with accelerate (the `train` extra)")

from conftest import char_tokenizer, train_cli  # noqa: E402
from test_trainers import CHARS, tiny_target  # noqa: E402

from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel, build_draft_vocab  # noqa: E402
from hf_treespec.trainers import PrepareConfig, load_prepared, prepare_dataset  # noqa: E402

# Measured on this tiny setup (fp32): two processes' losses and gradient norms differ from one process's by at most
# 2e-7 relative for TALF and 2e-6 for GTO (its second step), the saved weights by at most 5e-7 absolute (weights ~1):
# round-off from per-process partial sums, gradients averaged by all-reduce, batches of 2 padded differently from
# batches of 4. The bounds leave 50x or more for other CPUs' kernels; what they guard against (rows not sharded or
# seen twice, per-process loss or window normalisation, metrics of one process only, differently initialised
# drafters) moves the losses or gradient norms by 1e-2 or more.
RTOL = 1e-4
ATOL_WEIGHTS = 1e-5


def conversations(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns.append({"from": "human", "value": "".join(rng.choice(string.ascii_lowercase)
                                                            for _ in range(rng.randint(3, 6)))})
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
            turns.append({"from": "gpt", "value": (word * 8)[: rng.randint(12, 20)]})
        records.append({"id": f"c{i}", "conversations": turns})
    return records


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny target (saved with its tokenizer), 8 prepared conversations with TALF trees, and a drafter to start
    GTO from. 8 rows = 2 global batches of 4: with a last partial batch, accelerate would pad each process's shard
    by repeating rows (``even_batches``) and the runs would no longer see the same data."""
    root = tmp_path_factory.mktemp("distributed")
    target = tiny_target()
    tokenizer = char_tokenizer(CHARS, chat=True)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    prepare = PrepareConfig(chunk_size=8, storage_dtype="float32", tree_policy="eagle2", tree_positions=3,
                            tree_params={"tree_topk": 4, "tree_depth": 3, "tree_budget": 60})
    prepare_dataset(target, tokenizer, conversations(8), root / "data", prepare, progress=False)
    data = load_prepared(root / "data")
    assert len(data.dataset) == 8
    torch.manual_seed(1)
    drafter = TreeSpecDrafterModel(TreeSpecDrafterConfig.for_target(
        target.config, draft_vocab_size=32, share_target_embeddings=True, share_target_lm_head=True))
    drafter.set_draft_vocab(build_draft_vocab(data.token_counts, 32)[0])
    drafter.tie_to_target(target).save_pretrained(root / "init")
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(workspace: Path, *argv: str) -> dict:
    """``accelerate launch`` (2 CPU processes) of ``hf-treespec train <argv>``; returns the JSON summary, which only
    the main process prints."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()),
               "-m", "hf_treespec.cli", "train", *argv, "--target", str(workspace / "target"), "--use_cpu",
               "--threads", "1", "--no-progress"]
    # no accelerate config file of the machine's user (HF_HOME), nothing from the network
    env = {**os.environ, "HF_HOME": str(workspace / "hf_home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"')]
    assert len(summaries) == 1, done.stdout  # printed once, by the main process
    return summaries[0]


def loss_curve(logs: list[dict]) -> dict[int, dict[str, float]]:
    """step -> the logged training values (loss, gradient norm, the trainer's metrics)."""
    return {log["step"]: {k: v for k, v in log.items() if k not in ("step", "epoch", "learning_rate")}
            for log in logs if "loss" in log}


def assert_same_curve(single: dict[int, dict[str, float]], ddp: dict[int, dict[str, float]]) -> None:
    assert sorted(single) == sorted(ddp) and single
    for step in single:
        assert sorted(single[step]) == sorted(ddp[step]), step  # every metric reduced over processes, none lost
        for key, value in single[step].items():
            # metrics are logged rounded to 4 decimals: compare those at their own precision
            tol = RTOL * abs(value) + (1e-4 if key not in ("loss", "grad_norm") else 0.0)
            assert abs(ddp[step][key] - value) <= tol, (step, key, value, ddp[step][key])


def assert_same_weights(first: Path, second: Path) -> None:
    a = TreeSpecDrafterModel.from_pretrained(first).state_dict()
    b = TreeSpecDrafterModel.from_pretrained(second).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(b[key], a[key], rtol=RTOL, atol=ATOL_WEIGHTS, msg=key)
        else:
            assert torch.equal(a[key], b[key]), key


# transformers 5.6's Trainer restores a resumed run's optimizer state onto "cpu:0", which torch cannot load in a
# multi-process CPU (gloo) run; 5.24 resumes (releases in between, and GPUs, not tried).
CPU_DDP_RESUMES = version.parse(transformers.__version__) >= version.parse("5.24")


@pytest.mark.slow  # two launched processes each: ~20-35 s apiece on 2 cores
def test_talf_under_accelerate_matches_one_process_and_resumes(workspace, tmp_path, capsys):
    run = train_cli(workspace / "target", capsys)
    # a constant learning rate: the interrupted run's schedule (--max-steps 2) is the full run's
    common = ["--data", str(workspace / "data"), "--precision", "fp32", "--draft-vocab-size", "32", "--seed", "0",
              "--lr", "1e-3", "--scheduler", "constant", "--warmup", "0", "--logging-steps", "1",
              "--save-strategy", "steps", "--save-steps", "2", "--threads", "1"]
    single_dir, ddp_dir = tmp_path / "single", tmp_path / "ddp"
    run("talf", *common, "--max-steps", "4", "--batch-size", "4", "--output-dir", str(single_dir))

    # two processes x 2 rows = the same global batch; stopped after 2 steps, then resumed from the checkpoint
    first = launch(workspace, "talf", *common, "--max-steps", "2", "--batch-size", "2", "--output-dir", str(ddp_dir))
    assert first["steps"] == 2 and (ddp_dir / "checkpoint-2").is_dir()
    checkpoint = sorted(p.name for p in (ddp_dir / "checkpoint-2").iterdir())
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "trainer_state.json"} <= set(checkpoint)
    if CPU_DDP_RESUMES:
        resumed = launch(workspace, "talf", *common, "--max-steps", "4", "--batch-size", "2", "--output-dir",
                         str(ddp_dir), "--resume")
    else:  # the whole run again, without the resume this transformers release cannot do on a multi-process CPU run
        shutil.rmtree(ddp_dir)
        resumed = launch(workspace, "talf", *common, "--max-steps", "4", "--batch-size", "2", "--output-dir",
                         str(ddp_dir))
    assert resumed["steps"] == 4

    # one drafter folder, written once (no per-process copies or leftovers), next to the checkpoints
    assert sorted(p.name for p in ddp_dir.iterdir()) == sorted(
        p.name for p in single_dir.iterdir()) == ["checkpoint-2", "checkpoint-4", "config.json", "model.safetensors",
                                                  "training_args.bin", "training_summary.json"]
    assert json.loads((ddp_dir / "training_summary.json").read_text()) == resumed
    # the resumed run continues the same curve: steps 1-2 from the first launch, 3-4 after resuming
    state = json.loads((ddp_dir / "checkpoint-4" / "trainer_state.json").read_text())
    single_state = json.loads((single_dir / "checkpoint-4" / "trainer_state.json").read_text())
    ddp_curve, single_curve = loss_curve(state["log_history"]), loss_curve(single_state["log_history"])
    assert sorted(ddp_curve) == [1, 2, 3, 4] and "ce_d3" in ddp_curve[1]
    assert_same_curve(single_curve, ddp_curve)
    assert_same_weights(single_dir, ddp_dir)


@pytest.mark.slow  # two launched processes each: ~20-35 s apiece on 2 cores
def test_a_time_budget_stops_every_process_after_the_same_step(workspace, tmp_path):
    """``--max-train-seconds`` under two processes: both read the slower clock, so they stop after the same step
    (a process stopping alone would leave the other waiting in the gradient all-reduce) and save one drafter."""
    out = tmp_path / "ddp"
    summary = launch(workspace, "talf", "--data", str(workspace / "data"), "--precision", "fp32",
                     "--draft-vocab-size", "32", "--epochs", "500", "--batch-size", "2", "--max-train-seconds", "2",
                     "--save-strategy", "no", "--logging-steps", "1", "--output-dir", str(out))
    assert 1 <= summary["steps"] < 500 * 2  # the budget, not the epochs, ended the run
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow  # two launched processes each: ~20-35 s apiece on 2 cores
def test_gto_under_accelerate_matches_one_process(workspace, tmp_path, capsys):
    run = train_cli(workspace / "target", capsys)
    # small trees; without debiasing the GTO term has a gradient from the first step (the reference's trees equal
    # the drafter's there), so the windows' normalisation across processes shows in the gradient norm
    common = ["gto", "--data", str(workspace / "data"), "--init", str(workspace / "init"), "--seed", "0",
              "--max-steps", "2", "--lr", "1e-3", "--warmup", "0", "--logging-steps", "1", "--save-strategy", "no",
              "--num-groups", "2", "--group-size", "2", "--tree-topk", "2", "--tree-budget", "6", "--tree-depth", "3",
              "--debias", "false", "--omega", "4", "--threads", "1"]
    single = run(*common, "--batch-size", "4", "--output-dir", str(tmp_path / "single"))
    ddp = launch(workspace, *common, "--batch-size", "2", "--output-dir", str(tmp_path / "ddp"))
    assert single["steps"] == ddp["steps"] == 2
    assert_same_curve(loss_curve([single["first_log"], single["last_log"]]),
                      loss_curve([ddp["first_log"], ddp["last_log"]]))
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == ["config.json", "model.safetensors",
                                                                     "training_args.bin", "training_summary.json"]
    assert_same_weights(tmp_path / "single", tmp_path / "ddp")


def test_processes_that_would_train_alone_are_refused(monkeypatch):
    """Several launched processes whose Trainers are not distributed (no GPU and no --use_cpu) would each train and
    save a drafter of their own: refused with the fix; ``accelerate launch --cpu`` starting one process warns."""
    from types import SimpleNamespace

    from hf_treespec.trainers.objectives.trainer import check_launch

    for key in ("WORLD_SIZE", "ACCELERATE_USE_CPU", "MASTER_ADDR", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    check_launch(SimpleNamespace(world_size=1))  # a plain single-process run
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch(SimpleNamespace(world_size=2))
    with pytest.raises(ValueError, match=r"one of 2 \(WORLD_SIZE=2\).*pass --use_cpu"):
        check_launch(SimpleNamespace(world_size=1))
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.warns(UserWarning, match="--multi_gpu --num_processes N"):
        check_launch(SimpleNamespace(world_size=1))
