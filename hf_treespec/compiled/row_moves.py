"""One op that moves a step's kept KV rows in every preallocated buffer of a cache.

Why: after each verification the cache keeps the accepted rows, written right after the committed ones, in every
layer's key and value buffer. Through torch that is two to four small ops per buffer (an index select and a copy,
or an advanced-index read and write): 120-240 dispatches a step for a 30-layer model, host time that the step's
forward does not hide on a small CPU. The op here does every buffer's moves in one call: each moved row is a
contiguous run of ``head size`` values per head, copied with ``memcpy``.

Rows are gathered before any is written, so a move may read a row that another move writes. Only for contiguous
``[batch, heads, capacity, head size]`` CPU buffers (`PreallocatedLayer` s); every other cache keeps the torch ops.
"""

from __future__ import annotations

import functools
import logging

import torch

from .cpp_ops import build, compiler_flags, has_compiler, library_name

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <cstring>
#include <vector>

// buffers: contiguous [B, H, C, D] CPU tensors; move i copies row source[i] of batch row batch[i] to row
// destination[i] of the same batch row, in every head of every buffer
void move_rows(at::TensorList buffers, const at::Tensor& batch, const at::Tensor& source,
               const at::Tensor& destination) {
  TORCH_CHECK(batch.scalar_type() == at::kLong && source.scalar_type() == at::kLong &&
              destination.scalar_type() == at::kLong, "move_rows: int64 indices expected");
  TORCH_CHECK(batch.device().is_cpu() && source.device().is_cpu() && destination.device().is_cpu(),
              "move_rows: host indices expected");
  const auto b = batch.contiguous(), s = source.contiguous(), d = destination.contiguous();
  const int64_t moves = b.numel();
  TORCH_CHECK(s.numel() == moves && d.numel() == moves, "move_rows: one source and one destination per move");
  const int64_t *bp = b.data_ptr<int64_t>(), *sp = s.data_ptr<int64_t>(), *dp = d.data_ptr<int64_t>();
  std::vector<char> scratch;
  for (const at::Tensor& buffer : buffers) {
    TORCH_CHECK(buffer.device().is_cpu() && buffer.dim() == 4 && buffer.is_contiguous(),
                "move_rows: contiguous 4D CPU buffers expected");
    const int64_t B = buffer.size(0), H = buffer.size(1), C = buffer.size(2);
    const int64_t row = buffer.size(3) * buffer.element_size();
    char* base = static_cast<char*>(buffer.data_ptr());
    scratch.resize(static_cast<size_t>(moves * H * row));
    for (int64_t i = 0; i < moves; ++i) {
      TORCH_CHECK(bp[i] >= 0 && bp[i] < B && sp[i] >= 0 && sp[i] < C && dp[i] >= 0 && dp[i] < C,
                  "move_rows: a move outside the buffer");
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(scratch.data() + (i * H + h) * row, base + ((bp[i] * H + h) * C + sp[i]) * row, row);
    }
    for (int64_t i = 0; i < moves; ++i)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(base + ((bp[i] * H + h) * C + dp[i]) * row, scratch.data() + (i * H + h) * row, row);
  }
}

TORCH_LIBRARY_FRAGMENT(hf_treespec, m) {
  m.def("move_rows(Tensor(a!)[] buffers, Tensor batch, Tensor source, Tensor destination) -> ()");
  m.impl("move_rows", c10::DispatchKey::CPU, &move_rows);
}
"""

PREFIX = "hf_treespec_row_moves"


@functools.lru_cache(maxsize=1)
def load_move_rows():
    """``torch.ops.hf_treespec.move_rows`` (built on first use in this machine's cache), or None without a compiler
    or where the build fails (one warning: the cache edits keep their torch ops, the same rows kept)."""
    if not has_compiler():
        return None
    flags = compiler_flags()
    failure = build(library_name(PREFIX, SOURCE, flags), SOURCE, flags, "the KV row moves", logger)
    if failure is not None:
        logger.warning("hf_treespec: the KV row moves could not be built (%s); cache edits keep torch's ops (the "
                       "same rows kept, more host time a step).", failure)
        return None
    return torch.ops.hf_treespec.move_rows


def moves_in_one_op(buffers: list[torch.Tensor]) -> bool:
    """Whether the op serves ``buffers``: contiguous 4D CPU tensors, and the op is built here."""
    return (bool(buffers) and all(b.device.type == "cpu" and b.dim() == 4 and b.is_contiguous() for b in buffers)
            and load_move_rows() is not None)


def move_rows(buffers: list[torch.Tensor], batch: torch.Tensor, source: torch.Tensor, destination: torch.Tensor
              ) -> None:
    """Row ``source[i]`` of batch row ``batch[i]`` copied to row ``destination[i]`` in every head of every buffer
    (host int64 indices; every source read before any destination is written), in one op call."""
    load_move_rows()(buffers, batch, source, destination)
