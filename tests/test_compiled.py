"""The compiled target path (`hf_treespec.compiled`): preallocated cache layers, compiled steps, fallback, no
recompiles as the context grows, and lossless decoding through it (greedy identity, sampling law).

Greedy identity is checked against plain decoding through the *same* compiled forward (`plain_generate`): compiled
kernels may round differently from eager ones, so that is the identity the product promises for a compiled run.
Most tests compile with dynamo's ``eager`` backend (the graphs, guards and cache handling of a compiled run at the
cost of tracing only); the module-scoped ``inductor`` target runs the real recommended settings (frozen weights,
inductor's C++ kernels) once for the tests that use it, which are marked ``slow`` (minutes of compiling on 2 cores).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import assert_drafted, fixed_budget, perturbed_copy, tiny_llama
from transformers import CompileConfig, DynamicCache

import hf_treespec
from hf_treespec.compiled import row_moves
from hf_treespec.compiled.cpp_ops import has_compiler
from hf_treespec.kv import tree_kv
from hf_treespec.kv.tree_kv import keep_rows
from hf_treespec.compat import CACHE_KWARG
from hf_treespec.compiled import CompileSettings, PreallocatedLayer, compiled_forward_for, preallocate, release
from hf_treespec.generation.plain import plain_generate
from test_generate_sampling import chi_square_pvalue, exact_law, sample_three_tokens

TRACE_ONLY = CompileConfig(backend="eager", mode=None)


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def traced():
    """A tiny target and a drafter for dynamo's eager backend (its graphs are per model instance)."""
    model = hf_treespec.enable(tiny_llama(seed=3))
    yield model, perturbed_copy(model)
    release(model)


@pytest.fixture(scope="module")
def inductor():
    """A tiny target compiled with the recommended settings (inductor, frozen weights), shared by the module."""
    model = hf_treespec.enable(tiny_llama(seed=4))
    yield model, perturbed_copy(model)
    release(model)


@pytest.mark.parametrize("one_op", [True, False], ids=["row-moves-op", "torch-ops"])
def test_preallocated_layers_decode_like_dynamic_ones(monkeypatch, one_op):
    """Eager: a cache of `PreallocatedLayer` s (capacity 4: it must grow), edited by keep_rows and by a replacement
    of its views (as RaggedKV.retire does), gives the logits of a DynamicCache step for step; the preallocated
    buffers' rows moved by the one-call op (`row_moves`) or, without it, by each layer's torch ops."""
    calls = []
    if one_op:
        if not has_compiler():
            pytest.skip("the row-moves op needs a C++ compiler")
        real = tree_kv.move_rows
        monkeypatch.setattr(tree_kv, "move_rows", lambda *args: (calls.append(len(args[0])), real(*args)))
    else:
        monkeypatch.setattr(tree_kv, "moves_in_one_op", lambda buffers: False)
    model = tiny_llama(seed=5)
    torch.manual_seed(0)
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    preallocate(caches[1], 4)
    ids = torch.randint(0, 64, (1, 6))
    with torch.inference_mode():
        outs = [model(input_ids=ids, use_cache=True, **{CACHE_KWARG: c}).logits for c in caches]
        for step in range(12):
            new = torch.randint(0, 64, (1, 3))
            outs = [model(input_ids=new, use_cache=True, **{CACHE_KWARG: c}).logits for c in caches]
            torch.testing.assert_close(outs[0], outs[1])
            length = caches[0].get_seq_length()
            # a two-token accepted path: the first and the last new row (moved), or the first two (kept in place)
            kept = [0, 2] if step % 3 else [0, 1]
            for cache in caches:
                keep_rows(cache, length - 3, kept)
            assert caches[1].layers[0].rows_in_buffers == caches[0].get_seq_length()
            if step == 5:
                layer = caches[1].layers[0]
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
                assert layer.rows_in_buffers is None  # held as given, re-adopted later
    layer = caches[1].layers[0]
    assert isinstance(layer, PreallocatedLayer) and layer.capacity >= layer.keys.shape[-2] > 4
    assert layer.rows_in_buffers is not None  # views of its buffers again
    assert bool(calls) == one_op  # the moved paths went through the op (every layer's two buffers in one call)
    assert not calls or max(calls) == 2 * len(caches[1].layers)


@pytest.mark.skipif(not has_compiler(), reason="the row-moves op needs a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_moves_op_moves_rows_as_torch_indexing_does(dtype):
    """`row_moves.move_rows`: every buffer's rows as ``buffer[b, :, dst] = buffer[b, :, src]`` (sources read before
    any write: a move's destination may be another's source); a move outside a buffer is refused by name."""
    torch.manual_seed(0)
    buffers = [torch.randn(3, 2, 10, 8).to(dtype) for _ in range(4)]
    batch, source, destination = torch.tensor([0, 0, 2, 1, 2]), torch.tensor([5, 7, 3, 9, 4]), torch.tensor([3, 5, 2, 0, 3])
    expected = [buffer.clone() for buffer in buffers]
    for buffer in expected:
        buffer[batch, :, destination] = buffer[batch, :, source]
    row_moves.move_rows(buffers, batch, source, destination)
    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)
    assert row_moves.moves_in_one_op(buffers) and not row_moves.moves_in_one_op([buffers[0][:, :, :4]])
    with pytest.raises(RuntimeError, match="a move outside the buffer"):
        row_moves.move_rows(buffers, torch.tensor([0]), torch.tensor([10]), torch.tensor([0]))


def test_preallocate_refuses_a_filled_or_sliding_cache():
    model = tiny_llama(seed=5)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2]]), use_cache=True, **{CACHE_KWARG: cache})
    with pytest.raises(ValueError, match="empty cache"):
        preallocate(cache, 8)


def test_settings_follow_transformers_compile_config():
    assert CompileSettings.from_compile_config(CompileConfig()) == CompileSettings.recommended("cpu")
    assert dict(CompileSettings.recommended("cpu").options) == {"freezing": True, "max_autotune": True}
    custom = CompileSettings.from_compile_config(CompileConfig(backend="eager", mode=None, options={"a": 1}))
    assert (custom.backend, custom.mode, custom.options) == ("eager", None, (("a", 1),))
    assert "dynamic" not in custom.compile_kwargs()  # the varying dimensions are marked per step instead


@pytest.mark.parametrize("policy,budget", [("chain", None), ("salf", 6), ("eagle2", 8), ("optimal", 5)])
def test_compiled_greedy_equals_compiled_plain_decoding(traced, policy, budget):
    model, drafter = traced
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=plain_generate,
                           compile_config=TRACE_ONLY)
    assert torch.equal(plain, model.generate(ids, max_new_tokens=40, do_sample=False))
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter, tree_policy=policy,
                         compile_config=TRACE_ONLY, return_dict_in_generate=True, **fixed_budget(policy, budget))
    assert_drafted(out)
    assert torch.equal(out.sequences, plain)


def test_compiled_batch_equals_plain_batched_generate(traced, monkeypatch):
    """A left-padded batch through the compiled steps equals plain batched ``generate``; its cache's row moves
    (`RaggedKV.commit`) ran through the one-call op where it is built."""
    calls = []
    real = tree_kv.move_rows
    monkeypatch.setattr(tree_kv, "move_rows", lambda *args: (calls.append(len(args[0])), real(*args)))
    model, drafter = traced
    ids = torch.randint(1, 64, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, pad_token_id=0)
    compiled_plain = model.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, pad_token_id=0,
                                    custom_generate=plain_generate, compile_config=TRACE_ONLY)
    assert torch.equal(compiled_plain, plain)
    for policy in ("salf", "chain"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, pad_token_id=0,
                             assistant_model=drafter, tree_policy=policy, compile_config=TRACE_ONLY,
                             return_dict_in_generate=True, **fixed_budget(policy, 6))
        assert_drafted(out)
        assert torch.equal(out.sequences, plain), policy
    assert bool(calls) == has_compiler() and set(calls) <= {2 * model.config.num_hidden_layers}


def test_the_prompt_runs_through_the_compiled_graphs_in_chunks(traced, monkeypatch):
    """A compiled run's prefill goes through the compiled graphs, `PREFILL_CHUNK` rows at a time (4 here: a 10-token
    prompt takes three forwards, the last of two rows): its last logits, the decoder layers a drafter reads at every
    real prompt row and the cached keys match the eager prefill's, for a left-padded batch, and no chunk would fail
    a guard of the graphs the steps compiled (their calls skip the guards); a one-token prompt is left to the eager
    forward."""
    import hf_treespec.compiled.forward as forward_module
    from hf_treespec.compiled import CompiledForward
    from hf_treespec.generation.target import TargetForward

    model, _ = traced
    monkeypatch.setattr(forward_module, "PREFILL_CHUNK", 4)
    compiled = compiled_forward_for(model, CompileSettings.from_compile_config(TRACE_ONLY))
    compiled.warm_up(3)
    compiled.warm_up(1)
    monkeypatch.setattr(CompileSettings, "guard_stance", lambda self: torch.compiler.set_stance("fail_on_recompile"))
    for batch in (1, 3):  # a batch of one: its chunks' strides are what a slice of the prompt leaves
        ids = torch.randint(1, 64, (batch, 10), generator=torch.Generator().manual_seed(12))
        cache = DynamicCache(config=model.config)
        preallocate(cache, 64)
        with torch.inference_mode():
            compiled.prefill(ids, torch.arange(10).expand(batch, -1), None, cache, (0,))
    ids = torch.randint(1, 64, (3, 10), generator=torch.Generator().manual_seed(12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  logits_to_keep=1)
    layers = (0, 2, -1)
    eager_cache = DynamicCache(config=model.config)
    eager_logits, eager_states = TargetForward(model, eager_cache, layers).prefill(**inputs)
    rows = []
    call = CompiledForward.__call__
    monkeypatch.setattr(CompiledForward, "__call__", lambda self, *a, **k: rows.append(a[0].shape[1]) or call(self, *a, **k))
    cache = DynamicCache(config=model.config)
    preallocate(cache, 64)
    with torch.inference_mode():
        logits, states = TargetForward(model, cache, layers, compiled).prefill(**inputs)
    assert rows == [4, 4, 2]
    real = mask.bool()
    torch.testing.assert_close(logits[:, -1], eager_logits[:, -1], atol=1e-5, rtol=1e-5)
    for part, eager_part in zip(states.parts, eager_states.parts):
        torch.testing.assert_close(part[real], eager_part[real], atol=1e-5, rtol=1e-5)
    keys, eager_keys = cache.layers[1].keys, eager_cache.layers[1].keys
    torch.testing.assert_close(keys.transpose(1, 2)[real], eager_keys.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
    assert compiled.prefill(ids[:, -1:], inputs["position_ids"][:, -1:], None, DynamicCache(config=model.config),
                            layers) is None


def test_compiled_steps_never_need_a_second_graph(monkeypatch):
    """Each graph's function compiles once; later calls skip the guards, which is sound only if no step would fail
    them: with the guards evaluated and recompiling an error, tree decoding over a batch that loses rows (graphs of
    one row, several rows, batch and batch of 1) runs through and gives the same tokens as with the guards skipped."""
    model = hf_treespec.enable(tiny_llama(seed=9))
    drafter = perturbed_copy(model)
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(8))
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, assistant_model=drafter, tree_policy="salf",
                  tree_budget=6, compile_config=TRACE_ONLY, return_dict_in_generate=True)
    stopping = {"eos_token_id": int(ids[0, -1])}  # some rows finish early: the batch shrinks
    skipped = model.generate(ids, **kwargs, **stopping)
    compiled = compiled_forward_for(model, CompileSettings.from_compile_config(TRACE_ONLY))
    assert set(compiled._graphs) <= set(compiled.compile_seconds) and len(compiled.compile_seconds) >= 2
    monkeypatch.setattr(CompileSettings, "guard_stance", lambda self: torch.compiler.set_stance("fail_on_recompile"))
    evaluated = model.generate(ids, **kwargs, **stopping)
    assert_drafted(evaluated)
    assert torch.equal(evaluated.sequences, skipped.sequences)
    release(model)


def test_disable_compile_keeps_the_eager_forward(traced):
    model, drafter = traced
    fresh = hf_treespec.enable(tiny_llama(seed=3))
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    fresh.generate(ids, max_new_tokens=5, do_sample=False, assistant_model=drafter, tree_policy="salf",
                   tree_budget=6, compile_config=TRACE_ONLY, disable_compile=True)
    assert "_treespec_compiled_forwards" not in fresh.__dict__


def test_compilation_failure_falls_back_to_eager_with_one_warning(caplog):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("simulated: no C++ compiler found")

    model = hf_treespec.enable(tiny_llama(seed=6))
    drafter = perturbed_copy(model)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(4))
    reference = model.generate(ids, max_new_tokens=20, do_sample=False)
    config = CompileConfig(backend=broken_backend, mode=None)
    with caplog.at_level(logging.WARNING, logger="hf_treespec.compiled.forward"):
        out = model.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, tree_policy="salf",
                             tree_budget=6, compile_config=config, return_dict_in_generate=True)
        assert_drafted(out)
        out = out.sequences
        again = model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=plain_generate,
                               compile_config=config)
    assert torch.equal(out, reference) and torch.equal(again, reference)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and "no C++ compiler" in failures[0].getMessage()
    release(model)


@pytest.mark.slow
def test_inductor_greedy_identity_and_no_recompile_over_200_steps(inductor):
    """Real inductor graphs (frozen weights): the tree run equals plain decoding through the same compiled forward,
    and 200+ steps of growing context after the warm-up add no graph."""
    model, drafter = inductor
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    config = CompileConfig()
    model.generate(ids, max_new_tokens=2, do_sample=False, custom_generate=plain_generate, compile_config=config)
    compiled = compiled_forward_for(model, CompileSettings.from_compile_config(config))
    assert compiled.failure is None and len(compiled.compile_seconds) == 2
    runs = {}
    for skip in (False, True):  # guards evaluated (a needed graph would show) / skipped, as decoding runs
        with pytest.MonkeyPatch.context() as patch:
            if not skip:
                patch.setattr(CompileSettings, "guard_stance", lambda self: torch.compiler.set_stance(
                    "fail_on_recompile"))
            before = unique_graphs()
            plain = model.generate(ids, max_new_tokens=200, do_sample=False, custom_generate=plain_generate,
                                   compile_config=config)
            tree = model.generate(ids, max_new_tokens=200, do_sample=False, assistant_model=drafter,
                                  tree_policy="salf", tree_budget=6, compile_config=config,
                                  return_dict_in_generate=True)
            assert unique_graphs() == before
        assert_drafted(tree)
        assert torch.equal(tree.sequences, plain)
        runs[skip] = plain
    assert torch.equal(runs[False], runs[True])


@pytest.mark.slow
@pytest.mark.parametrize("policy,verifier", [("salf", "nss"), ("dyspec", None)])
def test_inductor_sampling_preserves_the_target_law(inductor, policy, verifier):
    """Monte-Carlo through the compiled path: the law of the first three sampled tokens equals the target's exact
    law (chi-square; a correct sampler fails with probability 1e-3)."""
    model, drafter = inductor
    law = exact_law(model)
    n = 600
    extra = {"verifier": verifier} if verifier else {}
    counts, outs = sample_three_tokens(model, n, assistant_model=drafter, tree_policy=policy, tree_budget=6,
                                       compile_config=CompileConfig(), **extra)
    assert_drafted(outs)
    assert chi_square_pvalue(counts, law, n) > 1e-3


@pytest.mark.parametrize("input_mode", ["eagle3", "eagle1"])
def test_feature_drafter_compiled_with_the_target(traced, input_mode):
    """A feature drafter's expansions run through its own compiled forward when the target's do (a reduced draft
    vocabulary over the target's shared LM head, as the shipped drafter has); greedy output still equals compiled
    plain decoding, and the drafter's forward compiled into two graphs, without a graph break."""
    from test_feature_drafter import make_drafter, permuted_vocab
    from torch._dynamo.utils import counters

    from hf_treespec.compiled import CompiledDrafterForward

    model, _ = traced
    layers = {"eagle3": {"input_mode": "eagle3", "target_layers": [0, 1, 3]}, "eagle1": {}}[input_mode]
    drafter = make_drafter(model, draft_vocab_size=40, **layers)
    drafter.set_draft_vocab(permuted_vocab(40))
    drafter.tie_to_target(model, lm_head=True)
    breaks = sum(counters["graph_break"].values())
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(6))
    plain = model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=plain_generate,
                           compile_config=TRACE_ONLY)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, tree_policy="salf",
                         tree_budget=6, compile_config=TRACE_ONLY, return_dict_in_generate=True)
    assert_drafted(out, accepting=False)  # an untrained drafter
    assert torch.equal(out.sequences, plain)
    compiled = compiled_forward_for(drafter, CompileSettings.from_compile_config(TRACE_ONLY), CompiledDrafterForward)
    assert compiled.failure is None and len(compiled.compile_seconds) == 2
    assert sum(counters["graph_break"].values()) == breaks
    release(drafter)


def test_a_batch_drafts_through_the_compiled_drafter(traced, monkeypatch):
    """A left-padded batch's stacked draft rounds run through the feature drafter's compiled batch graphs (warmed up
    for the batch), and the rows still equal compiled plain decoding."""
    from test_feature_drafter import make_drafter

    from hf_treespec.compiled import CompiledDrafterForward

    model, _ = traced
    drafter = make_drafter(model, draft_vocab_size=64)
    rows = []
    call = CompiledDrafterForward.__call__
    monkeypatch.setattr(CompiledDrafterForward, "__call__",
                        lambda self, ids, *args, **kwargs: rows.append(ids.shape[0]) or call(self, ids, *args, **kwargs))
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, compile_config=TRACE_ONLY)
    plain = model.generate(ids, custom_generate=plain_generate, **common)
    out = model.generate(ids, assistant_model=drafter, tree_policy="salf", tree_budget=4,
                         return_dict_in_generate=True, **common)
    assert_drafted(out, accepting=False)
    assert torch.equal(out.sequences, plain)
    compiled = compiled_forward_for(drafter, CompileSettings.from_compile_config(TRACE_ONLY), CompiledDrafterForward)
    assert compiled.failure is None
    assert set(compiled.compile_seconds) == {"batch of 1, one row", "batch of 1, several rows", "batch, one row",
                                             "batch, several rows"}
    assert 3 in rows  # the three rows' rounds, stacked, through the compiled forward
    release(drafter)


def test_a_step_dynamo_runs_eagerly_is_still_exact():
    """Past dynamo's recompile limit a compiled step runs eagerly inside the compiled call: the cache still writes at
    the step's slots and the padded mask still fits, so the tokens stay those of plain decoding."""
    model = hf_treespec.enable(tiny_llama(seed=8))
    drafter = perturbed_copy(model)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(7))
    reference = model.generate(ids, max_new_tokens=20, do_sample=False)
    with torch._dynamo.config.patch(recompile_limit=0):  # no graph at all: every step runs eagerly inside the call
        out = model.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, tree_policy="salf",
                             tree_budget=6, compile_config=TRACE_ONLY, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, reference)
    release(model)
