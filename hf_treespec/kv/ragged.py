"""`RaggedKV`: one target `DynamicCache` for a batch whose rows commit different numbers of tokens every step.

Scheme (per-row compaction into a shared width, holes masked): row ``b`` keeps its committed tokens left-aligned in
columns ``[0, lengths[b])`` (the prompt's left padding included, masked by ``prompt_mask``); columns
``[lengths[b], width)`` are holes that no query attends to. A step appends every row's tree (packed to the widest
tree, padding nodes masked) at columns ``[width, width + N)``; after verification each row's accepted rows are moved
down to ``lengths[b]...`` with one advanced-indexing copy per layer (only the accepted rows move: O(accepted), never a
copy of the whole cache), and the cache is cut back to the new widest row with a view, as ``DynamicCache.crop`` does.

Cost: memory ``batch x (longest row + N)`` per layer, the same as plain batched ``generate`` plus one tree; a row
that lags the longest by ``h`` tokens carries ``h`` masked hole columns, filled again as it catches up. Time: one
index copy of ``sum(accepted)`` rows per layer per step. Finished rows leave the batch (``retire``) so they stop
costing compute; ``finish`` lays every row out again as ``sequences[:, :-1]`` so plain ``generate`` can continue.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..attention import additive_mask
from .tree_kv import buffered_rows, moved_in_one_op, to_device, tree_layers
from .window import TreeWindows
from ..tree import DraftTree, host_longs


def _layers(cache: DynamicCache):
    """The cache's layers that hold rows (`tree_layers`: refused where one cannot drop rejected tree rows)."""
    for layer in tree_layers(cache):
        rows = buffered_rows(layer)
        if rows is None:
            rows = 0 if layer.keys is None else layer.keys.numel()
        if rows:
            yield layer


def packed_trees(trees: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every tree packed to the widest (``n`` nodes), on the host: ``[B, n]`` tokens and depths (0 at padding nodes)
    and the ``[B, n, n]`` visibility among the packed nodes (each node its ancestors, a padding node only itself)."""
    n = max(tree.num_nodes for tree in trees)
    if n == 1:  # every row's root alone (a step where no row drafts): nothing to pack
        ids = torch.cat([tree.tokens for tree in trees])[:, None]
        return ids, torch.zeros_like(ids), torch.ones(len(trees), 1, 1, dtype=torch.bool)
    # tokens and depths from host lists (padding nodes: token 0, depth 0), one tensor each
    pad = [[0] * (n - tree.num_nodes) for tree in trees]
    ids = host_longs([tree.tokens.tolist() + rest for tree, rest in zip(trees, pad)])
    depth = host_longs([tree.depth.tolist() + rest for tree, rest in zip(trees, pad)])
    if all(tree.num_nodes == n for tree in trees):
        return ids, depth, torch.stack([tree.ancestor_mask() for tree in trees])
    among = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for i, tree in enumerate(trees):  # one tensor copy per row: a tree's own mask, never a per-node loop
        m = tree.num_nodes
        among[i, :m, :m] = tree.ancestor_mask()
    return ids, depth, among


class RaggedKV:
    """Bookkeeping of the target cache of a batch (host tensors; the cache itself stays on the model's device).

    Attributes:
        cache: the DynamicCache generate prepared (its layers are edited in place and returned to the caller).
        prompt_mask: ``[B0, L]`` bool, False at left-padding columns of the prompt (all original rows).
        rows: ``[B]`` original row index of each active cache row.
        lengths: ``[B]`` committed tokens in the cache per active row (padding columns of the prompt included).
        windows: the target's sliding windows (`~hf_treespec.kv.window.prepare` made its layers full-length), or None.
    """

    def __init__(self, cache: DynamicCache, prompt_mask: torch.Tensor, windows: TreeWindows | None = None):
        self.cache = cache
        self.windows = windows
        self.prompt_mask = prompt_mask.bool().cpu()
        batch, prompt_len = self.prompt_mask.shape
        self.prompt_len = prompt_len
        self.rows = torch.arange(batch)
        self.lengths = torch.full((batch,), prompt_len, dtype=torch.long)
        self.pads = (~self.prompt_mask).sum(-1)
        self._retired: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        # the widest row's length is read several times a step: kept as an int, not a max and a sync per read
        self._lengths, self._width = value, int(value.max()) if value.numel() else 0

    @property
    def width(self) -> int:
        return self._width

    def positions(self) -> torch.Tensor:
        """``[B]`` position id of each active row's next token (its real tokens so far: padding columns skipped)."""
        return self.lengths - self.pads[self.rows]

    def valid(self) -> torch.Tensor:
        """``[B, width]`` bool: the cache columns each active row attends to."""
        columns = torch.arange(self.width)
        prompt = torch.ones(len(self.rows), self.width, dtype=torch.bool)
        prompt[:, : self.prompt_len] = self.prompt_mask[self.rows]
        return (columns[None] < self.lengths[:, None]) & prompt

    def step_inputs(self, trees: list[DraftTree], dtype: torch.dtype, device: torch.device, explicit_masks: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
        """``input_ids`` / ``position_ids`` ``[B, N]`` and the additive 4D mask ``[B, 1, N, width + N]`` feeding every
        active row's tree (row i of ``trees`` for active row i), packed to the widest tree ``N``, on ``device`` in
        one copy (the mask travels as bools). A padding node sees only itself (no fully masked query row) and no
        real node sees it. Sliding windows (`TreeWindows`) are applied per row over position ids: left padding
        comes first, so two real tokens are as far apart in positions as in cache columns, as plain batched
        ``generate`` counts the window. The mask is always explicit (padding and holes)."""
        ids, depth, among = packed_trees(trees)
        width, n = self.width, ids.shape[1]
        visible = torch.zeros(len(trees), n, width + n, dtype=torch.bool)
        visible[:, :, :width] = self.valid()[:, None, :]
        visible[:, :, width:] = among
        positions = self.positions()[:, None] + depth
        if self.windows is None:
            ids, positions, visible = to_device(device, ids, positions, visible)
            return ids, positions, additive_mask(visible, dtype)[:, None]
        columns = torch.arange(width)[None] - self.pads[self.rows][:, None]  # a cache column's position id
        keys = torch.cat([columns, positions], dim=1)
        ids, positions, visible, keys = to_device(device, ids, positions, visible, keys)
        return ids, positions, self.windows.masks(additive_mask(visible, dtype)[:, None], positions, keys)

    def commit(self, accepted: list[torch.Tensor]) -> None:
        """After a forward that appended every active row's tree past the old width: keeps each active row's accepted path (node
        indices, root first) right after its committed tokens, then cuts the cache to the longest row."""
        # the moves worked out on host lists (a step's few accepted rows), as tensors only for the rows that move
        paths, lengths, width = [a.tolist() for a in accepted], self.lengths.tolist(), self.width
        moving = [(row, lengths[row] + i, width + node) for row, path in enumerate(paths)
                  for i, node in enumerate(path) if lengths[row] + i != width + node]
        self.lengths = host_longs([length + len(path) for length, path in zip(lengths, paths)])
        new_width = self.width
        any_moves = bool(moving)
        layers = list(_layers(self.cache))
        if any_moves:
            batch_idx, destination, source = (host_longs(list(column)) for column in zip(*moving))
            if moved_in_one_op(layers, batch_idx, source, destination):
                any_moves = False  # every layer's rows moved: the layers below are only cut
        indices: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # moved once per device, not once per layer
        for layer in layers:
            buffered = buffered_rows(layer) is not None  # moved in its buffers, cut by a count
            keys, values = (layer.key_buffer, layer.value_buffer) if buffered else (layer.keys, layer.values)
            if any_moves:
                device = keys.device
                if device not in indices:
                    indices[device] = to_device(device, batch_idx, destination, source)
                b, dst, src = indices[device]
                keys[b, :, dst] = keys[b, :, src]
                values[b, :, dst] = values[b, :, src]
            if buffered:
                layer.view_rows(new_width)
            else:
                layer.keys, layer.values = keys[..., :new_width, :], values[..., :new_width, :]

    def retire(self, keep: torch.Tensor) -> None:
        """Drops the active rows not in ``keep`` (bool ``[B]``) from the cache; their committed KV is set aside for
        `finish`. When no row is kept (the batch is done) nothing moves: `finish` lays the cache out as it is."""
        if bool(keep.all()) or not bool(keep.any()):
            return
        gone = (~keep).nonzero().squeeze(-1).tolist()
        layers = list(_layers(self.cache))
        for i in gone:
            length = int(self.lengths[i])
            self._retired[int(self.rows[i])] = [
                (layer.keys[i : i + 1, :, :length].clone(), layer.values[i : i + 1, :, :length].clone())
                for layer in layers
            ]
        kept = keep.nonzero().squeeze(-1)
        self.rows, self.lengths = self.rows[kept], self.lengths[kept]
        if kept.numel():
            new_width = self.width
            on_device: dict[torch.device, torch.Tensor] = {}  # moved once per device, not once per layer
            for layer in layers:
                if layer.keys.device not in on_device:
                    on_device[layer.keys.device] = kept.to(layer.keys.device)
                index = on_device[layer.keys.device]
                layer.keys = layer.keys.index_select(0, index)[..., :new_width, :]
                layer.values = layer.values.index_select(0, index)[..., :new_width, :]

    def finish(self, final_lengths: torch.Tensor) -> None:
        """Lays every original row out as its output sequence minus the last token (``final_lengths[b] - 1``
        columns, as plain ``generate`` leaves its cache), holes zero-filled, so a caller can continue with plain
        ``generate`` (pass an ``attention_mask`` with zeros at the holes and padding)."""
        active = {int(r): i for i, r in enumerate(self.rows)}
        keep = (final_lengths - 1).clamp(min=0)
        width = int(keep.max())
        if not self._retired and torch.equal(self.rows, torch.arange(len(final_lengths))):
            # every row still in the cache, in order (no row retired): already laid out; cut and zero the holes
            holes = (torch.arange(width)[None] >= keep[:, None])[:, None, :, None]
            on_device: dict[torch.device, torch.Tensor] = {}  # moved once per device, not once per layer
            for layer in _layers(self.cache):
                if layer.keys.device not in on_device:
                    on_device[layer.keys.device] = holes.to(layer.keys.device)
                where = on_device[layer.keys.device]
                layer.keys = layer.keys[..., :width, :].masked_fill(where, 0)
                layer.values = layer.values[..., :width, :].masked_fill(where, 0)
            return
        for index, layer in enumerate(list(_layers(self.cache))):
            keys = layer.keys.new_zeros((len(final_lengths), layer.keys.shape[1], width, layer.keys.shape[-1]))
            values = layer.values.new_zeros((len(final_lengths), layer.values.shape[1], width, layer.values.shape[-1]))
            for row in range(len(final_lengths)):  # once per generation, not per step
                count = int(keep[row])
                if row in active:
                    i = active[row]
                    source_k, source_v = layer.keys[i : i + 1], layer.values[i : i + 1]
                else:
                    source_k, source_v = self._retired[row][index]
                keys[row, :, :count] = source_k[0, :, :count]
                values[row, :, :count] = source_v[0, :, :count]
            layer.keys, layer.values = keys, values
        self._retired.clear()
