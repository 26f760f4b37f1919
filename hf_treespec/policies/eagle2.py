"""EAGLE-2 dynamic beam tree (ALGORITHMS.md section 7): top-k beam per depth, final rerank of all candidates."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from .base import POLICIES, TreePolicy, top_by_score


def add_topk_children(tree: DraftTree, nodes: torch.Tensor, logq: torch.Tensor, k: int) -> tuple[DraftTree, torch.Tensor]:
    """Adds the top-``k`` children of every node in ``nodes``; returns the tree and the new nodes' indices."""
    k = min(k, logq.shape[-1])
    vals, toks = logq.topk(k, dim=-1)
    parents = nodes[:, None].expand(-1, k).reshape(-1)
    start = tree.num_nodes
    tree = tree.add_children(parents, toks.reshape(-1), vals.reshape(-1))
    return tree, torch.arange(start, tree.num_nodes, device=tree.device)


@POLICIES.register("eagle2")
class Eagle2Policy(TreePolicy):
    defaults = {"tree_budget": 60, "tree_depth": 7, "tree_topk": 10}

    def build(self, source, root_token, device) -> DraftTree:
        k, depth, budget = (int(self.params[p]) for p in ("tree_topk", "tree_depth", "tree_budget"))
        tree = DraftTree.root(root_token, device=device)
        frontier = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(depth):
            logq = source.logprobs(tree, frontier)
            tree, new = add_topk_children(tree, frontier, logq, k)
            if new.numel() == 0:  # the drafter has no proposal here
                break
            beam = tree.scores[new].topk(min(k, new.numel())).indices
            frontier = new[beam.sort().values]
        return top_by_score(tree, budget)
