"""`TargetKV`: the one interface through which the decoding loop feeds and trims the target's cache, and `OneRowKV`,
its implementation for a single unpadded prompt (`RaggedKV` is the one for a batch).

A step asks the cache for the forward's inputs of every active row's tree (`step_inputs`), then keeps each row's
accepted path (`commit`), drops finished rows (`retire`), and at the end lays the cache out as plain ``generate``
leaves it (`finish`). `OneRowKV` keeps the one-sequence fast path: no padding or hole columns in its mask, and a
root-only tree fed as a plain ``generate`` step (the root alone, causal attention, no mask to build).
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from ..attention import causal_row_mask
from ..tree import DraftTree
from .ragged import RaggedKV
from .stateful_kv import StatefulKV
from .tree_kv import TreeKV, keep_rows, to_device
from .window import TreeWindows, tree_inputs


class TargetKV(Protocol):
    """The target cache of the active rows of a decoding batch (row ``i`` of every list: active row ``i``)."""

    def step_inputs(self, trees: list[DraftTree], dtype: torch.dtype, device: torch.device, explicit_masks: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | dict | None]:
        """``input_ids`` / ``position_ids`` ``[B, N]`` and the attention mask (4D, a dict of 4D masks by layer type
        for a hybrid sliding-window model, or None for a plain causal step when ``explicit_masks`` is False) of ONE
        forward over every row's tree, on ``device`` in one host-device copy."""

    def commit(self, accepted: list[torch.Tensor]) -> None:
        """After that forward: keeps each row's accepted path (host node indices, root first) in the cache."""

    def retire(self, keep: torch.Tensor) -> None:
        """Drops the active rows not in ``keep`` (bool ``[B]``)."""

    def finish(self, lengths: torch.Tensor) -> None:
        """Lays the cache out as the rows' ``sequences[:, :-1]`` (``lengths``: every original row's length)."""


def target_kv(cache: DynamicCache, prompt_mask: torch.Tensor, windows: TreeWindows | None, engine=None
              ) -> TargetKV:
    """`StatefulKV` where an engine holds the cache (``engine.owns_cache``), else `OneRowKV` for one prompt without
    padding, else `RaggedKV`."""
    if getattr(engine, "owns_cache", False):
        return StatefulKV(engine, cache, prompt_mask)
    if prompt_mask.shape[0] == 1 and bool(prompt_mask.all()):
        return OneRowKV(cache, prompt_mask.shape[1], windows)
    return RaggedKV(cache, prompt_mask, windows)


class OneRowKV:
    """`TargetKV` of one unpadded prompt, over `TreeKV` (committed rows, then the step's tree rows)."""

    def __init__(self, cache: DynamicCache, prompt_len: int, windows: TreeWindows | None):
        self.tree_kv = TreeKV(cache, committed=prompt_len)
        self.windows = windows
        self._fed: DraftTree | None = None  # the tree of the last forward; None: a plain step fed the root alone

    def step_inputs(self, trees, dtype, device, explicit_masks):
        tree, kv = trees[0], self.tree_kv
        if tree.num_nodes == 1 and kv.holds_only_committed:  # a plain generate step: the root alone, causal
            self._fed = None
            ids, positions = to_device(device, tree.tokens[:1].view(1, 1), torch.tensor([[kv.committed]]))
            mask = causal_row_mask(1, kv.committed + 1, dtype, device) if explicit_masks else None
            return ids, positions, mask
        nodes = torch.arange(tree.num_nodes)
        inputs = tree_inputs(kv, tree, nodes, dtype, device, self.windows)
        kv.fed(tree, nodes)
        self._fed = tree
        return inputs

    def commit(self, accepted):
        if self._fed is None:
            self.tree_kv.append_committed(1)
        else:
            self.tree_kv.commit(self._fed, accepted[0])

    def retire(self, keep):
        """Nothing to move: when its one row finishes, the loop ends."""

    def finish(self, lengths):
        keep_rows(self.tree_kv.cache, int(lengths[0]) - 1, [])
