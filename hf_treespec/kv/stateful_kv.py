"""`StatefulKV`: the `TargetKV` of one sequence whose cache lives inside an engine (`OpenVINOStep`).

The engine appends every row a forward feeds and cannot drop rows in place. So rejected tree rows stay where they
are, dead: the host keeps one bool per held row (``live``), and every step's mask shows a new row the live rows and
its own ancestors in the tree. The accepted path's rows become live where they lie; their positions (the depth of
each node after the committed tokens) were right when they were computed, so nothing moves. The cost is attention
over dead rows, which the mask zeroes: small beside a forward's weight reads for small trees; when they outnumber
the live rows (and `StatefulKV.compact_after`), the engine's cache is compacted in one copy.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from ..attention import additive_mask
from ..tree import DraftTree


class StatefulKV:
    """`TargetKV` of one unpadded prompt over an engine that holds the cache (``engine.held`` rows)."""

    #: dead rows the engine may hold before they are dropped (`OpenVINOStep.compact`), or as many as live rows when
    #: those are more: a 4-node tree leaves ~3 a step, a 60-node DySpec tree ~58
    compact_after = 512

    def __init__(self, engine, cache, prompt_len: int):
        self.engine, self.cache = engine, cache
        self.live = torch.ones(prompt_len, dtype=torch.bool)  # the prompt's rows, fed by the prefill
        self.committed = prompt_len
        self._fed = 0

    def step_inputs(self, trees: list[DraftTree], dtype, device, explicit_masks):
        tree = trees[0]
        nodes = tree.num_nodes
        visible = torch.cat([self.live.expand(nodes, -1), tree.ancestor_mask().cpu()], dim=1)
        ids = tree.tokens.cpu().view(1, nodes)
        positions = (self.committed + tree.depth.cpu()).view(1, nodes)
        self._fed = nodes
        return ids, positions, additive_mask(visible, torch.float32)[None, None]

    def commit(self, accepted: list[torch.Tensor]) -> None:
        path = accepted[0]
        grown = torch.zeros(self.live.shape[0] + self._fed, dtype=torch.bool)
        grown[: self.live.shape[0]] = self.live
        grown[self.live.shape[0] + path] = True
        self.live, self.committed = grown, self.committed + path.numel()
        if self.live.shape[0] - self.committed > max(self.compact_after, self.committed):
            # dead rows past the threshold cost every step's attention more than one copy of the cache
            self.engine.compact(self.live.nonzero().squeeze(-1))
            self.live = torch.ones(self.committed, dtype=torch.bool)

    def retire(self, keep: torch.Tensor) -> None:
        """Nothing to move: when its one row finishes, the loop ends."""

    def finish(self, lengths: torch.Tensor) -> None:
        """The caller's cache gets the live rows (the first ``lengths[0] - 1``), as plain decoding leaves it: read
        from the engine when the caller first reads them (`EngineRowsLayer`), not before."""
        hand_back(self.engine, self.cache, self.live.nonzero().squeeze(-1)[: int(lengths[0]) - 1])


def hand_back(engine, cache, keep: torch.Tensor) -> None:
    """Lays ``cache`` out as the engine's held rows ``keep`` (indices), each layer read from the engine when first
    used (`EngineRowsLayer`): what a decoding loop over an engine returns as ``past_key_values``."""
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
