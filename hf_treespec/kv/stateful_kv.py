"""`StatefulKV`: the `TargetKV` of a batch whose cache lives inside an engine (`OpenVINOStep`).

The engine appends every row a forward feeds, to every sequence alike, and cannot drop rows in place. So rejected
tree rows stay where they are, dead: the host keeps one bool per held row of each sequence (``live``), and every
step's mask shows a new row its sequence's live rows and its own ancestors in the tree. The accepted path's rows
become live where they lie; their positions (the depth of each node after the committed tokens) were right when
they were computed, so nothing moves. A left-padded prompt's padding, a smaller tree's padding nodes and the rows of
a finished sequence are dead the same way. The cost is attention over dead rows, which the mask zeroes: small beside
a forward's weight reads for small trees; when they outnumber the live rows (and `StatefulKV.compact_after`), the
engine's cache is compacted in one copy.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from ..attention import additive_mask
from ..tree import DraftTree
from .ragged import packed_trees


class StatefulKV:
    """`TargetKV` of the prompts ``prompt_mask`` (``[S, L]``, False at left padding) over an engine that holds the
    cache (``engine.held`` rows per sequence)."""

    #: dead rows the engine may hold before they are dropped (`OpenVINOStep.compact`), or as many as live rows when
    #: those are more: a 4-node tree leaves ~3 a step, a 60-node DySpec tree ~58
    compact_after = 512

    def __init__(self, engine, cache, prompt_mask: torch.Tensor):
        self.engine, self.cache = engine, cache
        self.live = prompt_mask.bool().cpu().clone()  # [S, held]: the prompts' real rows, fed by the prefill
        self.pads = (~self.live).sum(-1)  # the prompts' left padding: zeros in the cache handed back
        self.active = torch.arange(self.live.shape[0])  # the sequences still decoding
        self._fed = 0

    def step_inputs(self, trees: list[DraftTree], dtype, device, explicit_masks):
        """Every active sequence's tree, packed to the widest (``n`` rows); a padding node sees only itself."""
        ids, depth, among = packed_trees(trees)
        live, n = self.live[self.active], ids.shape[1]
        real = torch.arange(n)[None] < torch.tensor([tree.num_nodes for tree in trees])[:, None]
        visible = torch.cat([live[:, None, :] & real[:, :, None], among], dim=2)
        positions = live.sum(-1, keepdim=True) + depth  # real tokens so far: padding and dead rows skipped
        self._fed = n
        return ids, positions, additive_mask(visible, torch.float32)[:, None]

    def commit(self, accepted: list[torch.Tensor]) -> None:
        held = self.live.shape[1]
        grown = torch.zeros(self.live.shape[0], held + self._fed, dtype=torch.bool)
        grown[:, :held] = self.live
        counts = torch.tensor([int(path.numel()) for path in accepted])
        grown[torch.repeat_interleave(self.active, counts), held + torch.cat([p.cpu() for p in accepted])] = True
        self.live = grown
        longest = int(self.live.sum(-1).max())
        if self.live.shape[1] - longest > max(self.compact_after, longest):
            # dead rows past the threshold cost every step's attention more than one copy of the cache
            keep = self._live_rows(longest)
            self.engine.compact(keep)
            self.live = keep >= 0

    def _live_rows(self, width: int) -> torch.Tensor:
        """``[S, width]``: each sequence's first ``width`` live rows (indices, in order), ``-1`` past its last."""
        order = torch.sort((~self.live).to(torch.int8), dim=1, stable=True).indices[:, :width]
        counts = self.live.sum(-1, keepdim=True)
        return order.masked_fill(torch.arange(width)[None] >= counts, -1)

    def retire(self, keep: torch.Tensor) -> None:
        """Finished sequences stay in the engine (their rows are the cache handed back); later steps feed them
        dead rows (`OpenVINOStep.retire`)."""
        self.active = self.active[keep]
        self.engine.retire(keep)

    def finish(self, lengths: torch.Tensor) -> None:
        """The caller's cache gets each sequence's rows of ``sequences[:, :-1]`` (``lengths``: every sequence's), as
        plain decoding leaves it, the prompt's left padding as zeros: read from the engine when the caller first reads
        them (`EngineRowsLayer`), not before."""
        counts = (lengths.cpu() - 1 - self.pads).clamp(min=0)
        rows = self._live_rows(int(counts.max()))
        width = int((self.pads + counts).max())
        keep = torch.full((self.live.shape[0], width), -1, dtype=torch.long)
        for s, (pads, count) in enumerate(zip(self.pads.tolist(), counts.tolist())):  # once per call, not per step
            keep[s, pads : pads + count] = rows[s, :count]
        hand_back(self.engine, self.cache, keep)


def hand_back(engine, cache, keep: torch.Tensor) -> None:
    """Lays ``cache`` out as the engine's held rows ``keep`` (see `OpenVINOStep.cache_rows`), each layer read from the
    engine when first used (`EngineRowsLayer`): what a decoding loop over an engine returns as ``past_key_values``."""
    rows = EngineRows(engine, keep)
    for index in range(len(cache.layers)):
        cache.layers[index] = EngineRowsLayer(rows, index)


class EngineRows:
    """The rows ``keep`` of an engine's cache, copied out at most once: when a layer is first read, or before the
    engine starts its next sequence (`OpenVINOStep.reset` asks every copy still pending). Copying them out costs
    about a millisecond per layer on 2 CPU cores, which a caller who never reads the cache should not pay."""

    def __init__(self, engine, keep: torch.Tensor):
        self.engine, self.keep = engine, keep
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        engine.pending_copies.add(self)

    def load(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.layers is None:
            self.layers = self.engine.cache_rows(self.keep)
            self.engine.pending_copies.discard(self)
        return self.layers


class _EngineTensor:
    """``keys`` or ``values`` of an `EngineRowsLayer`: read from the engine on first access (a get or a set)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        layer._load()
        return getattr(layer, self.slot)

    def __set__(self, layer, value) -> None:
        layer._load()
        setattr(layer, self.slot, value)


class EngineRowsLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are an engine's rows (`EngineRows`), read when first used."""

    keys = _EngineTensor()
    values = _EngineTensor()

    def __init__(self, rows: EngineRows, index: int):
        self._source: tuple[EngineRows, int] | None = None
        super().__init__()
        self._source = (rows, index)
        self.is_initialized = True
        self.device = torch.device("cpu")

    def _load(self) -> None:
        if self._source is not None:
            rows, index = self._source
            self._source = None
            self._keys, self._values = rows.load()[index]
