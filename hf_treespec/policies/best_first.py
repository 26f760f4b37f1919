"""Optimal tree search (SpecExec) and SALF: Algorithm 2 of the SALF & TALF paper.

A capacity-N queue Q of unexpanded nodes and the output tree G. Each iteration pops the B best nodes of Q into G,
drops those that cannot stay in G (pr <= min pr of a full G), stops when what is left sums below ``th`` (SALF;
th = 0 is the optimal search), and expands the rest in one batched draft forward.

With ``tree_budget="auto"`` the step's `StepBudget` (``context.budget``, from the decoding loop's sizing) replaces both
N and th: the search keeps expanding while the budget says the next expansions can still pay, then keeps the prefix
of G the budget prunes to (possibly the root alone). SALF and optimal search are then the same policy.
"""

from __future__ import annotations

import math

import torch

from ..tree import DraftTree, host_longs
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
        sizer = step_budget(context, self.params.get("tree_budget"), self.name)
        tree = DraftTree.root(root_token)
        budget = sizer.max_nodes if sizer is not None else int(self.params["tree_budget"])
        capacity = budget + 1  # G holds the root and N draft nodes
        children = capacity if sizer is None else min(capacity, sizer.max_children)
        batch, th = int(self.params["salf_batch"]), float(self.params["salf_threshold"])
        max_depth = self.params["tree_depth"]
        search = _Search()
        fresh = [0]  # popped in the latest iteration (first: the root), in index order
        while True:
            # a full G only admits nodes above its current minimum: the others' children can never enter it
            g = search.members()
            candidates = fresh
            if len(g) >= capacity:
                floor = min(search.scores[i] for i in g)
                candidates = [i for i in candidates if search.scores[i] > floor]
            if max_depth is not None:
                candidates = [i for i in candidates if search.depth[i] < int(max_depth)]
            if not candidates:
                break
            expand = host_longs(candidates)
            if sizer is not None:
                members = search.member_mask()
                expand = expand[sizer.in_best_prefix(tree, expand, members)]
                if expand.numel() == 0 or not sizer.expand_again(tree, expand, members):
                    break
            elif sum(math.exp(search.scores[i]) for i in candidates) < th:
                break
            vals, toks = yield from topk_children(tree, expand, children, capabilities)
            k = vals.shape[-1]
            tree = tree.add_children(expand[:, None].expand(-1, k).reshape(-1), toks.reshape(-1), vals.reshape(-1))
            search.grew(tree)
            search.prune_queue(capacity)
            queue = search.queue()
            if not queue:
                break
            fresh = sorted(sorted(queue, key=lambda i: -search.scores[i])[:batch])
            search.pop(fresh)
            search.cap_g(capacity)
            fresh = [i for i in fresh if search.alive[i]]
            if search.dead > max(32, len(search.alive) // 2):  # most of a large tree dropped: compact it
                tree, fresh = search.compact(tree, fresh)
        tree = tree.select(host_longs(search.members()))
        return Draft(sizer.prune(tree) if sizer is not None else tree)


class _Search:
    """Algorithm 2's queue Q and output tree G over a growing tree's nodes, in Python lists (a tree has tens of nodes;
    tensor ops on a few elements cost ~2-5 us each on a CPU, list ops ~0.1 us). Nodes are never removed from the
    tree during the search: a node dropped from Q or G is marked dead with its subtree, and the policy selects G at
    the end (the same tree, in the same order, as removing them at once)."""

    def __init__(self):
        self.scores, self.parents, self.depth = [0.0], [-1], [0]
        self.in_g, self.alive = [True], [True]

    def grew(self, tree: DraftTree) -> None:
        """The nodes ``tree`` appended since the last call join Q."""
        start = len(self.scores)
        parents = tree.parents[start:].tolist()
        self.scores += tree.scores[start:].tolist()
        self.parents += parents
        self.depth += [self.depth[parent] + 1 for parent in parents]
        self.in_g += [False] * len(parents)
        self.alive += [True] * len(parents)

    def members(self) -> list[int]:
        """G's nodes, in index order."""
        return [i for i, (in_g, alive) in enumerate(zip(self.in_g, self.alive)) if in_g and alive]

    def member_mask(self) -> torch.Tensor:
        return torch.tensor([in_g and alive for in_g, alive in zip(self.in_g, self.alive)])

    def queue(self) -> list[int]:
        return [i for i, (in_g, alive) in enumerate(zip(self.in_g, self.alive)) if alive and not in_g]

    def pop(self, nodes: list[int]) -> None:
        for i in nodes:
            self.in_g[i] = True

    def prune_queue(self, capacity: int) -> None:
        """Q has capacity N: keep G plus the ``capacity`` best queued nodes."""
        queued = self.queue()
        if len(queued) > capacity:
            self._keep_only(set(queued) - set(sorted(queued, key=lambda i: -self.scores[i])[:capacity]))

    def cap_g(self, capacity: int) -> None:
        """G has capacity N: drop its lowest-scoring nodes (ties to later indices, so parents stay)."""
        g = self.members()
        if len(g) > capacity:
            self._keep_only(set(sorted(g, key=lambda i: -self.scores[i])[capacity:]))

    @property
    def dead(self) -> int:
        return len(self.alive) - sum(self.alive)

    def compact(self, tree: DraftTree, fresh: list[int]) -> tuple[DraftTree, list[int]]:
        """``tree`` without its dead nodes, and ``fresh`` renumbered to match (the search's lists too)."""
        live = [i for i, alive in enumerate(self.alive) if alive]
        index = {old: new for new, old in enumerate(live)}
        self.scores = [self.scores[i] for i in live]
        self.parents = [-1] + [index[self.parents[i]] for i in live[1:]]
        self.depth = [self.depth[i] for i in live]
        self.in_g = [self.in_g[i] for i in live]
        self.alive = [True] * len(live)
        return tree.select(host_longs(live)), [index[i] for i in fresh]

    def _keep_only(self, dropped: set[int]) -> None:
        """Drops ``dropped`` and every node below them (orphans can never enter G: their pr <= the dropped
        parent's); parents precede their children, so one pass in index order closes the set."""
        for i in range(1, len(self.alive)):
            if self.alive[i] and (i in dropped or not self.alive[self.parents[i]]):
                self.alive[i] = False


@POLICIES.register("optimal")
class OptimalPolicy(SALFPolicy):
    """SpecExec's optimal search: SALF with threshold 0 (stops only when no popped node can improve G)."""

    defaults = {**SALFPolicy.defaults, "salf_threshold": 0.0}
