"""Optimal tree search (SpecExec) and SALF: Algorithm 2 of the SALF & TALF paper.

A capacity-N queue Q of unexpanded nodes and the output tree G. Each iteration pops the B best nodes of Q into G,
drops those that cannot stay in G (pr <= min pr of a full G), stops when what is left sums below ``th`` (SALF;
th = 0 is the optimal search), and expands the rest in one batched draft forward.

With ``tree_budget="auto"`` the step's `StepBudget` (``context.budget``, from the decoding loop's sizing) replaces both
N and th: the search keeps expanding while the budget says the next expansions can still pay, then keeps the prefix
of G the budget prunes to (possibly the root alone). SALF and optimal search are then the same policy.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree
from ..budget import AUTO, step_budget
from .base import POLICIES, Draft, Growth, TreePolicy, topk_children


@POLICIES.register("salf")
class SALFPolicy(TreePolicy):
    defaults = {"tree_budget": AUTO, "tree_depth": None, "salf_batch": 10, "salf_threshold": 0.6}
    supports_auto = True

    def validate(self) -> None:
        super().validate()
        if int(self.params["salf_batch"]) < 1:
            raise ValueError(f"salf_batch must be >= 1, got {self.params['salf_batch']}.")
        th = float(self.params["salf_threshold"])
        if not 0 <= th < 1:
            raise ValueError(f"salf_threshold must be in [0, 1), got {th}.")

    def grow(self, root_token, *, context, capabilities=frozenset(), generator=None) -> Growth:
        device = torch.device("cpu")  # trees are host bookkeeping (see DraftTree)
        sizer = step_budget(context, self.params.get("tree_budget"), self.name)
        tree = DraftTree.root(root_token, device=device)
        budget = sizer.max_nodes if sizer is not None else int(self.params["tree_budget"])
        capacity = budget + 1  # G holds the root and N draft nodes
        children = capacity if sizer is None else min(capacity, sizer.max_children)
        batch, th = int(self.params["salf_batch"]), float(self.params["salf_threshold"])
        max_depth = self.params["tree_depth"]
        in_g = torch.ones(1, dtype=torch.bool, device=device)  # popped into G
        fresh = torch.ones(1, dtype=torch.bool, device=device)  # popped in the latest iteration (first: the root)
        while True:
            # a full G only admits nodes above its current minimum: the others' children can never enter it
            full = int(in_g.sum()) >= capacity
            candidates = fresh & (tree.scores > tree.scores[in_g].min()) if full else fresh
            if max_depth is not None:
                candidates &= tree.depth < int(max_depth)
            expand = candidates.nonzero().squeeze(-1)
            if expand.numel() == 0:
                break
            if sizer is not None:
                expand = expand[sizer.in_best_prefix(tree, expand, in_g)]
                if expand.numel() == 0 or not sizer.expand_again(tree, expand, in_g):
                    break
            elif float(tree.scores[expand].exp().sum()) < th:
                break
            vals, toks = yield from topk_children(tree, expand, children, capabilities)
            k = vals.shape[-1]
            tree = tree.add_children(expand[:, None].expand(-1, k).reshape(-1), toks.reshape(-1), vals.reshape(-1))
            in_g = _pad(in_g, tree.num_nodes)
            tree, in_g = _prune_queue(tree, in_g, capacity)
            queue = (~in_g).nonzero().squeeze(-1)
            if queue.numel() == 0:
                break
            best = queue[tree.scores[queue].topk(min(batch, queue.numel())).indices]
            in_g[best] = True
            fresh = torch.zeros_like(in_g)
            fresh[best] = True
            tree, in_g, fresh = _cap_g(tree, in_g, fresh, capacity)
        tree = tree.select(in_g.nonzero().squeeze(-1))
        return Draft(sizer.prune(tree) if sizer is not None else tree)


def _pad(mask: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([mask, mask.new_zeros(size - mask.numel())])


def _keep(tree: DraftTree, keep: torch.Tensor, *masks: torch.Tensor):
    """Keeps ``keep`` (bool) closed under parents (orphans can never enter G: their pr <= the dropped parent's)."""
    keep = keep.clone()
    keep[0] = True
    parents = tree.parents.clamp(min=0)
    for _ in range(tree.max_depth):
        keep = keep & (keep[parents] | (tree.parents < 0))
    idx = keep.nonzero().squeeze(-1)
    return (tree.select(idx), *(m[idx] for m in masks))


def _prune_queue(tree: DraftTree, in_g: torch.Tensor, capacity: int):
    """Q has capacity N: keep G plus the ``capacity`` best queued nodes."""
    queued = ~in_g
    if int(queued.sum()) <= capacity:
        return tree, in_g
    scores = torch.where(queued, tree.scores, torch.full_like(tree.scores, float("-inf")))
    keep = in_g.clone()
    keep[scores.topk(capacity).indices] = True
    return _keep(tree, keep, in_g)


def _cap_g(tree: DraftTree, in_g: torch.Tensor, fresh: torch.Tensor, capacity: int):
    """G has capacity N: drop its lowest-scoring nodes (ties to later indices, so parents stay)."""
    if int(in_g.sum()) <= capacity:
        return tree, in_g, fresh
    g = in_g.nonzero().squeeze(-1)
    order = torch.sort(-tree.scores[g], stable=True).indices
    keep = torch.ones_like(in_g)
    keep[g[order[capacity:]]] = False
    return _keep(tree, keep, in_g, fresh)


@POLICIES.register("optimal")
class OptimalPolicy(SALFPolicy):
    """SpecExec's optimal search: SALF with threshold 0 (stops only when no popped node can improve G)."""

    defaults = {**SALFPolicy.defaults, "salf_threshold": 0.0}
