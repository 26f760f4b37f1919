"""The few-rows bf16 linear of compiled CPU steps (`hf_treespec.compiled.few_rows_linear`): the product ``F.linear``
gives (fp32 sums rounded once), for every row count a step has and past it, and routed into compiled graphs only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

import hf_treespec

from hf_treespec.compiled import cpp_ops, few_rows_linear
from hf_treespec.compiled.few_rows_linear import MOST_ROWS, FewRowsLinears


@pytest.fixture(scope="module")
def op():
    if not few_rows_linear.supported():
        pytest.skip("this CPU has no avx512_bf16 (or no C++ compiler): the op is never used here")
    built = few_rows_linear.load_few_rows_linear()
    assert built is not None
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, MOST_ROWS, MOST_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_linear(op, rows, bias):
    """Output sizes off the 64-column tile (200), a batch dimension and rows past `MOST_ROWS` (``at::linear``)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=generator).bfloat16()
    weight = (torch.randn(200, 96, generator=generator) * 0.1).bfloat16()
    b = torch.randn(200, generator=generator).bfloat16() if bias else None
    packed = torch.ops.hf_treespec.few_rows_pack(weight)
    assert packed.shape == (4, 48, 64, 2)
    out = op(x, weight, packed, b)
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.shape == (2, rows, 200) and out.dtype == torch.bfloat16
    # one bf16 rounding of the fp32 sums: within half a bf16 step of the exact product (plus fp32 sum-order noise)
    torch.testing.assert_close(out.float(), reference, atol=1e-4, rtol=2 ** -8)


def test_rejects_what_it_cannot_take(op):
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.hf_treespec.few_rows_pack(torch.zeros(8, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        op(torch.zeros(1, 8), torch.zeros(8, 8), torch.zeros(1, 4, 64, 2), None)


def graph_ops(model, *inputs) -> set[str]:
    """The call targets of the FX graph dynamo traces for ``model(*inputs)``."""
    seen: set[str] = set()

    def backend(graph_module, example_inputs):
        seen.update(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*inputs)
    return seen


def test_routes_a_models_linears_in_compiled_graphs_only(op):
    """Hooked, a bf16 model's graph traced while routing calls the op for every linear (a batch's graph too); a graph
    traced without routing keeps its own, and so does a 2D input's; the eager forward is untouched (the same logits
    bit for bit); released, the graph is the model's own again."""
    model = tiny_llama(seed=4).to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids).logits
        routed = FewRowsLinears.attach(model)
        assert routed is not None and len(routed.handles) == 4 * 7 + 1  # q k v o gate up down per layer, the head
        assert torch.equal(model(ids).logits, before)
        assert "hf_treespec.few_rows_linear" not in graph_ops(model, ids)  # routing is off unless a compile asks
        with routed.routing(True):
            assert torch.equal(model(ids).logits, before)
            assert "hf_treespec.few_rows_linear" in graph_ops(model, ids)
            assert "hf_treespec.few_rows_linear" in graph_ops(model, ids.repeat(2, 1))  # a batch's graph too
            compiled = torch.compile(model, backend="eager")(ids).logits
            torch.testing.assert_close(compiled.float(), before.float(), atol=0.1, rtol=0.05)
            lm_head = model.lm_head
            hidden = torch.randn(3, lm_head.in_features, dtype=torch.bfloat16)
            assert "hf_treespec.few_rows_linear" not in graph_ops(lm_head, hidden)  # a 2D input keeps its linear
        routed.release()
        with routed.routing(True):
            assert "hf_treespec.few_rows_linear" not in graph_ops(model, ids)
    torch._dynamo.reset()


def test_eager_runs_a_routed_linear_through_the_op(op, monkeypatch):
    """`FewRowsLinears.eager` (a compiled drafter's feature projection between graph calls): the op's product for a
    routed linear's few rows, the module itself past `MOST_ROWS` rows or for a linear it did not pack."""
    model = tiny_llama(seed=5).to(torch.bfloat16)
    routed = FewRowsLinears.attach(model)
    calls = []
    monkeypatch.setattr(routed, "op", lambda *args: calls.append(args) or op(*args))
    head = model.lm_head
    with torch.no_grad():
        for rows, through_op in ((3, True), (MOST_ROWS + 1, False)):
            x = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
            calls.clear()
            out = routed.eager(head, x)
            assert len(calls) == int(through_op)
            torch.testing.assert_close(out.float(), F.linear(x.float(), head.weight.float()), atol=1e-2, rtol=2 ** -7)
        other = torch.nn.Linear(8, 4).to(torch.bfloat16)
        calls.clear()
        x = torch.randn(2, 8).bfloat16()
        assert torch.equal(routed.eager(other, x), other(x)) and not calls
    routed.release()
    assert routed.packed == {}


def test_serves_bf16_cpu_models_only(monkeypatch):
    assert FewRowsLinears.attach(tiny_llama(seed=4)) is None  # fp32: inductor's linears
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # a run standing in for a CPU without avx512
    assert not few_rows_linear.supported()
    assert cpp_ops.isa_capped_below_avx512()


@pytest.mark.slow
def test_an_inductor_step_of_several_rows_runs_it(op):
    """Inductor with the recommended settings: the few-rows graph of a bf16 model runs the op (its linears routed)
    and gives the eager forward's logits within bf16 rounding; the graph of more rows (a prompt's) keeps inductor's
    linears."""
    from transformers import DynamicCache

    from hf_treespec.attention import causal_row_mask
    from hf_treespec.compat import CACHE_KWARG
    from hf_treespec.compiled import CompileSettings, CompiledForward, preallocate

    model = hf_treespec.enable(tiny_llama(seed=6).to(torch.bfloat16))
    compiled = CompiledForward(model, CompileSettings.recommended("cpu"))
    assert compiled.linears is not None
    compiled.warm_up(rows=(1, 5))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(6))
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    preallocate(caches[1], 32)
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids[:, :7], use_cache=True, **{CACHE_KWARG: cache})
        eager = model(input_ids=ids[:, 7:], use_cache=True, **{CACHE_KWARG: caches[0]}).logits
        mask = causal_row_mask(5, 12, torch.bfloat16, "cpu")
        step = (ids[:, 7:].clone(), torch.arange(7, 12)[None], mask)
        compiled(*step, caches[1])  # the first call of a graph may still check its guards (and recompile)
        for layer in caches[1].layers:
            layer.view_rows(7)
        with torch.profiler.profile() as profile:
            logits = compiled(*step, caches[1])
    assert compiled.failure is None and set(compiled.compile_seconds) == {"batch of 1, one row",
                                                                          "batch of 1, few rows"}
    calls = {event.key: event.count for event in profile.key_averages()}
    assert calls.get("hf_treespec::few_rows_linear") == 4 * 7 + 1, calls
    torch.testing.assert_close(logits.float(), eager.float(), atol=0.15, rtol=0.05)
    prompt = torch.randint(0, 64, (1, MOST_ROWS + 3), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        preallocate(cache, 64)
        with torch.profiler.profile() as profile:
            compiled.prefill(prompt, torch.arange(prompt.shape[1])[None], None, cache, ())
    assert "batch of 1, several rows" in compiled.compile_seconds
    assert "hf_treespec::few_rows_linear" not in {event.key for event in profile.key_averages()}
    compiled.release()


def test_steps_of_few_rows_in_all_have_the_routed_graphs(op):
    """With the op routed, every step of 2 to MOST_ROWS rows in all has a routed graph, batch or not (a batch's
    one-row steps and tree steps too); a batch of one's one-row step and steps of more rows keep inductor's linears.
    The warm-up compiles one count per graph."""
    from hf_treespec.compiled import CompileSettings, CompiledForward

    compiled = CompiledForward(tiny_llama(seed=4).to(torch.bfloat16), CompileSettings.recommended())
    assert compiled.linears is not None
    names = {shape: compiled.graph_name(*shape) for shape in
             [(1, 1), (1, 2), (1, MOST_ROWS), (1, MOST_ROWS + 1), (4, 1), (4, 4), (4, 5), (MOST_ROWS + 1, 1)]}
    assert names == {(1, 1): "batch of 1, one row", (1, 2): "batch of 1, few rows",
                     (1, MOST_ROWS): "batch of 1, few rows", (1, MOST_ROWS + 1): "batch of 1, several rows",
                     (4, 1): "batch, one row, few rows", (4, 4): "batch, few rows", (4, 5): "batch, several rows",
                     (MOST_ROWS + 1, 1): "batch, one row"}
    assert [compiled.graph_name(4, rows) for rows in compiled.warm_up_rows(4)] == [
        "batch, one row, few rows", "batch, several rows", "batch, few rows"]
    assert compiled.warm_up_rows(1) == (1, 8, MOST_ROWS + 8)
    compiled.release()
