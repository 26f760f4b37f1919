"""A one-row attention that reads a compiled step's KV buffers in place: a small C++ op, built once per machine.

Why: a compiled one-row step attends with two ATen ``bmm`` s per layer, and ``bmm`` first copies the rows it reads
(the transposed keys, then the values: their batch stride is the buffer's capacity, not the used length). On a
2-core EPYC (SmolLM2-135M, bf16) those copies and calls took about 3.6 ms of a 12.6 ms step at context 200 and
about half of the step at 2000 (docs/results/compiled/guard-free-steps). This op computes each query row's
attention over the first ``mask.shape[-1]`` cache rows directly from the buffers (fp32 scores, softmax and sums;
rows in parallel through ATen's thread pool, so it shares torch's threads), with no copy: the one-row step ran
1.24-1.36x faster at contexts 200-2000 (docs/results/compiled/cache-attention).

It serves one-row steps only (plain decoding, `auto`'s draft-free steps): with several rows each row would read
the cache again, where ``bmm`` reads it once for all of them.

`load_cache_attention` builds it with torch's ``load_inline`` (a C++ compiler and ninja; about 40 s on 2 cores, then
cached on disk under a name that carries the source, torch's version and the CPU, so later processes only load it)
and returns None where it cannot be built (one warning, unless there is no C++ compiler at all: compiling the step
then fails and warns once): the compiled step then keeps ``bmm``.
"""

from __future__ import annotations

import functools
import logging

import torch

from .cpp_ops import build, compiler_flags, has_compiler, library_name

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// query [B, H, q, D], key / value [B, H_kv, capacity, D] (rows contiguous), additive mask [B, 1, q, L]:
// out [B, q, H, D] = softmax(query . key[:L] * scale + mask) . value[:L], one query row at a time
template <typename T>
static void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                   double scale, at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t groups = H / key.size(1), L = mask.size(3);
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  const T* mp = mask.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides(), ms = mask.strides(), os = out.strides();
  at::parallel_for(0, B * H * Q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(L), q(D), acc(D);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (H * Q), h = (index / Q) % H, i = index % Q, g = h / groups;
      const T* qrow = qp + b * qs[0] + h * qs[1] + i * qs[2];
      for (int64_t d = 0; d < D; ++d) q[d] = static_cast<float>(qrow[d * qs[3]]) * static_cast<float>(scale);
      const T* keys = kp + b * ks[0] + g * ks[1];
      const T* mrow = mp + b * ms[0] + i * ms[2];
      float top = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        const T* krow = keys + j * ks[2];
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += q[d] * static_cast<float>(krow[d]);
        s += static_cast<float>(mrow[j * ms[3]]);
        scores[j] = s;
        top = s > top ? s : top;
      }
      float total = 0.f;
      for (int64_t j = 0; j < L; ++j) {
        scores[j] = std::exp(scores[j] - top);
        total += scores[j];
      }
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
      const T* values = vp + b * vs[0] + g * vs[1];
      for (int64_t j = 0; j < L; ++j) {
        const T* vrow = values + j * vs[2];
        const float p = scores[j];
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(vrow[d]);
      }
      T* orow = op + b * os[0] + i * os[1] + h * os[2];
      const float inverse = 1.f / total;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[d] * inverse);
    }
  });
}

at::Tensor cache_attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor mask, double scale) {
  TORCH_CHECK(query.device().is_cpu(), "cache_attention runs on the CPU");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4, "4D inputs expected");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "key and value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(query.size(1) % key.size(1) == 0 && mask.size(3) <= key.size(2), "shapes do not match");
  auto out = at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  const auto typed_mask = mask.to(query.scalar_type());
  switch (query.scalar_type()) {
    case at::kFloat: attend<float>(query, key, value, typed_mask, scale, out); break;
    case at::kBFloat16: attend<at::BFloat16>(query, key, value, typed_mask, scale, out); break;
    case at::kHalf: attend<at::Half>(query, key, value, typed_mask, scale, out); break;
    default: TORCH_CHECK(false, "cache_attention takes float32, bfloat16 or float16");
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(hf_treespec, m) {
  m.def("cache_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
  m.impl("cache_attention", c10::DispatchKey::CPU, &cache_attention);
}
"""

#: the library's name before the hash of what it is built from
PREFIX = "hf_treespec_cache_attention"


def build_flags() -> list[str]:
    """The compiler flags (`cpp_ops.compiler_flags`: this CPU's instructions within ATen's ISA cap)."""
    return compiler_flags()


def build_name() -> str:
    """The extension's name: the source, the flags, torch's version and the CPU it is built for (``-march=native``)."""
    return library_name(PREFIX, SOURCE, build_flags())


@functools.lru_cache(maxsize=1)
def load_cache_attention():
    """``torch.ops.hf_treespec.cache_attention`` (built on first use in this machine's cache), or None: silently
    without a C++ compiler (compiling the step then fails and says so, once), with one warning when the build fails
    (no ninja, a compiler error)."""
    if not has_compiler():  # the compiled step's own fallback warns about it
        logger.info("hf_treespec: no C++ compiler: compiled one-row steps attend with bmm.")
        return None
    failure = build(build_name(), SOURCE, build_flags(), "the one-row cache attention", logger)
    if failure is not None:
        logger.warning("hf_treespec: the one-row cache attention could not be built (%s); compiled one-row steps "
                       "attend with bmm instead (the same tokens, slower at long contexts).", failure)
        return None
    _register_fake()
    return torch.ops.hf_treespec.cache_attention


def _register_fake() -> None:
    """The op's output shape for torch.compile's tracing: ``[B, q, H, D]`` like the query's."""
    @torch.library.register_fake("hf_treespec::cache_attention")
    def _(query, key, value, mask, scale):
        batch, heads, rows, dim = query.shape
        return query.new_empty((batch, rows, heads, dim))
