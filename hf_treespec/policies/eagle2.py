"""EAGLE-2 dynamic beam tree (docs/algorithms.md section 7): top-k beam per depth, final rerank of all candidates."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from ..budget import AUTO, step_budget
from ..tree import top_by_score
from .base import POLICIES, Draft, Growth, TreePolicy, topk_children


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
    defaults = {"tree_budget": AUTO, "tree_depth": 7, "tree_topk": 10}
    supports_auto = True

    def grow(self, root_token, *, context, capabilities=frozenset(), generator=None) -> Growth:
        """With ``tree_budget="auto"`` the beam deepens while the cost rule says the next level can pay, and the final
        rerank keeps what the step's `StepBudget` prunes to (possibly no node: a step without drafts)."""
        device = torch.device("cpu")  # trees are host bookkeeping (see DraftTree)
        sizer = step_budget(context, self.params.get("tree_budget"), self.name)
        tree = DraftTree.root(root_token, device=device)
        k, depth = int(self.params["tree_topk"]), int(self.params["tree_depth"])
        budget = sizer.max_nodes if sizer is not None else int(self.params["tree_budget"])
        frontier = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(depth):
            if sizer is not None and not sizer.expand_again(tree, frontier):
                break
            tree, new = add_topk_children(tree, frontier, *(yield from topk_children(tree, frontier, k, capabilities)))
            if new.numel() == 0:  # the drafter has no proposal here
                break
            beam = tree.scores[new].topk(min(k, new.numel())).indices
            frontier = new[beam.sort().values]
        tree = top_by_score(tree, budget)
        return Draft(sizer.prune(tree) if sizer is not None else tree)
