"""`TreeKV`: a DynamicCache laid out as [committed prefix][tree rows of the current step].

Both the target (verification) and classic drafters (expansion) append tree nodes to their cache during a step and
keep only the accepted path's rows afterwards. ``DynamicCache.crop`` only trims from the end, so the accepted rows are
kept with one ``index_select`` per layer. Tree rows are tracked by node *uid*, so policies may prune and reindex the
tree between expansions.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..attention import float_mask
from ..compiled.row_moves import move_rows, moves_in_one_op
from ..tree import DraftTree, host_longs


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host tensors moved to ``device`` in ONE copy: their bytes are packed into one buffer, copied, and viewed back
    (a tree forward's ids, positions, mask and per-node indices would otherwise be several small copies, each a
    host-device round trip on a GPU). Tensors already on ``device`` are returned as they are; on the CPU nothing is
    packed (each ``.to`` is a no-op there; the tests' `SyncCounter` counts the calls in a row as the one copy).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return tuple(t.to(device) for t in tensors)
    if all(t.device == device for t in tensors):
        return tensors
    return unpack(pack(tensors).to(device), tensors)


def pack(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The host bytes of ``tensors``, widest dtype first (so every slice starts aligned for the dtype viewed on it)."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    return torch.cat([tensors[i].detach().cpu().contiguous().reshape(-1).view(torch.uint8) for i in order])


def unpack(buffer: torch.Tensor, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Views of a :func:`pack` buffer (wherever it now lives) with the dtypes and shapes of ``like``."""
    order = sorted(range(len(like)), key=lambda i: -like[i].element_size())
    out: list[torch.Tensor] = [None] * len(like)  # type: ignore[list-item]
    offset = 0
    for i in order:
        size = like[i].numel() * like[i].element_size()
        out[i] = buffer[offset : offset + size].view(like[i].dtype).view(like[i].shape)
        offset += size
    return tuple(out)


def buffered_rows(layer) -> int | None:
    """How many rows a preallocated layer's ``keys`` / ``values`` view of its buffers
    (`hf_treespec.compiled.preallocated.PreallocatedLayer.rows_in_buffers`); None for any other layer, or one holding
    tensors of its own. Editors of the cache read this count and write the buffers: reading ``keys`` makes a view."""
    return getattr(layer, "rows_in_buffers", None)


def keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Keeps the first ``start`` rows and the rows ``start + rows`` (a host list, ascending) of every layer of
    ``cache``, in place.

    Only the kept tree rows are moved (written right after the prefix); the rest is cut with a view, as
    ``DynamicCache.crop`` does, so a step costs O(accepted rows), not a copy of the whole cache. A chain whose
    accepted rows already follow the prefix moves nothing, and a layer that holds exactly the kept rows is untouched.
    Preallocated layers' buffers move in one op call (`hf_treespec.compiled.row_moves`) where it is built.
    """
    count = len(rows)
    in_place = rows == list(range(count))
    rows = host_longs(rows)
    layers = list(tree_layers(cache))
    moved = not in_place and _kept_in_one_op(layers, start, rows)
    sources: dict[torch.device, torch.Tensor] = {}  # the row index, moved once per device (not once per layer)

    def source_on(device: torch.device) -> torch.Tensor:
        if device not in sources:
            sources[device] = (start + rows).to(device)
        return sources[device]

    for layer in layers:
        if buffered_rows(layer) is not None:  # a preallocated layer: its buffers' rows, no views
            layer.keep(start, None if in_place or moved else source_on(layer.key_buffer.device), count)
            continue
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        if in_place and layer.keys.shape[-2] == start + count:
            continue  # every row is kept where it is (a fully accepted chain): nothing to move or cut
        if not in_place:
            source = source_on(layer.keys.device)
            layer.keys[..., start : start + count, :] = layer.keys.index_select(-2, source)
            layer.values[..., start : start + count, :] = layer.values.index_select(-2, source)
        layer.keys = layer.keys[..., : start + count, :]
        layer.values = layer.values[..., : start + count, :]


def tree_layers(cache: DynamicCache):
    """The cache's layers, refused (before any is edited) where one cannot drop rejected tree rows."""
    for layer in cache.layers:
        # (a preallocated layer has keys; asking it would make a view of its buffer, 30 a step for SmolLM2)
        if getattr(layer, "is_sliding", False) or (buffered_rows(layer) is None and not hasattr(layer, "keys")):
            raise ValueError(
                f"tree speculation needs a plain DynamicCache; got a {type(layer).__name__} layer "
                "(sliding-window / static caches cannot drop rejected tree rows)."
            )
        yield layer


def moved_in_one_op(layers: list, batch: torch.Tensor, source: torch.Tensor, destination: torch.Tensor) -> bool:
    """Row ``source[i]`` of batch row ``batch[i]`` moved to row ``destination[i]`` in every layer's buffers by one
    op call (`hf_treespec.compiled.row_moves`), where every layer is preallocated and the op serves its buffers;
    False otherwise (nothing moved: the layers move their own rows)."""
    if not layers or not all(buffered_rows(layer) is not None for layer in layers):
        return False
    buffers = [buffer for layer in layers for buffer in (layer.key_buffer, layer.value_buffer)]
    if not moves_in_one_op(buffers):
        return False
    move_rows(buffers, batch, source, destination)
    return True


def _kept_in_one_op(layers: list, start: int, rows: torch.Tensor) -> bool:
    """`keep_rows`' moves (the rows ``start + rows`` to ``start...``, each batch row alike) by `moved_in_one_op`."""
    if not layers or buffered_rows(layers[0]) is None:
        return False
    batch, count = layers[0].key_buffer.shape[0], int(rows.numel())
    return moved_in_one_op(layers, torch.arange(batch).repeat_interleave(count), (start + rows).repeat(batch),
                           torch.arange(start, start + count).repeat(batch))


class TreeKV:
    """Bookkeeping for one model's cache while a tree is drafted or verified.

    Attributes:
        cache: the DynamicCache.
        committed: rows of committed tokens held in the cache (everything before the tree region).
        pending: committed tokens not yet in the cache (fed, as a causal chain, before the next tree nodes).
    """

    def __init__(self, cache: DynamicCache, committed: int = 0):
        self.cache = cache
        self.committed = committed
        self.pending = torch.zeros(0, dtype=torch.long)
        # uid of each tree row, in cache order: a host list (a step's few rows are bookkeeping, not tensor work)
        self._row_uids: list[int] = []

    @property
    def root_position(self) -> int:
        """Position id of the tree root (= number of committed tokens before it)."""
        return self.committed + int(self.pending.numel())

    @property
    def holds_only_committed(self) -> bool:
        """Whether the cache holds exactly the committed tokens (no tree rows, nothing pending): the next token can
        then be fed with plain causal attention, as ``generate`` feeds it."""
        return not self.pending.numel() and not self._row_uids

    @property
    def holds_no_tree_rows(self) -> bool:
        """Whether no tree row was fed since the last commit (the cache holds committed rows only)."""
        return not self._row_uids

    def append_committed(self, count: int) -> None:
        """Records ``count`` committed tokens appended to the cache by a plain causal forward."""
        if not self.holds_only_committed:
            raise RuntimeError("a plain causal forward needs a cache of committed rows only (no tree rows / pending)")
        self.committed += count

    def _row_index(self, tree: DraftTree) -> list[int]:
        """Current tree index of every tree row's node, -1 where that node was pruned away."""
        where = {uid: index for index, uid in enumerate(tree.uids.tolist())}
        return [where.get(uid, -1) for uid in self._row_uids]

    def inputs_for(
        self, tree: DraftTree, nodes: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None,
        extra: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor, ...]:
        """``input_ids``, ``position_ids`` ``[1, q]`` and the 4D float mask to feed pending tokens + ``nodes``, on
        ``device`` (default: the host), followed by the host tensors ``extra`` moved along in the same single copy.
        Built on the host (`host_inputs`); the float mask is made on the device from the copied bools."""
        ids, positions, visible = self.host_inputs(tree, nodes)
        ids, positions, visible, *extra = to_device(device or tree.device, ids[None], positions[None], visible, *extra)
        return (ids, positions, float_mask(visible, dtype), *extra)

    def host_inputs(self, tree: DraftTree, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host ``ids`` and ``positions`` ``[q]`` of the pending tokens + ``nodes``, and their bool visibility
        ``[q, past + q]`` over the cache's rows (``past`` = committed + tree rows) followed by the new tokens."""
        nodes = nodes.cpu()
        listed = nodes.tolist()
        num_pending, num_rows, num_new = int(self.pending.numel()), len(self._row_uids), len(listed)
        if num_pending and num_rows:
            raise RuntimeError("pending tokens must be fed before any tree row")
        # columns: committed rows | pending chain | earlier tree rows | new nodes
        c0, c1 = self.committed, self.committed + num_pending
        visible = torch.zeros(num_pending + num_new, c1 + num_rows + num_new, dtype=torch.bool)
        visible[:, :c1] = True
        if num_pending:  # the chain is causal among itself
            visible[:num_pending, c0:c1].tril_()
        # the tree columns (earlier rows, then the new nodes): the nodes' ancestors, one gather of the mask's columns
        columns = self._row_index(tree) + listed if num_rows else listed
        if num_new:
            anc = tree.ancestor_mask().index_select(0, nodes)
            pruned = [i for i, column in enumerate(columns) if column < 0]
            seen = anc.index_select(1, host_longs([max(column, 0) for column in columns] if pruned else columns))
            if pruned:
                seen[:, pruned] = False
            visible[num_pending:, c1:] = seen
        root, depth = self.root_position, tree.depth.tolist()
        positions = host_longs(list(range(root - num_pending, root)) + [root + depth[node] for node in listed])
        tokens = tree.tokens.index_select(0, nodes)
        return (torch.cat([self.pending, tokens]) if num_pending else tokens), positions, visible

    def key_positions(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """Host position id of every key column of the forward ``inputs_for(tree, nodes)`` builds (committed rows,
        pending chain, earlier tree rows, the new nodes): what a distance-dependent mask (a sliding window) needs. A
        pruned tree row, which no query sees, gets the root's position."""
        before, root, depth = self.committed + int(self.pending.numel()), self.root_position, tree.depth.tolist()
        rows = [root + depth[max(index, 0)] for index in self._row_index(tree)]
        return torch.cat([torch.arange(before), host_longs(rows + [root + depth[n] for n in nodes.tolist()])])

    def fed(self, tree: DraftTree, nodes: torch.Tensor) -> None:
        """Records that pending tokens and ``nodes`` were just appended to the cache."""
        self.committed += int(self.pending.numel())
        self.pending = self.pending[:0]
        uids = tree.uids.tolist()
        self._row_uids += [uids[node] for node in nodes.tolist()]

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Keeps the cache rows of the accepted path (root first); its un-fed tail becomes pending."""
        path = accepted.tolist()
        if self.holds_no_tree_rows:  # nothing of the tree was fed (a draft-free step): the whole path is pending
            self.pending = torch.cat([self.pending, tree.tokens.index_select(0, accepted.cpu())])
            return
        uids = tree.uids.tolist()
        row_of_uid = {uid: row for row, uid in enumerate(self._row_uids)}
        rows = [row_of_uid.get(uids[node], -1) for node in path]
        num_cached = sum(row >= 0 for row in rows)
        if any(row < 0 for row in rows[:num_cached]):
            raise RuntimeError("fed nodes of an accepted path must form a prefix of it")
        keep_rows(self.cache, self.committed, rows[:num_cached])
        self.committed += num_cached
        if num_cached < len(path):
            tail = tree.tokens.index_select(0, host_longs(path[num_cached:]))
            self.pending = torch.cat([self.pending, tail])
        self._row_uids = []
