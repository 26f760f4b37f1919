"""The cache attention of compiled CPU steps (`hf_treespec.compiled.cache_attention`): the same attention as
`grouped_attention` read from the buffers in place (one row, a tree step's rows, a prompt's chunk), the model's
lean attention switched to it where it builds, and the bmm stand-in with one warning where it does not."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from conftest import tiny_llama

import hf_treespec
from hf_treespec.compiled import attention, cache_attention
from hf_treespec.compiled.attention import IN_PLACE, PREFIX, grouped_attention, use_lean_attention

BUILDABLE = shutil.which("c++") is not None and shutil.which("ninja") is not None


@pytest.fixture
def op():
    if not BUILDABLE:
        pytest.skip("no C++ compiler or ninja here: the op cannot be built (its fallback is tested below)")
    built = cache_attention.load_cache_attention()
    assert built is not None
    return built


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch", [1, 3])
def test_reads_the_buffers_like_grouped_attention(op, dtype, batch, tolerance):
    """Buffers longer than the used rows, a query transposed as the model hands it, masked columns and a padded
    row per batch: the op gives grouped_attention's output."""
    generator = torch.Generator().manual_seed(batch)
    query = torch.randn(batch, 1, 9, 64, generator=generator).to(dtype).transpose(1, 2)  # [B, H, 1, D], strided
    key = torch.randn(batch, 3, 40, 64, generator=generator).to(dtype)
    value = torch.randn(batch, 3, 40, 64, generator=generator).to(dtype)
    mask = torch.zeros(batch, 1, 1, 27, dtype=dtype)
    mask[0, ..., :4] = torch.finfo(dtype).min  # left padding of the first row
    mask[..., 20] = torch.finfo(dtype).min  # a rejected tree row kept in the cache
    out = op(query, key, value, mask, 0.125)
    assert out.shape == (batch, 1, 9, 64) and out.dtype == dtype
    torch.testing.assert_close(out.float(), grouped_attention(query, key, value, mask, 0.125).float(),
                               atol=tolerance, rtol=tolerance)
    unused = key.clone()
    unused[:, :, 27:] = float("nan")  # rows past the mask are never read
    assert not out.isnan().any() and not op(query, unused, value, mask, 0.125).isnan().any()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch,rows,dim,length", [(1, 2, 64, 26), (1, 5, 64, 29), (2, 7, 32, 31), (1, 16, 128, 40),
                                                   (3, 6, 80, 30), (1, 17, 64, 41), (2, 40, 64, 64), (1, 10, 64, 900)])
def test_several_rows_read_the_buffers_like_grouped_attention(op, dtype, tolerance, batch, rows, dim, length):
    """A tree step's rows (blocks of query vectors across lanes up to 16 rows, head sizes 32 / 64 / 128; another
    head size, a prompt's chunk and many rows x keys through bmm): grouped_attention's output under a tree mask, left
    padding and a rejected row, and nothing read past the mask's columns."""
    generator = torch.Generator().manual_seed(rows * dim + batch)
    query = torch.randn(batch, rows, 9, dim, generator=generator).to(dtype).transpose(1, 2)  # strided, as handed
    key = torch.randn(batch, 3, length + 11, dim, generator=generator).to(dtype)
    value = torch.randn(batch, 3, length + 11, dim, generator=generator).to(dtype)
    lowest = torch.finfo(dtype).min
    mask = torch.zeros(batch, 1, rows, length, dtype=dtype)
    mask[..., length - rows:] = torch.where(torch.rand(rows, rows, generator=generator) < 0.5, lowest, 0.0).to(dtype)
    mask[..., length - rows:].diagonal(dim1=-2, dim2=-1).fill_(0)  # every row sees itself (a tree's ancestors vary)
    mask[0, ..., :3] = lowest  # left padding of the first sequence
    mask[..., 10] = lowest  # a rejected tree row kept in the cache
    out = op(query, key, value, mask, dim ** -0.5)
    assert out.shape == (batch, rows, 9, dim) and out.dtype == dtype
    expected = grouped_attention(query.float(), key.float(), value.float(), mask.float(), dim ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    unused = key.clone()
    unused[:, :, length:] = float("nan")
    assert not op(query, unused, value, mask, dim ** -0.5).isnan().any()


def test_a_compiled_cpu_model_attends_with_it(op):
    model = hf_treespec.enable(tiny_llama(seed=2))
    assert use_lean_attention(model)
    assert model.config._attn_implementation == PREFIX + IN_PLACE + "sdpa"


def test_without_a_build_the_bmm_stand_in_serves_with_one_warning(monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("simulated: no C++ compiler found")

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", no_compiler)
    monkeypatch.setattr(cache_attention, "build_name", lambda: "hf_treespec_cache_attention_never_built")
    cache_attention.load_cache_attention.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hf_treespec.compiled.cache_attention"):
            models = [hf_treespec.enable(tiny_llama(seed=seed)) for seed in (2, 3)]
            assert all(use_lean_attention(model) for model in models)
        assert [model.config._attn_implementation for model in models] == [PREFIX + "sdpa"] * 2
        failures = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
        assert len(failures) == 1 and "no C++ compiler" in failures[0]
    finally:
        cache_attention.load_cache_attention.cache_clear()
    assert attention.BASES  # the module stays importable and registered


def test_the_tree_loop_keeps_the_in_place_attention():
    """The loop's check of 4D-mask attention accepts every lean name (a switch back to sdpa would recompile)."""
    from hf_treespec.attention import TREE_MASK_ATTENTION

    assert {PREFIX + prefix + base for prefix in ("", IN_PLACE) for base in attention.BASES} <= set(
        TREE_MASK_ATTENTION)


def test_without_a_compiler_it_stays_silent(monkeypatch, caplog):
    """No C++ compiler: compiling the step itself fails and warns once (test_compiled), so the op adds no warning."""
    monkeypatch.setenv("CXX", "no-such-compiler-hf-treespec")
    cache_attention.load_cache_attention.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hf_treespec.compiled.cache_attention"):
            assert cache_attention.load_cache_attention() is None
        assert not caplog.records
    finally:
        cache_attention.load_cache_attention.cache_clear()


def test_the_build_keeps_within_atens_isa_cap(monkeypatch):
    """With ATen's vector ISA capped (``ATEN_CPU_CAPABILITY``, as a run standing in for an avx2-only CPU sets it),
    the op is built without the instructions the cap leaves out, under a name of its own."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    native = cache_attention.build_name()
    assert "-mno-avx512f" not in cache_attention.build_flags()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "-mno-avx512f" in cache_attention.build_flags()
    assert cache_attention.build_name() != native


def test_the_ops_are_built_to_run_on_torchs_threads(monkeypatch):
    """ATen's ``parallel_for`` in an extension runs its loop on one thread unless the extension is built with OpenMP
    (``load_inline`` adds no such flag): on Linux, where torch runs its threads with OpenMP, the ops' flags ask for
    it."""
    import platform

    from hf_treespec.compiled import cpp_ops

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    expected = torch.backends.openmp.is_available() and platform.system() == "Linux"
    assert ("-fopenmp" in cache_attention.build_flags()) == expected
    monkeypatch.setattr(cpp_ops.platform, "system", lambda: "Darwin")  # Apple's clang has no -fopenmp
    assert "-fopenmp" not in cache_attention.build_flags()
