"""``train regenerate``: the target's own answers in resumable, validated chunks, consumed by ``train prepare``."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import train_cli

from hf_treespec.trainers import load_prepared, prepare_dataset
from hf_treespec.trainers.data.prepared import PrepareConfig
from hf_treespec.trainers.data.regenerate import (
    CONFIG_FILE,
    CorruptChunkError,
    RegenerateConfig,
    first_turn_prompts,
    iter_regenerated,
    read_chunk,
    regenerate,
)

from test_trainers import conversations, target, tokenizer  # noqa: F401  (module fixtures)

torch.set_num_threads(1)

CONFIG = dict(temperatures=[0.0, 0.8], max_new_tokens=6, chunk_size=3, batch_size=2)


def _prompts(tokenizer, count=7, limit=64):  # noqa: F811
    return list(first_turn_prompts(tokenizer, conversations(count, seed=3), limit))


def _stamps(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("chunk-*.jsonl")}


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, *args):
        self.calls += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_prompts_are_first_user_turns_with_the_generation_header(tokenizer):  # noqa: F811
    records = conversations(4, seed=3) + [{"id": "no-user", "conversations": [{"from": "gpt", "value": "xyz"}]}]
    prompts = list(first_turn_prompts(tokenizer, records, 64))
    assert [p.source_index for p in prompts] == [0, 1, 2, 3]  # the record without a user turn is skipped
    first = records[0]["conversations"][0]["value"]
    assert tokenizer.decode(prompts[0].ids) == f"U+{first}/A+"
    assert prompts[0].messages == [{"role": "user", "content": first}]
    short = list(first_turn_prompts(tokenizer, records, len(prompts[0].ids) - 1))
    assert all(len(p.ids) < len(prompts[0].ids) for p in short)  # longer prompts are skipped, never cut


def test_regenerate_writes_resumable_chunks_and_skips_finished_ones(target, tokenizer, tmp_path):  # noqa: F811
    prompts = _prompts(tokenizer)
    config = RegenerateConfig(**CONFIG)
    stats = regenerate(target, tokenizer, prompts, tmp_path, config, num_prompts=5, progress=False)
    assert (stats.written, stats.skipped, stats.answers) == (2, 0, 10) and stats.tokens == 60
    assert stats.next_skip == prompts[4].source_index + 1
    assert sorted(_stamps(tmp_path)) == ["chunk-00000.jsonl", "chunk-00001.jsonl"]
    records = list(iter_regenerated(tmp_path))
    assert [(r["source_index"], r["temperature"]) for r in records] == [
        (p.source_index, t) for p in prompts[:5] for t in (0.0, 0.8)]
    for record, prompt in zip(records[::2], prompts):  # greedy answers: batched left-padded == one prompt alone
        ids = torch.tensor([prompt.ids])  # explicit mask: the pad id 0 is also a real character here
        alone = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
        assert record["prompt_ids"] == prompt.ids and record["output_ids"] == alone[0, len(prompt.ids):].tolist()
        assert record["finish_reason"] == "length" and record["id"].endswith(":greedy")
    assert not list(tmp_path.glob(".*.tmp"))

    # rerun with more prompts: chunk 0 is skipped untouched, the short chunk 1 is redone, chunk 2 is new
    stamps = _stamps(tmp_path)
    with ForwardCounter(target) as counter:
        stats = regenerate(target, tokenizer, prompts, tmp_path, config, num_prompts=7, progress=False)
    assert (stats.written, stats.skipped, stats.redone) == (2, 1, [])
    assert _stamps(tmp_path)["chunk-00000.jsonl"] == stamps["chunk-00000.jsonl"]
    assert counter.calls > 0 and len(list(iter_regenerated(tmp_path))) == 14
    # nothing left to do: no target forward at all
    with ForwardCounter(target) as counter:
        stats = regenerate(target, tokenizer, prompts, tmp_path, config, num_prompts=7, progress=False)
    assert counter.calls == 0 and (stats.written, stats.skipped) == (0, 3)
    with pytest.raises(ValueError, match="different settings"):
        regenerate(target, tokenizer, prompts, tmp_path, RegenerateConfig(**{**CONFIG, "max_new_tokens": 7}),
                   progress=False)
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["temperatures"] == [0.0, 0.8]


def test_truncated_chunk_is_named_and_redone_on_resume(target, tokenizer, tmp_path):  # noqa: F811
    prompts = _prompts(tokenizer)
    config = RegenerateConfig(**CONFIG)
    regenerate(target, tokenizer, prompts, tmp_path, config, progress=False)
    bad = tmp_path / "chunk-00001.jsonl"
    original = bad.read_bytes()
    bad.write_bytes(original[: len(original) // 2])  # e.g. a full disk or an interrupted copy
    with pytest.raises(CorruptChunkError, match="chunk-00001.jsonl is truncated"):
        list(iter_regenerated(tmp_path))
    bad.write_bytes(original.rsplit(b"\n", 2)[0] + b"\n")  # cut at a line boundary: only the footer is gone
    with pytest.raises(CorruptChunkError, match="chunk-00001.jsonl.*footer"):
        read_chunk(bad)
    others = {k: v for k, v in _stamps(tmp_path).items() if k != bad.name}
    stats = regenerate(target, tokenizer, prompts, tmp_path, config, progress=False)
    assert stats.redone == ["chunk-00001.jsonl"] and (stats.written, stats.skipped) == (1, 2)
    assert bad.read_bytes() == original  # reseeded per chunk: the redo samples exactly what was lost
    assert (tmp_path / "chunk-00001.jsonl.corrupt").is_file()  # the bad file is kept, never silently deleted
    assert {k: v for k, v in _stamps(tmp_path).items() if k != bad.name} == others
    assert len(list(iter_regenerated(tmp_path))) == 14


def test_eos_ends_answers_and_prepare_scores_them(target, tokenizer, tmp_path):  # noqa: F811
    prompts = _prompts(tokenizer, count=4)
    ids = torch.tensor([prompts[0].ids])
    greedy = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    eos = int(greedy[0, len(prompts[0].ids) + 2])
    stopping = copy.deepcopy(target)
    stopping.generation_config.eos_token_id = eos
    regenerate(stopping, tokenizer, prompts, tmp_path / "regen", RegenerateConfig(**CONFIG), progress=False)
    records = list(iter_regenerated(tmp_path / "regen"))
    first = records[0]["output_ids"]
    assert records[0]["finish_reason"] == "eos" and first[-1] == eos and eos not in first[:-1] and len(first) <= 3
    for record in records:  # nothing after the first EOS (the padding of finished rows is dropped)
        assert eos not in record["output_ids"][:-1]
        assert (record["finish_reason"] == "eos") == (record["output_ids"][-1:] == [eos])

    prepare_dataset(target, tokenizer, iter_regenerated(tmp_path / "regen"), tmp_path / "data",
                    PrepareConfig(chunk_size=4, storage_dtype="float32"), progress=False)
    data = load_prepared(tmp_path / "data")
    assert len(data.dataset) == len(records)
    for row, record in zip(data.dataset, records):  # the target's exact ids; only its answer is scored
        assert row["id"] == record["id"]
        assert row["input_ids"] == record["prompt_ids"] + record["output_ids"]
        assert row["loss_mask"] == [0] * len(record["prompt_ids"]) + [1] * len(record["output_ids"])


def test_cli_regenerate_then_prepare(target, tokenizer, tmp_path, capsys):  # noqa: F811


    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    run = train_cli(tmp_path / "target", capsys)

    regen = ["regenerate", "--num-prompts", "3", "--max-prompt-tokens", "300", "--max-new-tokens", "4",
             "--batch-size", "2", "--chunk-size", "2", "--output", str(tmp_path / "regen")]
    summary = run(*regen)  # real ShareGPT train prompts, through the tiny character tokenizer
    from hf_treespec.cost.hardware import resolve_dtype_name

    settings = json.loads((tmp_path / "regen" / "regenerate_config.json").read_text())
    assert settings["dtype"] == summary["dtype"] == resolve_dtype_name("auto")  # --dtype auto, recorded as resolved
    assert summary["answers"] == 6 and summary["new_tokens"] == 24 and summary["chunks_written"] == 2
    assert summary["tokens_per_s"] == pytest.approx(summary["new_tokens"] / summary["generate_seconds"], rel=0.05)
    again = run(*regen)
    assert again["chunks_skipped"] == 2 and again["next_skip"] == summary["next_skip"]
    # next_skip counts records of the split, unusable ones included: a run from there starts right after this one
    used = [r["source_index"] for r in iter_regenerated(tmp_path / "regen")]
    assert max(used) + 1 == summary["next_skip"]
    more = run(*regen[:-1], str(tmp_path / "regen-more"), "--skip", str(summary["next_skip"]), "--num-prompts", "1")
    assert min(r["source_index"] for r in iter_regenerated(tmp_path / "regen-more")) >= summary["next_skip"]
    assert more["next_skip"] > summary["next_skip"]
    prepared = run("prepare", "--data-file", str(tmp_path / "regen"), "--dtype", "fp32", "--tree-policy", "none",
                   "--num-conversations", "0", "--output", str(tmp_path / "data"))
    assert prepared["conversations"] == 6
    with pytest.raises(ValueError, match="reserved|invalid choice"):
        RegenerateConfig(split="reserved")
