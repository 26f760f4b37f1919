"""`WarpedDraftSource`: a drafter seen through the target's logits processors (so q is warped like p)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from ..drafters.base import Drafter
from ..tree import DraftTree
from .processors import process_tree_logits


class WarpedDraftSource:
    """Implements the policies' `DraftSource`: log-softmax of processed drafter logits, timing included."""

    def __init__(self, drafter: Drafter, processors: LogitsProcessorList, prefix_ids: torch.Tensor):
        self.drafter = drafter
        self.processors = processors
        self.prefix_ids = prefix_ids
        self.num_forwards = 0

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        logits = self.drafter.expand(tree, nodes)
        self.num_forwards += 1
        logits = process_tree_logits(self.processors, self.prefix_ids, tree, nodes, logits)
        return torch.log_softmax(logits, dim=-1)

    def greedy_chain(self, tree: DraftTree, node: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drafter's whole-path proposal (see `Drafter.greedy_chain`), or None."""
        return self._unwarped(self.drafter.greedy_chain, tree, node, length)

    def topk_logprobs(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drafter's sparse top-k children (see `Drafter.topk_logprobs`), or None."""
        return self._unwarped(self.drafter.topk_logprobs, tree, nodes, k)

    def _unwarped(self, fast_path, *args):
        """A drafter fast path, offered only when no logits processor runs: a processor may reorder the drafter's
        scores, and then only the depth-by-depth route through :meth:`logprobs` sees the warped ranking."""
        if len(self.processors):
            return None
        result = fast_path(*args)
        if result is not None:
            self.num_forwards += 1
        return result
