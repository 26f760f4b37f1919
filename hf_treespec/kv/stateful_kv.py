"""`StatefulKV`: the `TargetKV` of one sequence whose cache lives inside an engine (`OpenVINOStep`).

The engine appends every row a forward feeds and cannot drop rows in place. So rejected tree rows stay where they
are, dead: the host keeps one bool per held row (``live``), and every step's mask shows a new row the live rows and
its own ancestors in the tree. The accepted path's rows become live where they lie; their positions (the depth of
each node after the committed tokens) were right when they were computed, so nothing moves. The cost is attention
over dead rows, which the mask zeroes: rows, not weights, so small beside a forward's weight reads at the tree
sizes that pay.
"""

from __future__ import annotations

import torch

from ..attention import additive_mask
from ..tree import DraftTree


class StatefulKV:
    """`TargetKV` of one unpadded prompt over an engine that holds the cache (``engine.held`` rows)."""

    #: `finish` copies the engine's rows out (the loop skips it when the caller never sees the cache)
    copies_out = True

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

    def retire(self, keep: torch.Tensor) -> None:
        """Nothing to move: when its one row finishes, the loop ends."""

    def finish(self, lengths: torch.Tensor) -> None:
        """The caller's cache gets the live rows (the first ``lengths[0] - 1``), as plain decoding leaves it."""
        keep = self.live.nonzero().squeeze(-1)[: int(lengths[0]) - 1]
        for layer, (keys, values) in zip(self.cache.layers, self.engine.cache_rows(keep)):
            layer.keys, layer.values, layer.dtype, layer.device = keys, values, keys.dtype, keys.device
            layer.is_initialized = True
