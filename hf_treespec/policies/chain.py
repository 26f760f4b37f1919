"""Single-path drafting: argmax at T=0 (deterministic), a sample from q when sampling (chain speculative sampling)."""

from __future__ import annotations

import torch

from ..tree import DraftTree, Regime
from .base import POLICIES, TreePolicy, draft_greedy_chain


@POLICIES.register("chain")
class ChainPolicy(TreePolicy):
    defaults = {"tree_depth": 5}
    default_verifier = "naive"

    @property
    def is_chain(self) -> bool:
        return True

    def regime_for(self) -> str:
        return Regime.IID if self.do_sample else Regime.DETERMINISTIC

    def build(self, source, root_token, *, context, generator=None) -> DraftTree:
        tree = DraftTree.root(root_token, regime=self.regime_for())
        depth = int(self.params["tree_depth"])
        if not self.do_sample:
            return draft_greedy_chain(source, tree, 0, depth)
        node = torch.zeros(1, dtype=torch.long)
        for _ in range(depth):
            logq = source.logprobs(tree, node)[0]
            if not bool(torch.isfinite(logq).any()):  # the drafter has no proposal here
                break
            q = logq.exp()
            tree = tree.record_draft_probs(node, q[None])
            token = torch.multinomial(q, 1)
            tree = tree.add_children(node, token, logq[token])
            node = torch.tensor([tree.num_nodes - 1])
        return tree
