"""The attention of compiled CPU steps, reading the KV buffers in place: a small C++ op, built once per machine.

Why: a compiled step attending with two ATen ``bmm`` s per layer first copies the rows they read (the transposed
keys, then the values: their batch stride is the buffer's capacity, not the used length). On a 2-core EPYC
(SmolLM2-135M, bf16) those copies and calls took about 3.6 ms of a 12.6 ms one-row step at context 200 and about half
of the step at 2000 (docs/results/compiled/guard-free-steps); in a 5-row tree step, bmm and its copies took about
3.5 ms at context 200. This op attends over the first ``mask.shape[-1]`` cache rows directly from the buffers (fp32
scores, softmax and sums, one rounding at the end), with no copy:

- one query row: row by row (the one-row step ran 1.24-1.36x faster at contexts 200-2000,
  docs/results/compiled/cache-attention);
- 2 to `MOST_ROWS` rows (a tree's verification) on a CPU with avx512f: the query vectors of each KV head (its
  query heads x rows) as the 16 lanes of a vector, so each key row is read once for all of them and its dot
  products need no horizontal sum; the softmax runs across lanes; the values are read once per block of vectors;
- more rows (a prompt's chunk), or without avx512f: two ``bmm`` s over the used rows, as `grouped_attention`.

Work is split across torch's OpenMP threads (the ops are built with ``-fopenmp``: without it ATen's
``parallel_for`` in an extension runs on one thread).

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

#: query rows up to which the op attends row by row (one row) or in blocks of query vectors (several, on a CPU with
#: avx512f); past it (a prompt's chunk) it runs two bmm, which are faster there
MOST_ROWS = 16
#: several rows x keys past which the two bmm take over from the blocks (set from one layer of SmolLM2-135M on a
#: 2-core EPYC, bf16: the two were about even near 8 rows at 1000 keys; the op's times below the bound are in
#: docs/results/compiled/rows-attention, `layer_attention` lines)
MOST_ROW_KEYS = 8192

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

constexpr int64_t MOST_ROWS = %(most_rows)d, MOST_ROW_KEYS = %(most_row_keys)d;

// the data and strides a kernel reads and writes
template <typename T>
struct Operands {
  const T *q, *k, *v, *mask;
  T* out;
  c10::IntArrayRef qs, ks, vs, ms, os;
  Operands(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask_,
           at::Tensor& out_)
      : q(query.data_ptr<T>()), k(key.data_ptr<T>()), v(value.data_ptr<T>()), mask(mask_.data_ptr<T>()),
        out(out_.data_ptr<T>()), qs(query.strides()), ks(key.strides()), vs(value.strides()), ms(mask_.strides()),
        os(out_.strides()) {}
};

// query [B, H, q, D], key / value [B, H_kv, capacity, D] (rows contiguous), additive mask [B, 1, q, L]:
// out [B, q, H, D] = softmax(query . key[:L] * scale + mask) . value[:L], one query row at a time
template <typename T>
static void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                   double scale, at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t groups = H / key.size(1), L = mask.size(3);
  const Operands<T> o(query, key, value, mask, out);
  const T *qp = o.q, *kp = o.k, *vp = o.v, *mp = o.mask;
  T* op = o.out;
  const auto &qs = o.qs, &ks = o.ks, &vs = o.vs, &ms = o.ms, &os = o.os;
  at::parallel_for(0, B * H * Q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(L), q(D), acc(D);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (H * Q), h = (index / Q) %% H, i = index %% Q, g = h / groups;
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

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0 (scores less their maximum), 0 below -87: 2^n p(r), Cephes' polynomial (relative error ~1e-7)
static inline __m512 exp16(__m512 x) {
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

constexpr int KEYS = 8;  // key rows per pass over a block's queries (independent sums)

// scores[j][lane] = scale x (query vector of the lane) . key row j, for a block's 16 query vectors (queries[m]: its
// first element, elements qstride apart; null for an unused lane, which scores 0): the vectors transposed (D x 16
// floats), so a key row's products with all of them are D broadcast multiply-adds and need no horizontal sum
template <typename T, int LANES>
struct KeyScores {
  static constexpr int D = 16 * LANES;

  // R key rows from j: each converted to fp32 once, R independent sums over the transposed vectors
  template <int R>
  static void rows(const float (&transposed)[D][16], const T* keys, int64_t kstride, int64_t j, float* scores) {
    alignas(64) float keys_f[R][D];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < LANES; ++c) _mm512_store_ps(keys_f[r] + 16 * c, load16(keys + (j + r) * kstride + 16 * c));
    __m512 sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 q = _mm512_load_ps(transposed[d]);
      for (int r = 0; r < R; ++r) sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(keys_f[r][d]), q, sums[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + (j + r) * 16, sums[r]);
  }

  static void run(const T* const* queries, int64_t qstride, const T* keys, int64_t kstride, int64_t L, float scale,
                  float* scores) {
    alignas(64) float transposed[D][16];
    for (int m = 0; m < 16; ++m)
      for (int d = 0; d < D; ++d)
        transposed[d][m] = queries[m] ? static_cast<float>(queries[m][d * qstride]) * scale : 0.f;
    int64_t j = 0;
    for (; j + KEYS <= L; j += KEYS) rows<KEYS>(transposed, keys, kstride, j, scores);
    for (; j < L; ++j) rows<1>(transposed, keys, kstride, j, scores);
  }
};

#if defined(__AVX512BF16__)
// bf16 keys on a CPU with avx512_bf16: the vectors transposed as pairs along D (the layout vdpbf16ps multiplies), a
// key row's pairs broadcast straight from the buffer: half the instructions, no conversion of the keys
template <int LANES>
struct KeyScores<at::BFloat16, LANES> {
  static constexpr int PAIRS = 8 * LANES;

  // R key rows from j: R independent sums of pair products, scaled once
  template <int R>
  static void rows(const uint16_t (&pairs)[PAIRS][32], const uint16_t* k, int64_t kstride, int64_t j, __m512 factor,
                   float* scores) {
    __m512 sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; ++p) {
      const __m512i q = _mm512_load_si512(pairs[p]);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, k + (j + r) * kstride + 2 * p, 4);
        sums[r] = _mm512_dpbf16_ps(sums[r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)q);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + (j + r) * 16, _mm512_mul_ps(sums[r], factor));
  }

  static void run(const at::BFloat16* const* queries, int64_t qstride, const at::BFloat16* keys, int64_t kstride,
                  int64_t L, float scale, float* scores) {
    alignas(64) uint16_t pairs[PAIRS][32];
    for (int m = 0; m < 16; ++m)
      for (int d = 0; d < 2 * PAIRS; ++d)
        pairs[d / 2][2 * m + d %% 2] = queries[m] ? queries[m][d * qstride].x : 0;
    const __m512 factor = _mm512_set1_ps(scale);
    const uint16_t* k = reinterpret_cast<const uint16_t*>(keys);
    int64_t j = 0;
    for (; j + KEYS <= L; j += KEYS) rows<KEYS>(pairs, k, kstride, j, factor, scores);
    for (; j < L; ++j) rows<1>(pairs, k, kstride, j, factor, scores);
  }
};
#endif

// Several query rows: the query vectors of one KV head (its groups x q rows), 16 at a time as the lanes of a vector:
// their scores (KeyScores), the softmax across lanes, then the values: BLOCK vectors' D-wide sums in registers, each
// value row read once per block. Every key and value row is read in place.
template <typename T, int LANES>
static void attend_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& mask, double scale, at::Tensor& out) {
  constexpr int D = 16 * LANES;
  constexpr int BLOCK = LANES <= 4 ? 24 / LANES : 16 / LANES;  // vectors whose value sums stay in registers
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), kv_heads = key.size(1);
  const int64_t groups = H / kv_heads, L = mask.size(3), per_head = groups * Q;
  const int64_t blocks = (per_head + 15) / 16;
  const Operands<T> o(query, key, value, mask, out);
  const T *qp = o.q, *kp = o.k, *vp = o.v, *mp = o.mask;
  T* op = o.out;
  const auto &qs = o.qs, &ks = o.ks, &vs = o.vs, &ms = o.ms, &os = o.os;
  at::parallel_for(0, B * kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores((L + 1) * 16);  // [key][lane], and a row that a last block's spare lanes read
    alignas(64) float row[D];
    int64_t heads[16], rows[16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (kv_heads * blocks), g = (task / blocks) %% kv_heads, first = (task %% blocks) * 16;
      const int count = per_head - first < 16 ? static_cast<int>(per_head - first) : 16;
      const T* queries[16];
      for (int m = 0; m < 16; ++m) {
        const bool real = m < count;  // unused lanes score 0 (their sums are never written)
        heads[m] = real ? g * groups + (first + m) / Q : g * groups;
        rows[m] = real ? (first + m) %% Q : 0;
        queries[m] = real ? qp + b * qs[0] + heads[m] * qs[1] + rows[m] * qs[2] : nullptr;
      }
      KeyScores<T, LANES>::run(queries, qs[3], kp + b * ks[0] + g * ks[1], ks[2], L, static_cast<float>(scale),
                               scores.data());
      int64_t j = 0;
      for (int m = 0; m < count; ++m) {
        const T* mrow = mp + b * ms[0] + rows[m] * ms[2];
        for (j = 0; j < L; ++j) scores[j * 16 + m] += static_cast<float>(mrow[j * ms[3]]);
      }
      __m512 top = _mm512_set1_ps(-FLT_MAX);
      for (j = 0; j < L; ++j) top = _mm512_max_ps(top, _mm512_loadu_ps(scores.data() + j * 16));
      __m512 total = _mm512_setzero_ps();
      for (j = 0; j < L; ++j) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + j * 16), top));
        _mm512_storeu_ps(scores.data() + j * 16, e);
        total = _mm512_add_ps(total, e);
      }
      alignas(64) float inverse[16];
      _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_max_ps(total, _mm512_set1_ps(FLT_MIN))));
      const T* values = vp + b * vs[0] + g * vs[1];
      for (int start = 0; start < count; start += BLOCK) {
        __m512 acc[BLOCK][LANES];
        for (int m = 0; m < BLOCK; ++m)
          for (int c = 0; c < LANES; ++c) acc[m][c] = _mm512_setzero_ps();
        for (j = 0; j < L; ++j) {
          const T* vrow = values + j * vs[2];
          __m512 v[LANES];
          for (int c = 0; c < LANES; ++c) v[c] = load16(vrow + 16 * c);
          const float* p = scores.data() + j * 16 + start;
          for (int m = 0; m < BLOCK; ++m) {
            const __m512 weight = _mm512_set1_ps(p[m]);  // lanes past 16 read the next row: never written out
            for (int c = 0; c < LANES; ++c) acc[m][c] = _mm512_fmadd_ps(weight, v[c], acc[m][c]);
          }
        }
        for (int m = 0; m < BLOCK && start + m < count; ++m) {
          const __m512 factor = _mm512_set1_ps(inverse[start + m]);
          for (int c = 0; c < LANES; ++c) _mm512_store_ps(row + 16 * c, _mm512_mul_ps(acc[m][c], factor));
          T* orow = op + b * os[0] + rows[start + m] * os[1] + heads[start + m] * os[2];
          for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(row[d]);
        }
      }
    }
  });
}
#endif

// Many rows (a prompt's chunk): two bmm over the used rows, each KV head read once for its query heads
static at::Tensor attend_many(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& mask, double scale) {
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t kv_heads = key.size(1), groups = H / kv_heads, L = mask.size(3);
  auto grouped = query.reshape({B, kv_heads, groups * Q, D});
  auto scores = at::matmul(grouped, key.narrow(2, 0, L).transpose(-1, -2)).to(at::kFloat) * scale;
  scores = scores.view({B, kv_heads, groups, Q, L}) + mask.to(at::kFloat).unsqueeze(2);
  auto probs = scores.softmax(-1).to(value.scalar_type()).view({B, kv_heads, groups * Q, L});
  return at::matmul(probs, value.narrow(2, 0, L)).view({B, H, Q, D}).transpose(1, 2).contiguous();
}

#if defined(__AVX512F__)
template <typename T>
static bool attend_rows_for(int64_t D, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& mask, double scale, at::Tensor& out) {
  switch (D) {
    case 32: attend_rows<T, 2>(query, key, value, mask, scale, out); return true;
    case 64: attend_rows<T, 4>(query, key, value, mask, scale, out); return true;
    case 128: attend_rows<T, 8>(query, key, value, mask, scale, out); return true;
    default: return false;
  }
}
#endif

at::Tensor cache_attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor mask, double scale) {
  TORCH_CHECK(query.device().is_cpu(), "cache_attention runs on the CPU");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4, "4D inputs expected");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "key and value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(query.size(1) %% key.size(1) == 0 && mask.size(3) <= key.size(2), "shapes do not match");
  const int64_t Q = query.size(2);
  if (Q > MOST_ROWS || (Q > 1 && Q * mask.size(3) > MOST_ROW_KEYS)) return attend_many(query, key, value, mask, scale);
  auto out = at::empty({query.size(0), Q, query.size(1), query.size(3)}, query.options());
  const auto typed_mask = mask.to(query.scalar_type());
  if (Q > 1) {
#if defined(__AVX512F__)
    bool done = false;
    switch (query.scalar_type()) {
      case at::kFloat: done = attend_rows_for<float>(query.size(3), query, key, value, typed_mask, scale, out); break;
      case at::kBFloat16:
        done = attend_rows_for<at::BFloat16>(query.size(3), query, key, value, typed_mask, scale, out); break;
      case at::kHalf: done = attend_rows_for<at::Half>(query.size(3), query, key, value, typed_mask, scale, out); break;
      default: break;
    }
    if (done) return out;
#endif
    return attend_many(query, key, value, mask, scale);
  }
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
""" % {"most_rows": MOST_ROWS, "most_row_keys": MOST_ROW_KEYS}

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
        logger.info("hf_treespec: no C++ compiler: compiled steps attend with bmm.")
        return None
    failure = build(build_name(), SOURCE, build_flags(), "the cache attention", logger)
    if failure is not None:
        logger.warning("hf_treespec: the cache attention could not be built (%s); compiled steps "
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
