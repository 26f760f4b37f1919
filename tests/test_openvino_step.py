"""The OpenVINO target step (`hf_treespec.compiled.openvino_step`, ``CompileConfig(backend="openvino")``): its logits
over trees with rejected rows held in the engine's cache, lossless decoding through it (greedy identity, sampling
law), the cache it hands back, its on-disk export and the eager fallback.

Greedy identity is held to plain decoding through the same engine (`plain_generate` with the same config), and, in
fp32 on these tiny models, to eager plain ``generate`` too.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import torch
from transformers import CompileConfig, DynamicCache, LogitsProcessor, LogitsProcessorList

import hf_treespec
from conftest import VOCAB, assert_drafted, confident_classifier, fixed_budget, perturbed_copy, tiny_llama
from hf_treespec.attention import additive_mask
from hf_treespec.compiled import openvino_step
from hf_treespec.features import capture_hidden_states
from hf_treespec.generation.plain import plain_generate
from hf_treespec.tree import DraftTree
from test_generate_sampling import chi_square_pvalue, exact_law, sample_three_tokens

pytest.importorskip("openvino")

OPENVINO = CompileConfig(backend="openvino")


@pytest.fixture(scope="module")
def step_cache(tmp_path_factory):
    """A fresh IR cache for the module (HF_TREESPEC_COMPILED_CACHE), so the first test exports."""
    folder = tmp_path_factory.mktemp("openvino-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_TREESPEC_COMPILED_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def pair(step_cache):
    model = hf_treespec.enable(tiny_llama(seed=11))
    return model, perturbed_copy(model)


def _random_tree(generator: torch.Generator, root: int, nodes: int) -> DraftTree:
    """A tree of ``nodes`` nodes with random parents and tokens."""
    tree = DraftTree.root(root)
    for node in range(1, nodes):
        parent = int(torch.randint(0, node, (1,), generator=generator))
        token = torch.randint(0, VOCAB, (1,), generator=generator)
        tree = tree.add_children(torch.tensor([parent]), token, torch.zeros(1))
    return tree


def _padded_batch(seed: int, lengths=(9, 6, 11, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of ``lengths`` (pad id 0): ``input_ids`` and ``attention_mask``."""
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@pytest.mark.parametrize("compact_after", [10_000, 4])
@torch.no_grad()
def test_tree_logits_equal_eager_ones_with_rejected_rows_held(pair, compact_after):
    """Steps of random trees (a random size per sequence) with random accepted paths over a left-padded batch of
    three, one sequence finishing midway: every tree's logits through the engine (rejected rows of earlier steps
    still in its cache, masked out, or compacted away) equal the eager model's over the sequence's committed tokens
    and the tree."""
    from hf_treespec.generation.target import TargetForward
    from hf_treespec.kv.stateful_kv import StatefulKV

    model, _ = pair
    engine = openvino_step.openvino_step_for(model, None, ())
    assert engine.failure is None
    generator = torch.Generator().manual_seed(0)
    ids, mask = _padded_batch(0, lengths=(7, 4, 6))
    kv = StatefulKV(engine, DynamicCache(config=model.config), mask)
    kv.compact_after = compact_after  # 4: dead rows are dropped once they outnumber the live ones
    TargetForward(model, None, (), engine).prefill(input_ids=ids, attention_mask=mask,
                                                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    committed = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    active, fed = [0, 1, 2], ids.shape[1]
    for step in range(10):
        if step == 5:  # sequence 1 finishes: it stays in the engine, fed dead rows
            kv.retire(torch.tensor([True, False, True]))
            active = [0, 2]
        trees = [_random_tree(generator, int(torch.randint(0, VOCAB, (1,), generator=generator)),
                              int(torch.randint(1, 9, (1,), generator=generator))) for _ in active]
        step_ids, positions, step_mask = kv.step_inputs(trees, torch.float32, "cpu", True)
        fed += step_ids.shape[1]
        logits = engine(step_ids, positions, step_mask)
        paths = []
        for slot, (sequence, tree) in enumerate(zip(active, trees)):
            for node in range(tree.num_nodes):  # the eager forward of the committed tokens and the node's path
                path = tree.tokens[tree.path_to(node)].tolist()
                reference = model(torch.tensor([committed[sequence] + path])).logits[0, -1]
                assert torch.allclose(logits[slot, node], reference, atol=1e-4), (step, sequence, node)
            leaf = int(torch.randint(0, tree.num_nodes, (1,), generator=generator))
            paths.append(tree.path_to(leaf))
            committed[sequence] += tree.tokens[paths[-1]].tolist()
        kv.commit(paths)
    longest = max(len(tokens) for tokens in committed)
    if compact_after > 1000:
        assert engine.held == fed > longest  # rejected rows stayed in the engine's cache
    else:
        assert longest <= engine.held < fed  # dead rows (padding included) were dropped on the way


@pytest.mark.parametrize("policy", [p for p in hf_treespec.list_policies() if p != "nde"] + ["auto"])
def test_greedy_equals_plain_decoding(pair, policy):
    """Every policy (``nde`` needs its trained selector; ``auto``: salf sized by measured cost), fp32."""
    model, drafter = pair
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    eager = model.generate(ids, max_new_tokens=30, do_sample=False)
    plain = model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=plain_generate,
                           compile_config=OPENVINO)
    sizing = {"tree_policy": "salf", "tree_budget": "auto"} if policy == "auto" else fixed_budget(policy)
    extra = {"c2t_classifier": confident_classifier()} if policy == "c2t" else {}
    out = model.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, compile_config=OPENVINO,
                         return_dict_in_generate=True, **({"tree_policy": policy} | sizing), **extra)
    if policy != "auto":  # auto may find that trees do not pay on this machine: identity still holds
        assert_drafted(out)
    assert torch.equal(out.sequences, plain)
    assert torch.equal(plain, eager)


class _ThreadsSeen(LogitsProcessor):
    """Records torch's thread count at every call (the loop's host work of a step), with the step it belongs to."""

    def __init__(self, steps: list):
        self.steps, self.seen = steps, []

    def __call__(self, input_ids, scores):
        self.seen.append((len(self.steps), torch.get_num_threads()))
        return scores


@pytest.mark.auto_budget
def test_draft_free_steps_leave_the_engine_the_cores(pair, monkeypatch):
    """Through the engine, plain decoding's steps and the tree loop's draft-free steps run torch on one thread; a
    drafting step has the caller's threads, and the caller has them back after the call."""
    from hf_treespec.generation.sizing import TreeSizing

    model, drafter = pair
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        steps = []
        seen = _ThreadsSeen(steps)
        plain = model.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=plain_generate,
                               compile_config=OPENVINO, logits_processor=LogitsProcessorList([seen]))
        assert {threads for _, threads in seen.seen} == {1} and torch.get_num_threads() == 2

        decide = TreeSizing.may_draft

        def every_other_step(self, context_length):  # the sizing's own check runs; the test decides the step
            decide(self, context_length)
            steps.append(len(steps) % 2 == 0)
            return steps[-1]

        monkeypatch.setattr(TreeSizing, "may_draft", every_other_step)
        seen = _ThreadsSeen(steps)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, compile_config=OPENVINO,
                             tree_policy="salf", tree_budget="auto", logits_processor=LogitsProcessorList([seen]))
        assert torch.equal(out, plain) and torch.get_num_threads() == 2
        by_step = {(steps[step - 1], threads) for step, threads in seen.seen if step > 0}
        assert by_step == {(True, 2), (False, 1)}  # drafting steps: the caller's threads; draft-free ones: one
    finally:
        torch.set_num_threads(before)


def test_feature_drafter_reads_the_engines_layer_outputs(pair):
    """An EAGLE-3 style drafter reads three decoder layers: the engine exports them as outputs of its graph."""
    from test_feature_drafter import make_drafter

    model, _ = pair
    drafter = make_drafter(model, input_mode="eagle3", target_layers=[0, 1, 3]).tie_to_target(model)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    eager = model.generate(ids, max_new_tokens=20, do_sample=False)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, tree_policy="salf",
                         tree_budget=6, compile_config=OPENVINO, return_dict_in_generate=True)
    assert_drafted(out, accepting=False)  # an untrained drafter
    assert torch.equal(out.sequences, eager)
    engine = openvino_step.openvino_step_for(model, None, (0, 1, 3))
    with capture_hidden_states(model, (0, 1, 3)) as eager_states:  # the decoder layers' outputs, as hooks see them
        model(out.sequences[:, :12])
    engine.reset()
    engine(out.sequences[:, :12], torch.arange(12)[None],
           additive_mask(torch.ones(12, 12, dtype=torch.bool).tril(), torch.float32)[None, None])
    for slot in range(3):
        assert torch.allclose(engine.states((0, 1, 3)).parts[slot], eager_states.parts[slot], atol=1e-4)


def test_sampling_preserves_the_target_law(pair):
    """Monte-Carlo through the engine: the law of the first three sampled tokens equals the target's exact law
    (chi-square; a correct sampler fails with probability 1e-3)."""
    model, drafter = pair
    law = exact_law(model)
    n = 500
    counts, outs = sample_three_tokens(model, n, assistant_model=drafter, tree_policy="salf", tree_budget=6,
                                       compile_config=OPENVINO)
    assert_drafted(outs)
    assert chi_square_pvalue(counts, law, n) > 1e-3


def test_returned_cache_continues_like_eager_decoding(pair):
    """The engine's live rows come back in ``past_key_values`` as plain decoding leaves them: continuing from it
    eagerly gives the tokens eager decoding gives."""
    model, drafter = pair
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(5))
    out = model.generate(ids, max_new_tokens=15, do_sample=False, assistant_model=drafter, tree_policy="salf",
                         tree_budget=6, compile_config=OPENVINO, return_dict_in_generate=True)
    assert_drafted(out)
    # the rows stay in the engine until read; the next call's new sequence copies them out first
    model.generate(ids.flip(1), max_new_tokens=5, do_sample=False, custom_generate=plain_generate,
                   compile_config=OPENVINO)
    cache = out.past_key_values
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    reference = DynamicCache(config=model.config)
    model(out.sequences[:, :-1], past_key_values=reference, use_cache=True)
    for mine, theirs in zip(cache.layers, reference.layers):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-4)
        assert torch.allclose(mine.values, theirs.values, atol=1e-4)


def test_missing_openvino_falls_back_to_eager_with_one_warning(pair, monkeypatch, caplog):
    model, drafter = pair
    monkeypatch.setattr("hf_treespec.generation.target.openvino_installed", lambda: False)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with caplog.at_level(logging.WARNING, logger="hf_treespec.generation.target"):
        out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, tree_policy="salf",
                             tree_budget=6, compile_config=OPENVINO, return_dict_in_generate=True)
    warnings = [r for r in caplog.records if "openvino" in r.getMessage().lower()]
    assert len(warnings) == 1 and "not installed" in warnings[0].getMessage()
    assert_drafted(out)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=12, do_sample=False))


def test_failed_export_falls_back_to_eager_with_one_warning(monkeypatch, caplog, step_cache):
    model = hf_treespec.enable(tiny_llama(seed=12))

    def broken(*args, **kwargs):
        raise RuntimeError("simulated: conversion failed")

    monkeypatch.setattr(openvino_step, "_export", broken)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
    with caplog.at_level(logging.WARNING):
        first = model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=plain_generate,
                               compile_config=OPENVINO)
        second = model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=plain_generate,
                                compile_config=OPENVINO)
    failures = [r for r in caplog.records if "simulated: conversion failed" in r.getMessage()]
    assert len(failures) == 1  # when the export failed; the second call decodes eagerly without another
    assert torch.equal(first, model.generate(ids, max_new_tokens=10, do_sample=False)) and torch.equal(first, second)


@pytest.mark.parametrize("policy", [p for p in hf_treespec.list_policies() if p != "nde"] + ["auto"])
def test_a_padded_batch_equals_plain_decoding(pair, policy, caplog):
    """Batch 4, left-padded prompts, through the engine (no fallback warning): every policy's greedy rows equal
    plain decoding through the same engine and eager plain ``generate`` (fp32), rows finishing apart included."""
    model, drafter = pair
    ids, mask = _padded_batch(8)
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **common)
    with caplog.at_level(logging.WARNING, logger="hf_treespec"):
        plain = model.generate(ids, custom_generate=plain_generate, compile_config=OPENVINO, **common)
        sizing = {"tree_policy": "salf", "tree_budget": "auto"} if policy == "auto" else fixed_budget(policy)
        extra = {"c2t_classifier": confident_classifier()} if policy == "c2t" else {}
        out = model.generate(ids, assistant_model=drafter, compile_config=OPENVINO, return_dict_in_generate=True,
                             **common, **({"tree_policy": policy} | sizing), **extra)
    assert not [r for r in caplog.records if "eager" in r.getMessage()]
    if policy != "auto":
        assert_drafted(out)
    assert torch.equal(out.sequences, plain)
    assert torch.equal(plain, eager)


def test_a_batch_whose_rows_finish_apart_hands_back_each_rows_cache(pair):
    """A stop token ends rows at different steps: finished rows stay in the engine, fed dead rows, and the cache
    handed back holds each row's ``sequences[:, :-1]`` (the prompt's padding as zeros), as eager decoding computes
    it; the sequences equal eager ``generate``'s."""
    model, drafter = pair
    ids, mask = _padded_batch(9)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    stop = int(eager[1, ids.shape[1] + 3])  # row 1 stops early on its fourth new token (others may too, later)
    common = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=stop)
    reference = model.generate(ids, **common)
    out = model.generate(ids, assistant_model=drafter, compile_config=OPENVINO, return_dict_in_generate=True,
                         tree_policy="salf", tree_budget=6, **common)
    assert_drafted(out)
    assert torch.equal(out.sequences, reference)
    ends = [int(ids.shape[1] + (row[ids.shape[1]:] != 0).sum()) for row in out.sequences]
    assert len(set(ends)) > 1  # the rows finished apart
    for row, end in enumerate(ends):
        pads = int((mask[row] == 0).sum())
        cache = DynamicCache(config=model.config)
        model(out.sequences[row : row + 1, pads : end - 1], past_key_values=cache, use_cache=True)
        for mine, theirs in zip(out.past_key_values.layers, cache.layers):
            assert not mine.keys[row, :, :pads].any()
            assert torch.allclose(mine.keys[row : row + 1, :, pads : end - 1], theirs.keys, atol=1e-4)
            assert torch.allclose(mine.values[row : row + 1, :, pads : end - 1], theirs.values, atol=1e-4)
            assert not mine.keys[row, :, end - 1 :].any()  # a hole after a shorter row's end


def test_a_batchs_cost_curve_is_measured_at_its_batch_size(pair, monkeypatch):
    """``tree_budget="auto"`` prices a batch's steps on a curve of ``[batch, rows]`` forwards: calibrated through the
    engine, every timed forward feeds the batch's sequences (not one)."""
    from hf_treespec.cost.curve import calibrate_target

    model, _ = pair
    engine = openvino_step.openvino_step_for(model, None, ())
    fed = []
    forward = openvino_step.OpenVINOStep.__call__

    def recording(self, input_ids, *args, **kwargs):
        fed.append(int(input_ids.shape[0]))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(openvino_step.OpenVINOStep, "__call__", recording)
    curve = calibrate_target(model, sizes=(1, 4), contexts=(8, 16), repeats=2, compiled=engine, batch=3)
    assert fed and set(fed) == {3}
    assert curve.key["batch"] == 3 and all(seconds > 0 for row in curve.seconds for seconds in row)


def test_a_second_process_reuses_the_export(pair, step_cache, tmp_path):
    """The IR is exported once per machine: a second process finds it and is ready in seconds."""
    script = tmp_path / "ready.py"
    script.write_text(
        "import sys, time, torch\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from conftest import tiny_llama\n"
        "from hf_treespec.compiled.openvino_step import OpenVINOStep\n"
        "start = time.perf_counter()\n"
        "step = OpenVINOStep(tiny_llama(seed=13), None, ())\n"
        "print(step.failure, 'export' in step.compile_seconds, time.perf_counter() - start)\n"
    )
    tests = str(__import__("pathlib").Path(__file__).parent)
    env = {**__import__("os").environ, "HF_TREESPEC_COMPILED_CACHE": str(step_cache)}
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(script), tests], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]  # what went wrong in the child, not only its status
        runs.append((done.stdout.split(), time.perf_counter() - start))
    (failure1, exported1, _), _ = runs[0]
    (failure2, exported2, ready2), total2 = runs[1]
    assert failure1 == failure2 == "None"
    assert exported1 == "True" and exported2 == "False"  # the second process read the first one's IR
    assert float(ready2) < 30 and total2 < 30
