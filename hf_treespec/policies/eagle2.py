"""EAGLE-2 dynamic beam tree (ALGORITHMS.md section 7): top-k beam per depth, final rerank of all candidates."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from .base import POLICIES, TreePolicy, top_by_score, topk_children


def add_topk_children(tree: DraftTree, nodes: torch.Tensor, vals: torch.Tensor, toks: torch.Tensor
                      ) -> tuple[DraftTree, torch.Tensor]:
    """Adds the children ``toks`` (``[len(nodes), k]``, log-probs ``vals``) of every node in ``nodes``; returns the tree
    and the new nodes' indices."""
    parents = nodes[:, None].expand(-1, toks.shape[-1]).reshape(-1)
    start = tree.num_nodes
    tree = tree.add_children(parents, toks.reshape(-1), vals.reshape(-1))
    return tree, torch.arange(start, tree.num_nodes, device=tree.device)


@POLICIES.register("eagle2")
class Eagle2Policy(TreePolicy):
    defaults = {"tree_budget": 60, "tree_depth": 7, "tree_topk": 10}

    def build(self, source, root_token, *, context, generator=None) -> DraftTree:
        k, depth, budget = (int(self.params[p]) for p in ("tree_topk", "tree_depth", "tree_budget"))
        tree = DraftTree.root(root_token)
        frontier = torch.zeros(1, dtype=torch.long)
        for _ in range(depth):
            tree, new = add_topk_children(tree, frontier, *topk_children(source, tree, frontier, k))
            if new.numel() == 0:  # the drafter has no proposal here
                break
            beam = tree.scores[new].topk(min(k, new.numel())).indices
            frontier = new[beam.sort().values]
        return top_by_score(tree, budget)
