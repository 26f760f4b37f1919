"""Sampled tree whose siblings are drawn without replacement from q (Sequoia / EAGLE-1 style sampling)."""

from __future__ import annotations

import torch

from ..budget import step_budget
from ..randomness import Randomness, support_columns, without_replacement
from ..step_context import StepContext
from ..tree import DraftTree, Regime, to_host
from .base import POLICIES, Draft, Growth, LogprobsRequest, TreePolicy


@POLICIES.register("swor")
class SWORPolicy(TreePolicy):
    """Every expanded node gets k = ``tree_topk`` children drawn without replacement from q (Gumbel-top-k, kept in
    sampling order, which the ``swor`` verifier relies on); at each of l = ``tree_depth`` levels the k new nodes with
    the highest cumulative draft log-prob are expanded next (at most k + (l - 1) k^2 nodes, one draft call per level).

    Choosing which nodes to expand from tokens already drawn keeps the top-down verifiers (``swor``, ``nss``) lossless:
    a node's children are still a fresh sample given everything above them.
    """

    defaults = {"tree_topk": 4, "tree_depth": 5, "tree_budget": None}
    supports_auto = True
    auto_only = frozenset({"tree_budget"})
    regime = Regime.SWOR
    default_verifier = "swor"

    @property
    def is_chain(self) -> bool:
        return int(self.params["tree_topk"]) == 1

    def grow(
        self, root_token: int, *, context: StepContext, capabilities: frozenset[str] = frozenset(),
        generator: Randomness = None,
    ) -> Growth:
        k, depth = int(self.params["tree_topk"]), int(self.params["tree_depth"])
        tree = DraftTree.root(root_token, regime=self.regime)
        chosen = None
        sizer = step_budget(context, self.params.get("tree_budget"), self.name)
        if sizer is not None:  # (k, l) per step from the step's budget, the kwargs as upper bounds; None: no drafts
            chosen = sizer.choose_shape(lambda k, d: k + (d - 1) * k * k, k, depth)
            if chosen is None:
                return Draft(tree)
            k, depth = chosen
        frontier = torch.zeros(1, dtype=torch.long)
        for level in range(depth):
            logq = yield LogprobsRequest(tree, frontier)
            probs = logq.exp()
            support = support_columns(probs)  # q's positive columns, found once for the draws and the walk
            if self.do_sample:
                tree = tree.record_draft_probs(frontier, probs, support)
            tokens, valid = to_host(*without_replacement(probs, k, generator, support))  # to the host tree
            rows = torch.arange(frontier.numel())[:, None].expand_as(tokens)[valid]
            tokens = tokens[valid]
            start = tree.num_nodes
            tree = tree.add_children(frontier[rows], tokens, logq[rows, tokens])
            if level + 1 < depth:
                new = torch.arange(start, tree.num_nodes)
                frontier = new[tree.scores[new].topk(min(k, new.numel())).indices.sort().values]
        return Draft(tree, chosen)
