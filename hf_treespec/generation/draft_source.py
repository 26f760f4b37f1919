"""`WarpedDraftSource`: a drafter seen through the target's logits processors (so q is warped like p)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from ..drafters.base import Drafter
from ..policies.base import DraftSource
from ..tree import DraftTree
from .processors import process_tree_logits


def _filters_to_minus_inf(processor) -> bool:
    return processor.filter_value == -math.inf and getattr(processor, "min_tokens_to_keep", 1) == 1


#: warpers (exact class) that, run over some columns of a row that is -inf elsewhere, give those columns the values
#: the vocabulary-wide call gives (up to the rounding of a sum over the row) and leave -inf at -inf, so a reduced
#: draft vocabulary is warped on its own columns. Filters must fill with -inf and keep one token at least (keeping
#: more could keep a different one of tied tokens).
COLUMN_LOCAL: dict[type, Callable[[object], bool]] = {
    lp.TemperatureLogitsWarper: lambda processor: True,
    lp.TopKLogitsWarper: _filters_to_minus_inf,
    lp.TopPLogitsWarper: _filters_to_minus_inf,
    lp.MinPLogitsWarper: _filters_to_minus_inf,
}


def column_local(processors: LogitsProcessorList) -> bool:
    """Whether every processor is a `COLUMN_LOCAL` warper in a setting that keeps it so (an empty list is)."""
    return all(type(p) in COLUMN_LOCAL and COLUMN_LOCAL[type(p)](p) for p in processors)


class WarpedDraftSource(DraftSource):
    """Implements the policies' `DraftSource`: log-softmax of processed drafter logits, timing included.

    The drafter's fast paths (``Drafter.capabilities``) are declared here only when no logits processor runs: a
    processor may reorder the drafter's scores, and then only the depth-by-depth route through :meth:`logprobs` sees
    the warped ranking. Its `Drafter.draft_support` (a reduced vocabulary's columns) is kept when every processor is
    `COLUMN_LOCAL` (sampling's temperature, top-k, top-p, min-p): the warp and the log-softmax then run over those
    columns alone (8192 of SmolLM2's 49152 for the shipped drafter), and the draws and the verifier's walk over the
    positive ones among them.
    """

    def __init__(self, drafter: Drafter, processors: LogitsProcessorList, prefix_ids: torch.Tensor):
        self.drafter = drafter
        self.processors = processors
        self.prefix_ids = prefix_ids
        self.num_forwards = 0
        self.capabilities = frozenset() if len(processors) else drafter.capabilities
        # a processor may give weight outside the drafter's vocabulary (e.g. InfNanRemoveLogitsProcessor's -inf)
        self.support = drafter.draft_support if column_local(processors) else None

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        return self.warp(tree, nodes, self.drafter.expand(tree, nodes))

    def warp(self, tree: DraftTree, nodes: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """log q from the drafter's raw logits after ``nodes`` (one draft forward, however it ran: alone, or one
        row's share of a batched forward in `hf_treespec.generation.drafting.draft_trees`)."""
        logits = logits.to(self.prefix_ids.device)  # host-side drafters answer on the CPU
        self.num_forwards += 1
        columns = self.support
        if columns is None or not len(self.processors):
            logits = process_tree_logits(self.processors, self.prefix_ids, tree, nodes, logits)
            return torch.log_softmax(logits, dim=-1)
        columns = columns.to(logits.device)
        compact = process_tree_logits(self.processors, self.prefix_ids, tree, nodes, logits.index_select(-1, columns))
        return logits.new_full(logits.shape, -math.inf).index_copy_(-1, columns, torch.log_softmax(compact, dim=-1))

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
