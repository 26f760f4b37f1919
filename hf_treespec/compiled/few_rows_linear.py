"""A bf16 linear for the few rows of a decoding step, over weights packed for ``avx512_bf16`` dot products.

Why: a compiled step that verifies a tree multiplies 2-16 rows by every weight matrix. Inductor hands such a
dynamic row count to oneDNN, which took most of a five-row step of SmolLM2-135M (bf16, 2-core EPYC) where the
one-row graph's linears stream the same weights at close to the memory's rate. The kernel here reads each weight
once per step for up to six rows at a time: its weights are packed ``[N / 64][K / 2][64][2]`` (pairs along K, the
layout ``vdpbf16ps`` multiplies), each pair of an input row is broadcast, and 6 rows x 64 columns of fp32 sums stay
in registers. On that machine the model's 211 linears took 12.2-13.6 ms for 1-5 rows against 24.0-29.7 ms through
eager ``F.linear``, and steps of 2-8 rows ran 1.08-1.43x faster (docs/results/compiled/few-rows-linear). Past
`MOST_ROWS` rows the op runs ``at::linear``.

The sums are fp32 and rounded to bf16 once, as oneDNN's are (the order of the sums differs). Only on CPUs with
``avx512_bf16`` (and not under an ATen ISA cap below avx512), for bf16 weights with an even input size.

`FewRowsLinears` routes a model's linears to it inside the compiled graphs of steps of few rows in all (a batch of one's
tree steps, a batch's one-row and tree steps; `CompiledForward.graph_name` names them):
forward hooks that return the op's output while torch.compile traces (``torch.compiler.is_compiling``), so the
graph's own linear is dead code and eager forwards are untouched.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .cpp_ops import build, compiler_flags, has_compiler, isa_capped_below_avx512, library_name

logger = logging.getLogger(__name__)

#: rows above which the op hands the product to ``at::linear`` (compute-bound there: oneDNN's blocking wins)
MOST_ROWS = 16

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

constexpr int VECTORS = 4;  // 16-column fp32 vectors per tile
constexpr int COLUMNS = 16 * VECTORS;
constexpr int64_t MOST_ROWS = %(most_rows)d;

// weight [N, K] bf16 -> [ceil(N / 64)][K / 2][64][2], zero padded past N
at::Tensor few_rows_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "a 2D bf16 weight expected");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K %% 2 == 0, "the input size must be even");
  const int64_t tiles = (N + COLUMNS - 1) / COLUMNS;
  auto packed = at::zeros({tiles, K / 2, COLUMNS, 2}, weight.options());
  auto source = weight.contiguous();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(source.data_ptr<at::BFloat16>());
  uint16_t* d = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t t = n / COLUMNS, c = n %% COLUMNS;
      for (int64_t k = 0; k < K; ++k) d[((t * (K / 2) + k / 2) * COLUMNS + c) * 2 + (k %% 2)] = s[n * K + k];
    }
  });
  return packed;
}

// ROWS input rows x one 64-column tile; every loop unrolled, so the sums stay in registers
template <int ROWS>
static inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, uint16_t* out, int64_t N, int64_t valid,
                        const float* bias) {
  __m512 sums[ROWS][VECTORS];
  #pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
    #pragma GCC unroll 4
    for (int j = 0; j < VECTORS; ++j) sums[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512i weights[VECTORS];
    #pragma GCC unroll 4
    for (int j = 0; j < VECTORS; ++j) weights[j] = _mm512_loadu_si512(w + (p * COLUMNS + j * 16) * 2);
    #pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * K + 2 * p, 4);
      const __m512i broadcast = _mm512_set1_epi32(pair);
      #pragma GCC unroll 4
      for (int j = 0; j < VECTORS; ++j)
        sums[i][j] = _mm512_dpbf16_ps(sums[i][j], (__m512bh)broadcast, (__m512bh)weights[j]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
    #pragma GCC unroll 4
    for (int j = 0; j < VECTORS; ++j) {
      const int64_t first = j * 16;
      if (first >= valid) continue;
      const int64_t count = valid - first < 16 ? valid - first : 16;
      const __mmask16 mask = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
      __m512 v = sums[i][j];
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + first));
      _mm256_mask_storeu_epi16(out + i * N + first, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// input [..., K] bf16, weight [N, K] (for more than MOST_ROWS rows), packed from few_rows_pack, bias [N] or None
at::Tensor few_rows_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kBFloat16, "a bf16 CPU input expected");
  const int64_t K = input.size(-1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && packed.size(1) * 2 == K && packed.size(0) * COLUMNS >= N, "shapes do not match");
  const int64_t M = input.numel() / K;
  if (M > MOST_ROWS) return at::linear(input, weight, bias);
  auto x = input.reshape({M, K}).contiguous();
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, input.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::Tensor fp32_bias;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    fp32_bias = bias->to(at::kFloat).contiguous();
    bp = fp32_bias.data_ptr<float>();
  }
  // one thread for a small weight: forking costs about what streaming a couple of hundred KB does
  const int64_t tiles = packed.size(0), grain = tiles * K * COLUMNS * 2 < (1 << 18) ? tiles : 1;
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* w = wp + t * (K / 2) * COLUMNS * 2;
      const int64_t n0 = t * COLUMNS, valid = N - n0 < COLUMNS ? N - n0 : COLUMNS;
      const float* b = bp ? bp + n0 : nullptr;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) tile<6>(xp + m * K, K, w, op + m * N + n0, N, valid, b);
      switch (M - m) {
        case 5: tile<5>(xp + m * K, K, w, op + m * N + n0, N, valid, b); break;
        case 4: tile<4>(xp + m * K, K, w, op + m * N + n0, N, valid, b); break;
        case 3: tile<3>(xp + m * K, K, w, op + m * N + n0, N, valid, b); break;
        case 2: tile<2>(xp + m * K, K, w, op + m * N + n0, N, valid, b); break;
        case 1: tile<1>(xp + m * K, K, w, op + m * N + n0, N, valid, b); break;
        default: break;
      }
    }
  });
  return out.view(sizes);
}

TORCH_LIBRARY_FRAGMENT(hf_treespec, m) {
  m.def("few_rows_pack(Tensor weight) -> Tensor");
  m.def("few_rows_linear(Tensor input, Tensor weight, Tensor packed, Tensor? bias) -> Tensor");
  m.impl("few_rows_pack", c10::DispatchKey::CPU, &few_rows_pack);
  m.impl("few_rows_linear", c10::DispatchKey::CPU, &few_rows_linear);
}
""" % {"most_rows": MOST_ROWS}

PREFIX = "hf_treespec_few_rows_linear"
#: the CPU flag the kernel's dot products need
NEEDS = "avx512_bf16"


def build_name() -> str:
    return library_name(PREFIX, SOURCE, compiler_flags())


def supported() -> bool:
    """Whether this CPU runs the kernel (``avx512_bf16``, no ATen ISA cap below avx512) and a compiler is here."""
    from ..cost.hardware import cpu_flags

    return NEEDS in cpu_flags() and not isa_capped_below_avx512() and has_compiler()


@functools.lru_cache(maxsize=1)
def load_few_rows_linear():
    """``torch.ops.hf_treespec.few_rows_linear`` (built on first use in this machine's cache), or None where the
    CPU cannot run it or the build fails (one warning: the compiled steps keep inductor's linears)."""
    if not supported():
        return None
    failure = build(build_name(), SOURCE, compiler_flags(), "the few-rows bf16 linear", logger)
    if failure is not None:
        logger.warning("hf_treespec: the few-rows bf16 linear could not be built (%s); compiled steps keep "
                       "inductor's linears (the same tokens, slower tree steps).", failure)
        return None
    _register_fake()
    return torch.ops.hf_treespec.few_rows_linear


def _register_fake() -> None:
    """The op's output shape for torch.compile's tracing: the input's with the weight's output size last."""
    @torch.library.register_fake("hf_treespec::few_rows_linear")
    def _(input, weight, packed, bias):
        return input.new_empty((*input.shape[:-1], weight.shape[0]))


def serves(x: torch.Tensor) -> bool:
    """Whether the op serves an input ``x`` ``[batch, rows, K]`` of the graph being traced (`FewRowsLinears.routing`
    chose the graphs: those whose steps have `MOST_ROWS` rows or fewer in all, but a batch of one's one-row step,
    whose graph keeps inductor's own linears: they stream the weights faster for one row than the op, measured when
    a first version routed them too). A 2D input (none in a decoder's steps) keeps the graph's linear."""
    return x.dim() == 3


def _routed(op, packed: torch.Tensor, routing: "FewRowsLinears", module: nn.Linear, args, output):
    """A forward hook: inside a graph being compiled while `routing` routes, the op's output."""
    if not torch.compiler.is_compiling() or not routing.active or not serves(args[0]):
        return None
    return op(args[0], module.weight, packed, module.bias)


@dataclass(eq=False)
class FewRowsLinears:
    """The bf16 linears of ``model`` routed to the few-rows op in compiled graphs (weights packed once, here)."""

    model: nn.Module
    op: object = None
    handles: list = field(default_factory=list)
    #: each routed linear's packed weight
    packed: dict = field(default_factory=dict)
    #: whether a graph traced now gets the op (`routing`, set around every compile by `CompiledForward`)
    active: bool = False

    @contextmanager
    def routing(self, active: bool):
        """Routes the linears of graphs compiled inside the block to the op, or not."""
        before, self.active = self.active, active
        try:
            yield
        finally:
            self.active = before

    @classmethod
    def attach(cls, model: nn.Module) -> "FewRowsLinears | None":
        """Packs and hooks every eligible linear of ``model``; None where the op does not serve it (another dtype
        or device, a CPU without ``avx512_bf16``, a failed build)."""
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16
                   and m.weight.device.type == "cpu" and m.in_features % 2 == 0]
        if not linears:
            return None
        op = load_few_rows_linear()
        if op is None:
            return None
        routed = cls(model, op=op)
        with torch.no_grad():
            for module in linears:
                packed = torch.ops.hf_treespec.few_rows_pack(module.weight.detach())
                routed.packed[module] = packed
                routed.handles.append(module.register_forward_hook(partial(_routed, op, packed, routed)))
        return routed

    def eager(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` outside the graphs, through the op for `MOST_ROWS` rows or fewer (an eager projection of a
        step's few target features took 0.43 ms through ``F.linear`` between two graph calls, 0.26 through the op)."""
        packed = self.packed.get(module)
        if packed is None or x.numel() // x.shape[-1] > MOST_ROWS:
            return module(x)
        return self.op(x, module.weight, packed, module.bias)

    def release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.packed = [], {}
