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
