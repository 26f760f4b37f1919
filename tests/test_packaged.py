"""Compile once per machine (`hf_treespec.compiled.packaged`): a graph's package is built once, loaded by later
processes, keyed by what it depends on, rebuilt when its file is corrupt, and a failed export falls back to
``torch.compile`` with one warning, and without a compiler decoding is eager with one warning; every policy's
greedy rows through packaged graphs equal plain decoding through them (fp32, batch 1 and 4; test_compiled's
``inductor`` tests run the recommended settings, which package, too)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, assert_drafted, confident_classifier, fixed_budget, perturbed_copy, tiny_llama
from transformers import CompileConfig, DynamicCache

import hf_treespec
from hf_treespec.attention import causal_row_mask
from hf_treespec.compat import CACHE_KWARG
from hf_treespec.compiled import CompiledForward, CompileSettings, preallocate, release
from hf_treespec.compiled import packaged
from hf_treespec.compiled.disk_cache import PROVENANCE_FILE, artifact_folder
from hf_treespec.generation.plain import plain_generate

TESTS = Path(__file__).parent


def _step(model, rows: int = 3, context: int = 6):
    """A step's inputs over a preallocated cache holding ``context`` rows."""
    cache = DynamicCache(config=model.config)
    preallocate(cache, 32)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, context, dtype=torch.long), use_cache=True, **{CACHE_KWARG: cache})
    cache.layers[0].slots.index = torch.arange(context, context + rows)
    return (torch.zeros(1, rows, dtype=torch.long), torch.arange(context, context + rows)[None],
            causal_row_mask(rows, context + rows, torch.float32, "cpu"), cache)


def test_the_varying_dimensions_are_dynamic_and_sizes_of_one_static():
    model = tiny_llama(seed=1)
    inputs = packaged._step_inputs(*_step(model, rows=3), {"features": torch.zeros(1, 3, 8)})
    ids, positions, mask, slots, keys, values, extra = packaged._dynamic_shapes(inputs)
    assert set(ids) == set(positions) == {1} and set(mask) == {2, 3} and set(slots) == {0}
    assert all(set(marks) == {2} for marks in keys + values) and set(extra["features"]) == {1}
    one_row = packaged._dynamic_shapes(packaged._step_inputs(*_step(model, rows=1), {}))
    assert one_row[0] == {} and set(one_row[2]) == {3} and one_row[3] == {}


def test_the_key_covers_weights_threads_options_and_graph():
    model = hf_treespec.enable(tiny_llama(seed=1))
    compiled = CompiledForward(model, CompileSettings.recommended())
    key = packaged.package_key(compiled, "batch of 1, one row")
    assert key != packaged.package_key(compiled, "batch of 1, several rows")
    assert key != packaged.package_key(CompiledForward(model, CompileSettings(packaged=True)), "batch of 1, one row")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert key != packaged.package_key(compiled, "batch of 1, one row")
    finally:
        torch.set_num_threads(threads)
    other = hf_treespec.enable(tiny_llama(seed=1))
    assert packaged.package_key(CompiledForward(other, CompileSettings.recommended()), "batch of 1, one row") == key
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1
    assert packaged.package_key(CompiledForward(other, CompileSettings.recommended()), "batch of 1, one row") != key


def test_a_corrupt_package_is_named_removed_and_built_again(monkeypatch, caplog):
    """No compiler here: the build and the load are stood in for; the logic around them is what is tested."""
    model = hf_treespec.enable(tiny_llama(seed=1))
    compiled = CompiledForward(model, CompileSettings.recommended())
    name = "batch of 1, several rows"
    folder = artifact_folder(packaged.KIND, packaged.package_key(compiled, name))
    folder.mkdir(parents=True)
    (folder / packaged.PACKAGE_FILE).write_bytes(b"truncated")
    (folder / PROVENANCE_FILE).write_text(json.dumps({}))
    builds = []

    def build(compiled, graph, inputs, out):
        builds.append(graph)
        (out / packaged.PACKAGE_FILE).write_bytes(b"whole")

    def load(path):
        if Path(path).read_bytes() != b"whole":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        return lambda *inputs: (torch.zeros(1, 3, 64), ())

    monkeypatch.setattr(packaged, "_build", build)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", load)
    ids, positions, mask, cache = _step(model)
    with caplog.at_level(logging.WARNING):
        graph, seconds = packaged.packaged_graph(compiled, name, ids, positions, mask, cache, {})
    assert builds == [name] and seconds is not None and graph.path == folder / packaged.PACKAGE_FILE
    assert any(str(folder) in record.getMessage() and "unusable" in record.getMessage() for record in caplog.records)
    assert (folder / packaged.PACKAGE_FILE).read_bytes() == b"whole"
    graph, seconds = packaged.packaged_graph(compiled, name, ids, positions, mask, cache, {})
    assert builds == [name] and seconds is None  # the second time it is loaded


def test_a_failed_export_compiles_in_process_with_one_warning(monkeypatch, caplog):
    def fail(*args):
        raise RuntimeError("export cannot trace this")

    monkeypatch.setattr(packaged, "_build", fail)
    model = hf_treespec.enable(tiny_llama(seed=2))
    compiled = CompiledForward(model, CompileSettings(backend="eager", packaged=True))
    compiled.settings = CompileSettings(backend="inductor", packaged=True)
    compiled._graph = lambda name: (lambda *args, **kwargs: compiled._forward(*args[:4]))  # torch.compile's stand-in
    ids, positions, mask, cache = _step(model)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        out = compiled(ids, positions, mask, cache)
        expected = model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         **{CACHE_KWARG: _step(model)[3]}).logits
    assert compiled.package_failure == "RuntimeError: export cannot trace this" and compiled.failure is None
    assert sum("packaging the target's forward failed" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(out, expected)


@pytest.mark.slow
def test_a_second_process_loads_the_packages_and_is_ready_in_under_30_s(tmp_path):
    """Issue-grade check of compile once: the first process builds the packages of a tiny model's graphs, the
    second finds them, loads them and decodes the same tokens, ready (imports, model, graphs, first tokens) in
    under 30 s."""
    script = tmp_path / "decode.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        start = time.perf_counter()
        sys.path.insert(0, sys.argv[1])
        import torch
        from conftest import VOCAB, assert_drafted, confident_classifier, fixed_budget, perturbed_copy, tiny_llama
        from transformers import CompileConfig
        import hf_treespec
        from hf_treespec.generation.plain import plain_generate
        model = hf_treespec.enable(tiny_llama(seed=4))
        ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
        out = model.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=plain_generate,
                             compile_config=CompileConfig())
        compiled = next(iter(model._treespec_compiled_forwards.values()))
        print(out[0].tolist(), sorted(compiled._packages), compiled.package_failure, time.perf_counter() - start,
              sep="|")
    """))
    env = {**__import__("os").environ, "HF_TREESPEC_COMPILED_CACHE": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script), str(TESTS)], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append((done.stdout.strip().splitlines()[-1].split("|"), done.stderr))
    (tokens1, graphs1, failure1, _), built_log = runs[0]
    (tokens2, graphs2, failure2, ready2), loaded_log = runs[1]
    assert failure1 == failure2 == "None" and graphs1 == graphs2 and "one row" in graphs1
    assert "into a package" in built_log and "into a package" not in loaded_log  # built once, then loaded
    assert tokens1 == tokens2
    assert float(ready2) < 30


@pytest.mark.slow
def test_the_bench_counts_the_steps_packages_run():
    """Packaged steps never call the module: the bench's counter adds them, so a compiled row's tau is measured; their
    time is summed too."""
    from hf_treespec.benchmark.runner import ForwardCounter
    from hf_treespec.compiled.forward import packaged_time

    model = hf_treespec.enable(tiny_llama(seed=6))
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # compiles (builds the packages) before counting, as the bench warms up
        model.generate(ids, max_new_tokens=2, do_sample=False, custom_generate=plain_generate,
                       compile_config=CompileConfig())
    counts, before = [], packaged_time(model)
    for config in (None, CompileConfig()):
        with ForwardCounter(model) as counter, torch.inference_mode():
            model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=plain_generate,
                           compile_config=config)
        counts.append(counter.count)
    compiled = next(iter(model._treespec_compiled_forwards.values()))
    assert compiled._packages and compiled.packaged_calls >= 9
    assert counts[0] == counts[1] == 10
    assert packaged_time(model) > before  # the packaged steps' own time, which host-time measurements take away


def test_without_a_compiler_decoding_is_eager_with_one_warning(monkeypatch, caplog):
    """No C++ compiler: the package cannot be built, and ``torch.compile`` could not compile either, so the step runs
    eagerly at once (one warning, not one for packaging and another for compiling)."""
    from hf_treespec.compiled import forward

    def fail(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(packaged, "_build", fail)
    monkeypatch.setattr(forward, "has_compiler", lambda: False)
    model = hf_treespec.enable(tiny_llama(seed=2))
    compiled = CompiledForward(model, CompileSettings.recommended())
    ids, positions, mask, cache = _step(model)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        out = compiled(ids, positions, mask, cache)
        expected = model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         **{CACHE_KWARG: _step(model)[3]}).logits
    assert compiled.failure == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    assert compiled.package_failure is None and not compiled._graphs
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        f"hf_treespec: compiling the target's forward failed ({compiled.failure}); decoding with its eager forward "
        "instead (same tokens as eager decoding)."]
    torch.testing.assert_close(out, expected)


class _Loader:
    """A package runner's loader: its call specs and a run that records the flat inputs it was handed."""

    def __init__(self, inputs, outputs):
        from torch.utils import _pytree as pytree

        flat, self.out_spec = pytree.tree_flatten(outputs)
        self.outputs, self.seen = flat, None
        self.specs = (pytree.treespec_dumps(pytree.tree_structure((inputs, {}))), pytree.treespec_dumps(self.out_spec))

    def get_call_spec(self):
        return self.specs

    def boxed_run(self, flat):
        self.seen = flat
        return self.outputs


def test_the_flat_call_hands_the_runner_the_exported_order_and_rebuilds_the_outputs():
    """`FlatCall`: the step's tensors in the order export flattened them (extra by name, as exported); outputs in
    the exported structure; a package exported for another structure keeps the runner's own call."""
    t = [torch.full((1,), float(i)) for i in range(12)]
    inputs = (t[0], t[1], t[2], t[3], [t[4], t[5]], [t[6], t[7]], {"features": t[8], "other": t[9]})
    outputs = ((t[10], t[11]), (t[0],))
    loader = _Loader(inputs, outputs)
    runner = type("Runner", (), {"loader": loader})()
    call = packaged.FlatCall.of(runner, inputs)
    got = call((t[0], t[1], t[2], t[3], [t[4], t[5]], [t[6], t[7]], {"other": t[9], "features": t[8]}))
    assert [int(x) for x in loader.seen] == list(range(10))
    assert got == outputs
    assert packaged.FlatCall.of(runner, inputs[:-1] + ({"features": t[8]},)) is None
    assert packaged.FlatCall.of(object(), inputs) is None


@pytest.fixture(scope="module")
def packaged_pair():
    """A tiny fp32 target whose compiled steps run through packages (built once in the session's cache)."""
    model = hf_treespec.enable(tiny_llama(seed=8))
    yield model, perturbed_copy(model)
    release(model)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", [p for p in hf_treespec.list_policies() if p != "nde"])
def test_every_policy_through_packages_equals_plain_decoding_through_them(packaged_pair, policy, batch):
    """fp32, batch 1 and a left-padded batch of 4: every policy's greedy rows (``nde`` needs its trained selector)
    equal plain decoding through the same packaged graphs, and those equal eager ``generate``."""
    model, drafter = packaged_pair
    lengths = (9, 6, 11, 4)[:batch]
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (batch, width), generator=torch.Generator().manual_seed(batch))
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    common = dict(input_ids=ids * mask, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain = model.generate(custom_generate=plain_generate, compile_config=CompileConfig(), **common)
    extra = {"c2t_classifier": confident_classifier()} if policy == "c2t" else {}
    out = model.generate(assistant_model=drafter, compile_config=CompileConfig(), return_dict_in_generate=True,
                         tree_policy=policy, **fixed_budget(policy), **extra, **common)
    assert_drafted(out)
    compiled = next(iter(model._treespec_compiled_forwards.values()))
    assert compiled._packages and compiled.package_failure is None and compiled.failure is None
    assert all(package.flat is not None for package in compiled._packages.values())  # the flat calls ran
    assert torch.equal(out.sequences, plain)
    assert torch.equal(plain, model.generate(**common))
