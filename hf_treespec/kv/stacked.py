"""One drafter forward for several rows that each keep their own `TreeKV` (a batch drafting in lockstep).

Each row of a batch keeps its drafter cache as one `TreeKV` (its own committed prefix, pending chain and tree rows),
so commits, pruning and re-feeds stay per row. For one draft round the rows' caches are stacked into a temporary
``[R, heads, P, dim]`` cache (each row's past right-padded with masked holes to the longest, ``P``), every row's new
tokens are left-padded to the longest request (padding queries attend only to themselves, their outputs are
dropped), the model runs ONE forward with a ``[R, 1, q, P + q]`` float mask, and each row's new KV rows are appended
back to its own cache.

Cost per round: a copy of every row's drafter cache into the stacked one (drafter caches are small: one or a few
layers; one ``cat`` per layer and tensor where the rows' caches are preallocated), plus one forward over ``R x q``
query rows instead of ``R`` forwards of one row each; on a tiny drafter the forward's fixed cost dominates, so a
round costs about one row's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from ..attention import float_mask
from ..tree import host_longs
from .tree_kv import TreeKV, buffered_rows, to_device


@dataclass
class RowRequest:
    """One row's part of a stacked forward, on the host: ``ids`` / ``positions`` ``[q]`` and ``visible``
    ``[q, past + q]`` (columns: the row's cache, then its new tokens) from `TreeKV.host_inputs`."""

    kv: TreeKV
    ids: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor

    @property
    def past(self) -> int:
        return int(self.visible.shape[1] - self.ids.numel())


@dataclass
class StackedInputs:
    """Inputs of the stacked forward, on the model's device; row ``r``'s new tokens are the last ``new[r]`` of the
    query axis (left padding), and its past occupies cache columns ``[0, past[r])`` of ``cache``."""

    ids: torch.Tensor  # [R, q]
    positions: torch.Tensor  # [R, q]
    mask: torch.Tensor  # [R, 1, q, P + q]
    cache: DynamicCache
    past: list[int]
    new: list[int]

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])


def stack_rows(requests: list[RowRequest], dtype: torch.dtype, device: torch.device,
               new_cache: Callable[[int], DynamicCache] | None = None) -> StackedInputs:
    """Pads every row's request to one ``[R, q]`` query block and stacks their caches (see the module docstring)
    into ``new_cache(rows)``, an empty cache for the stacked forward's ``rows`` (past and new; default: a
    ``DynamicCache``; a compiled drafter's: preallocated)."""
    past = [r.past for r in requests]
    new = [int(r.ids.numel()) for r in requests]
    rows, width, longest = len(requests), max(new), max(past)
    # ids and positions left-padded with zeros, from host lists (one tensor each)
    ids = host_longs([[0] * (width - n) + r.ids.tolist() for r, n in zip(requests, new)])
    positions = host_longs([[0] * (width - n) + r.positions.tolist() for r, n in zip(requests, new)])
    visible = torch.zeros(rows, width, longest + width, dtype=torch.bool)
    # padding queries see themselves only; a real query's own column is rewritten below with its new-token block
    visible.diagonal(offset=longest, dim1=1, dim2=2).fill_(True)
    for row, request in enumerate(requests):
        start = width - new[row]
        visible[row, start:, : past[row]] = request.visible[:, : past[row]]
        visible[row, start:, longest + start :] = request.visible[:, past[row] :]
    ids, positions, visible = to_device(device, ids, positions, visible)
    mask = float_mask(visible, dtype)[0, 0][:, None]  # [R, 1, q, P + q]
    stacked = DynamicCache() if new_cache is None else new_cache(longest + width)
    return StackedInputs(ids, positions, mask, stack_caches([r.kv.cache for r in requests], past, longest, stacked),
                         past, new)


def stack_caches(caches: list[DynamicCache], past: list[int], longest: int, stacked: DynamicCache) -> DynamicCache:
    """The empty ``stacked`` filled so that its row ``r`` holds ``caches[r]``'s ``past[r]`` rows, right-padded with
    zeros to ``longest``."""
    if longest == 0:
        return stacked
    if _stacked_from_buffers(caches, longest, stacked):
        return stacked
    fullest = caches[past.index(longest)]
    for index, reference in enumerate(fullest.layers):
        keys = reference.keys.new_zeros(len(caches), reference.keys.shape[1], longest, reference.keys.shape[3])
        values = torch.zeros_like(keys)
        for row, (cache, length) in enumerate(zip(caches, past)):
            if length:
                keys[row, :, :length] = cache.layers[index].keys[0]
                values[row, :, :length] = cache.layers[index].values[0]
        stacked.update(keys, values, index)
    return stacked


def _stacked_from_buffers(caches: list[DynamicCache], longest: int, stacked: DynamicCache) -> bool:
    """`stack_caches` from preallocated rows (a compiled drafter's): each row's buffer's first ``longest`` rows, joined
    by one ``cat`` per layer and tensor instead of a copy per row. A row's rows past its own length are whatever its
    buffer holds there (zeros, or rows it dropped): finite values the stacked mask hides. False (nothing done) where a
    layer is not preallocated or a buffer is shorter than ``longest``."""
    layers = [cache.layers for cache in caches]
    if not all(buffered_rows(layer) is not None and layer.key_buffer.shape[2] >= longest
               for row in layers for layer in row):
        return False
    for index in range(len(layers[0])):
        keys = torch.cat([row[index].key_buffer.narrow(2, 0, longest) for row in layers])
        values = torch.cat([row[index].value_buffer.narrow(2, 0, longest) for row in layers])
        stacked.update(keys, values, index)
    return True


def unstack_new_rows(stacked: StackedInputs, caches: list[DynamicCache]) -> None:
    """Appends each row's new KV rows (the stacked cache's last ``new[r]`` columns of row ``r``) to its own cache."""
    end = stacked.cache.layers[0].keys.shape[2]
    for index, layer in enumerate(stacked.cache.layers):
        for row, cache in enumerate(caches):
            start = end - stacked.new[row]
            cache.update(layer.keys[row : row + 1, :, start:], layer.values[row : row + 1, :, start:], index)
