"""`WarpedDraftSource`: a drafter seen through the target's logits processors (so q is warped like p)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from ..drafters.base import Drafter
from ..policies.base import DraftSource
from ..tree import DraftTree
from .processors import process_tree_logits


class WarpedDraftSource(DraftSource):
    """Implements the policies' `DraftSource`: log-softmax of processed drafter logits, timing included.

    The drafter's fast paths (``Drafter.capabilities``) are declared here only when no logits processor runs: a
    processor may reorder the drafter's scores, and then only the depth-by-depth route through :meth:`logprobs` sees
    the warped ranking. So is its `Drafter.draft_support`.
    """

    def __init__(self, drafter: Drafter, processors: LogitsProcessorList, prefix_ids: torch.Tensor):
        self.drafter = drafter
        self.processors = processors
        self.prefix_ids = prefix_ids
        self.num_forwards = 0
        self.capabilities = frozenset() if len(processors) else drafter.capabilities
        # a processor may give weight outside the drafter's vocabulary (e.g. InfNanRemoveLogitsProcessor's -inf)
        self.support = None if len(processors) else drafter.draft_support

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        return self.warp(tree, nodes, self.drafter.expand(tree, nodes))

    def warp(self, tree: DraftTree, nodes: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """log q from the drafter's raw logits after ``nodes`` (one draft forward, however it ran: alone, or one
        row's share of a batched forward in `hf_treespec.generation.drafting.draft_trees`)."""
        logits = logits.to(self.prefix_ids.device)  # host-side drafters answer on the CPU
        self.num_forwards += 1
        logits = process_tree_logits(self.processors, self.prefix_ids, tree, nodes, logits)
        return torch.log_softmax(logits, dim=-1)

    def greedy_chain(self, tree: DraftTree, node: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's whole-path proposal (see `Drafter.greedy_chain`)."""
        self._check("greedy_chain")
        return self.drafter.greedy_chain(tree, node, length)

    def topk_logprobs(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's sparse top-k children (see `Drafter.topk_logprobs`)."""
        self._check("topk_logprobs")
        return self.drafter.topk_logprobs(tree, nodes, k)

    def _check(self, capability: str) -> None:
        if capability not in self.capabilities:
            reason = "logits processors run" if len(self.processors) else "the drafter does not declare it"
            raise RuntimeError(f"the draft source does not offer {capability!r} ({reason}); check "
                               "source.capabilities first.")
        self.num_forwards += 1
