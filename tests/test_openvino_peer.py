"""OpenVINO GenAI's LLMPipeline as the bench's ``openvino`` peer: registered, refused clearly without the
``[openvino]`` extra, wired into the runner and report; and (slow: it needs optimum-intel's exporter environment) a
tiny random Llama exported and run through the pipeline giving plain greedy ``generate``'s tokens."""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import pytest
import torch

import hf_treespec
from hf_treespec.benchmark import BenchmarkConfig, available_methods, build_method, run_benchmark, write_report
from hf_treespec.assets import load_questions
from hf_treespec.benchmark import openvino as ov_peer
from hf_treespec.benchmark.loading import build_prompt
from hf_treespec.benchmark.methods import METHODS, PEER_ORDER
from hf_treespec.cli import QUICK_OPENVINO, QUICK_PRESET, main, quick_preset

from conftest import VOCAB, char_tokenizer, tiny_llama

CHARS = (string.ascii_letters + string.digits + "+/")[:VOCAB]


@pytest.fixture(scope="module")
def tiny():
    return hf_treespec.enable(tiny_llama()), char_tokenizer(CHARS, chat=True)


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["abcabcXYZ"]},
            {"question_id": 2, "category": "math", "turns": ["q7r8s9t0"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def config(questions_file, **kwargs) -> BenchmarkConfig:
    defaults = dict(questions=str(questions_file), dtype="fp32", max_new_tokens=10, threads=1, progress=False,
                    drafter=None)
    return BenchmarkConfig(**{**defaults, **kwargs})


@pytest.fixture
def without_extra(monkeypatch):
    """As if the [openvino] extra were not installed (an import of openvino_genai fails)."""
    monkeypatch.setitem(sys.modules, "openvino_genai", None)


def test_openvino_is_a_registered_peer_with_its_own_settings():
    assert "openvino" in METHODS and PEER_ORDER[-1] == "openvino"
    assert available_methods()[:4] == ["plain", "assisted_lookup", "assisted_drafter", "openvino"]
    method = build_method("openvino@kv_cache_precision=u8@attention_backend=SDPA")
    assert method.settings == {"kv_cache_precision": "u8", "attention_backend": "SDPA"}
    for refused in ("openvino@tree_budget=4", "openvino@compile=true", "openvino@prompt_lookup_num_tokens=3"):
        with pytest.raises(ValueError, match="does not take"):
            build_method(refused)


def test_without_the_extra_openvino_refuses_with_the_install_command(tiny, questions_file, tmp_path, capsys,
                                                                     without_extra):
    model, tokenizer = tiny
    assert not ov_peer.openvino_available()
    with pytest.raises(ValueError, match=r'pip install "hf-treespec\[openvino\]"'):
        build_method("openvino").check(model, None)
    with pytest.raises(ValueError, match=r"benchmark method 'openvino' cannot run: .*hf-treespec\[openvino\]"):
        run_benchmark(config(questions_file, methods=["plain", "openvino"]), model=model, tokenizer=tokenizer)
    # the default method list runs without it: the row is absent, with a one-line note in the report
    result = run_benchmark(config(questions_file, max_new_tokens=4), model=model, tokenizer=tokenizer)
    assert "openvino" not in result.methods and "hf-treespec[openvino]" in result.skipped["openvino"]
    table = (write_report(result, tmp_path / "out") / "table.md").read_text()
    assert "- openvino: OpenVINO GenAI is not installed" in table
    assert QUICK_OPENVINO not in quick_preset()["methods"]
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["bench", "--model", str(folder), "--dtype", "fp32", "--drafter", "none", "--questions",
                 str(questions_file), "--methods", "openvino", "--out", str(tmp_path / "cli"), "--no-progress"]) == 2
    assert 'pip install "hf-treespec[openvino]"' in capsys.readouterr().err
    assert main(["export-openvino", "--model", str(folder)]) == 2
    assert "hf-treespec[openvino]" in capsys.readouterr().err


def test_quick_adds_the_openvino_rows_only_where_openvino_is_installed(monkeypatch):
    import hf_treespec.compiled.openvino_export as ov_export

    monkeypatch.setattr(ov_peer, "openvino_available", lambda: True)
    monkeypatch.setattr(ov_export, "openvino_installed", lambda: True)
    methods = quick_preset()["methods"]  # the compiled rows through the OpenVINO step, GenAI's loop beside them
    assert methods == ["plain", "plain@compile=openvino", "assisted_lookup", "openvino", "tree:salf",
                       "tree:salf@compile=openvino"]
    assert QUICK_PRESET["methods"] == ["plain", "plain@compile=true", "assisted_lookup", "tree:salf",
                                       "tree:salf@compile=true"]  # the constant is left as it is
    monkeypatch.setattr(ov_peer, "openvino_available", lambda: False)  # the runtime alone: the step's rows
    assert quick_preset()["methods"] == methods[:3] + methods[4:]
    monkeypatch.setattr(ov_export, "openvino_installed", lambda: False)  # neither: inductor's compiled rows
    assert quick_preset()["methods"] == QUICK_PRESET["methods"]


def test_sampled_runs_are_refused_before_anything_loads(tiny, questions_file):
    model, tokenizer = tiny
    method = build_method("openvino")
    with pytest.raises(ValueError, match="greedy decoding only"):
        method.run(model, torch.tensor([[1, 2, 3]]), None, max_new_tokens=4, do_sample=True, temperature=1.0)
    assert method.pipeline is None


def test_runner_times_the_pipeline_and_reports_identity_and_setup(tiny, questions_file, tmp_path, monkeypatch):
    """The runner's side with the pipeline stubbed out (no OpenVINO needed): one load before timing, the new tokens
    held to plain generate's, tau n/a (the target module never runs), ms/token and the setup line in the report."""
    model, tokenizer = tiny
    loads, calls = [], []
    monkeypatch.setattr(ov_peer, "require_genai", lambda: None)
    monkeypatch.setattr(ov_peer, "runtime_versions", lambda: {"openvino": "1", "openvino-genai": "1.0",
                                                              "openvino-tokenizers": "1.0"})
    monkeypatch.setattr(ov_peer, "ensure_ir", lambda m: ov_peer.ExportedIR(
        tmp_path / "ir", {"exporter": "optimum-intel==2.2.0;openvino==1", "weight_format": "fp32",
                          "export_seconds": 42.0}))

    greedy = {}  # prompt -> plain greedy tokens, decoded before the run (the runner counts the target's forwards)
    for question in load_questions(str(questions_file)):
        prompt = build_prompt(tokenizer, question)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=10)
        greedy[tuple(prompt[0].tolist())] = out[0, prompt.shape[1]:]

    def load(folder, properties):
        loads.append(properties)
        return "pipeline"

    def tokens(pipe, input_ids, config):  # stands in for LLMPipeline.generate, returning plain generate's tokens
        calls.append(config)
        return greedy[tuple(input_ids[0].tolist())][:config["max_new_tokens"]], 0.01

    monkeypatch.setattr(ov_peer, "load_pipeline", load)
    monkeypatch.setattr(ov_peer, "greedy_config", lambda pipe, m, kwargs: dict(kwargs))
    monkeypatch.setattr(ov_peer, "greedy_tokens", tokens)
    cfg = config(questions_file, methods=["openvino@kv_cache_precision=u8"], repeats=2)
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer)
    assert len(loads) == 1 and loads[0]["INFERENCE_NUM_THREADS"] == 1 and loads[0]["KV_CACHE_PRECISION"] == "u8"
    assert loads[0]["INFERENCE_PRECISION_HINT"] == "f32" and not loads[0]["scheduler_config"]["enable_prefix_caching"]
    assert len(calls) == 1 + 2 * 2 and calls[0]["max_new_tokens"] == 8 and calls[-1]["max_new_tokens"] == 10
    summary = {s.method: s for s in result.summaries()}["openvino@kv_cache_precision=u8"]
    assert (summary.identical, summary.compared) == (2, 2)
    assert summary.tokens_per_s == pytest.approx(summary.new_tokens / 0.02)
    assert summary.ms_per_token == pytest.approx(1000 / summary.tokens_per_s)
    assert summary.tau != summary.tau  # nan: no target forward counted
    table = (write_report(result, tmp_path / "out") / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| openvino@"))
    assert f"| {summary.ms_per_token:.1f} |" in row and "| n/a |" in row and "2/2" in row
    assert "Set up before timing:" in table and "cached; its export took 42 s" in table
    assert "KV_CACHE_PRECISION=u8" in table and "prefix_caching=false" in table


def test_pipeline_properties_follow_the_bench():
    model = tiny_llama(layers=1)
    properties = ov_peer.pipeline_properties(model.to(torch.bfloat16), 2, {})
    assert properties["INFERENCE_NUM_THREADS"] == 2
    assert properties["INFERENCE_PRECISION_HINT"] == properties["KV_CACHE_PRECISION"] == "bf16"
    assert properties["ATTENTION_BACKEND"] == "PA"
    assert properties["scheduler_config"] == {"max_num_batched_tokens": 2**64 - 1, "enable_prefix_caching": False}
    sdpa = ov_peer.pipeline_properties(model, 2, {"attention_backend": "sdpa", "inference_precision": "f32"})
    assert sdpa["ATTENTION_BACKEND"] == "SDPA" and "scheduler_config" not in sdpa
    assert sdpa["INFERENCE_PRECISION_HINT"] == sdpa["KV_CACHE_PRECISION"] == "f32"
    with pytest.raises(ValueError, match="PA or SDPA"):
        ov_peer.pipeline_properties(model, 2, {"attention_backend": "flash"})
    with pytest.raises(ValueError, match="PA only"):
        ov_peer.pipeline_properties(model, 2, {"attention_backend": "SDPA", "prefix_caching": True})


def test_ir_cache_key_follows_the_weights_and_the_exporter(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ov_peer, "runtime_versions", lambda: {"openvino": "2026.4.1", "openvino-genai": "2026.4.1.0",
                                                              "openvino-tokenizers": "2026.4.1.0"})
    model = tiny_llama(layers=1)
    source, in_memory = ov_peer.weights_source(model)
    assert source is None and in_memory == ov_peer.weights_source(tiny_llama(layers=1))[1]  # same weights
    assert in_memory != ov_peer.weights_source(tiny_llama(seed=1, layers=1))[1]
    model.save_pretrained(tmp_path / "ckpt")
    loaded = type(model).from_pretrained(tmp_path / "ckpt")
    source, fingerprint = ov_peer.weights_source(loaded)
    assert source.folder == tmp_path / "ckpt" and source.name == "ckpt"
    folder = ov_peer.ir_folder(source.name, fingerprint)
    assert folder.parent == tmp_path / "cache" / "openvino" and folder.name.startswith("ckpt-fp32-")
    monkeypatch.setenv(ov_peer.OPTIMUM_CLI_ENV, str(tmp_path / "optimum-cli"))
    assert ov_peer.ir_folder(source.name, fingerprint) != folder  # another exporter, another IR
    monkeypatch.delenv(ov_peer.OPTIMUM_CLI_ENV)
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: a new modification time
    assert ov_peer.ir_folder(source.name, ov_peer.weights_source(loaded)[1]) != folder
    assert ov_peer.exporter_requirements()[0] == f"torch=={torch.__version__.split('+')[0]}"
    assert "transformers<5.6" in ov_peer.exporter_requirements()


def test_greedy_config_stops_as_generate_does():
    genai = pytest.importorskip("openvino_genai")

    class Pipe:
        def get_generation_config(self):
            return genai.GenerationConfig()

    model = tiny_llama(layers=1)
    model.generation_config.eos_token_id = [5, 7]
    cfg = ov_peer.greedy_config(Pipe(), model, {"max_new_tokens": 12, "do_sample": False})
    assert (cfg.max_new_tokens, cfg.do_sample, cfg.ignore_eos, cfg.eos_token_id) == (12, False, False, 5)
    assert cfg.stop_token_ids == {5, 7} and cfg.min_new_tokens == 0 and cfg.is_greedy_decoding()
    model.generation_config.eos_token_id = None
    cfg = ov_peer.greedy_config(Pipe(), model, {"max_new_tokens": 3})
    assert cfg.ignore_eos and cfg.min_new_tokens == 0  # ignore_eos: runs to max_new_tokens whatever it emits
    cfg.validate()


@pytest.mark.slow  # makes optimum-intel's exporter environment on first use (minutes, once per machine)
def test_tiny_llama_exported_and_run_by_llm_pipeline_matches_plain_greedy(tmp_path, monkeypatch, questions_file):
    """A tiny random Llama saved with a char tokenizer, exported by optimum-cli, run by LLMPipeline in fp32: the
    same greedy tokens as plain generate, to max_new_tokens without an EOS token and to the EOS with one; the IR is
    exported once and found in the cache by the next run."""
    pytest.importorskip("openvino_genai")
    cli = ov_peer.ensure_exporter()  # in the machine's cache: made once, reused by every later run
    monkeypatch.setenv(ov_peer.OPTIMUM_CLI_ENV, str(cli))
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    tokenizer = char_tokenizer(CHARS, chat=True)
    tokenizer.save_pretrained(folder)
    model = hf_treespec.enable(type(tiny_llama()).from_pretrained(folder).eval())
    assert Path(model.name_or_path) == folder
    cfg = config(questions_file, methods=["openvino"], max_new_tokens=24)
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer)
    summary = {s.method: s for s in result.summaries()}
    assert (summary["openvino"].identical, summary["openvino"].compared) == (2, 2)
    assert all(r.new_tokens == 24 for r in result.records)
    assert "exported now" in result.settings["method_setup"]["openvino"]
    ir = next((tmp_path / "cache" / "openvino").glob("tiny-fp32-*"))
    assert (ir / "openvino_model.xml").is_file() and (ir / ov_peer.PROVENANCE_FILE).is_file()
    # an EOS token that plain generate emits: both stop there, the EOS kept
    plain = [r.tokens for r in result.records if r.method == "plain"]
    model.generation_config.eos_token_id = plain[0][5]
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer)
    records = {(r.method, r.question_id): r for r in result.records}
    assert records[("openvino", 1)].tokens == records[("plain", 1)].tokens
    assert records[("plain", 1)].new_tokens <= 6 and all(r.identical for r in result.records if r.method != "plain")
    assert "cached" in result.settings["method_setup"]["openvino"]
    # a model with no checkpoint folder (built in memory, bf16 weights): exported from an fp32 copy of its weights
    model = hf_treespec.enable(tiny_llama(seed=3).to(torch.bfloat16))
    assert ov_peer.weights_source(model)[0] is None
    result = run_benchmark(config(questions_file, methods=["openvino"], max_new_tokens=12, dtype="bf16"),
                           model=model, tokenizer=tokenizer)
    assert "in-memory model" in json.loads(next((tmp_path / "cache" / "openvino").glob(
        f"LlamaForCausalLM-fp32-*/{ov_peer.PROVENANCE_FILE}")).read_text())["source"]
    summary = {s.method: s for s in result.summaries()}["openvino"]
    assert summary.compared == 2 and summary.identical + len(summary.divergences) == 2  # bf16: near-ties may flip
