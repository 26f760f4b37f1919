"""Static trees (EAGLE-1 / Medusa style) and the Sequoia dynamic program that chooses their shape.

A shape is a list of child-rank paths: ``[0]`` is the draft's best child of the root, ``[1]`` its second best,
``[0, 2]`` the third best child of ``[0]``. The tree has the same shape at every step; only the tokens filling it
change. Sequoia (Chen et al. 2024) picks the shape that maximises the expected number of accepted tokens under a
positional acceptance model: the target takes the rank-r child of a reached node with probability a_r, the same at
every node, so a node is reached with the product of a_r along its path. :func:`sequoia_shape` solves that by
dynamic programming for a budget and a depth bound; :func:`choose_shape` also weighs a verification cost curve
(tokens per second instead of tokens per step). ``hf-treespec train static-shape`` measures a_r on real trees and
prints the shape.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch

from ..tree import DraftTree, Regime, to_host
from .base import POLICIES, Draft, Growth, TreePolicy, sibling_sequence

#: a generic decaying per-rank acceptance profile (an assumption, NOT a measurement: top-1 around 0.6, the tail
#: falling off); the default shape is Sequoia's for it. Measure your drafter's a_r and get its shape with
#: ``hf-treespec train c2t-data`` + ``hf-treespec train static-shape``, then pass ``tree_shape=``
DEFAULT_RANK_ACCEPTANCE: tuple[float, ...] = (0.6, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.008)


def check_shape(shape: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The shape as sorted rank tuples (by depth, then ranks), after refusing what no tree has."""
    try:
        paths = [tuple(int(r) for r in path) for path in shape]
    except (TypeError, ValueError):
        raise ValueError(f"tree_shape must be a list of child-rank paths such as [[0], [1], [0, 0]], got {shape!r}."
                         ) from None
    if not paths:
        raise ValueError("tree_shape is empty: give at least one path, e.g. [[0]].")
    bad = [p for p in paths if not p or min(p) < 0]
    if bad:
        raise ValueError(f"tree_shape paths must be non-empty lists of ranks >= 0, got {bad[:3]}.")
    if len(set(paths)) != len(paths):
        raise ValueError("tree_shape lists a path twice.")
    known = set(paths)
    orphans = [p for p in paths if len(p) > 1 and p[:-1] not in known]
    if orphans:
        raise ValueError(f"tree_shape must contain every path's parent: {list(orphans[0])} has no "
                         f"{list(orphans[0][:-1])}.")
    return sorted(paths, key=lambda p: (len(p), p))


def expected_accepted(shape: Sequence[Sequence[int]], acceptance: Sequence[float]) -> float:
    """Expected accepted drafts per step of ``shape`` under the positional model (ranks past the vector: 0)."""
    total = 0.0
    for path in shape:
        total += math.prod(acceptance[r] if r < len(acceptance) else 0.0 for r in path)
    return total


def _dp(acceptance: tuple[float, ...], budget: int, depth: int):
    """G[d][n]: best expected accepted drafts of n nodes hung below a node with d levels left; choices to rebuild.

    H(n, d, r) = best using child ranks >= r: skip rank r, or give it a subtree of m nodes (itself + m - 1 below):
    max(H(n, d, r+1), max_m a_r (1 + G(m-1, d-1)) + H(n-m, d, r+1)). One max-plus convolution over n per (d, r)."""
    ranks = len(acceptance)
    neg = float("-inf")
    n_idx = torch.arange(budget + 1)
    m_idx = torch.arange(1, budget + 1)
    valid = m_idx[None, :] <= n_idx[:, None]  # [n, m]
    rest = (n_idx[:, None] - m_idx[None, :]).clamp(min=0)
    G = [torch.cat([torch.zeros(1), torch.full((budget,), neg)]).double()]  # d = 0: no nodes below
    choices = [None]
    for d in range(1, depth + 1):
        below = G[d - 1]  # best for m - 1 nodes under the child
        H = torch.cat([torch.zeros(1), torch.full((budget,), neg)]).double()  # r = ranks: nothing left
        picks = []
        for r in reversed(range(ranks)):
            take = acceptance[r] * (1 + below[m_idx - 1])[None, :] + H[rest]
            take = torch.where(valid & torch.isfinite(H[rest]) & torch.isfinite(below[m_idx - 1])[None, :], take,
                               torch.full_like(take, neg))
            best, arg = take.max(dim=1)
            use = best > H
            picks.append(torch.where(use, arg + 1, torch.zeros_like(arg)))  # m, or 0 = skip rank r
            H = torch.where(use, best, H)
        G.append(H)
        choices.append(picks[::-1])  # choices[d][r][n]
    return G, choices


@functools.lru_cache(maxsize=64)
def _cached_shape(acceptance: tuple[float, ...], budget: int, depth: int) -> tuple[tuple[int, ...], ...]:
    G, choices = _dp(acceptance, budget, depth)
    n = int(torch.where(torch.isfinite(G[depth]), G[depth], torch.full_like(G[depth], -1.0)).argmax())
    shape: list[tuple[int, ...]] = []

    def rebuild(n: int, d: int, r: int, prefix: tuple[int, ...]) -> None:
        while n > 0 and r < len(acceptance):
            m = int(choices[d][r][n])
            if m:
                shape.append(prefix + (r,))
                rebuild(m - 1, d - 1, 0, prefix + (r,))
                n -= m
            r += 1

    rebuild(n, depth, 0, ())
    return tuple(sorted(shape, key=lambda p: (len(p), p)))


def sequoia_shape(acceptance: Sequence[float], budget: int, max_depth: int | None = None) -> list[list[int]]:
    """The shape of at most ``budget`` nodes (and ``max_depth`` levels) maximising :func:`expected_accepted`.

    ``acceptance[r]``: probability that the target accepts the rank-r child of a node it reached (measured
    per-rank acceptance). Exact dynamic program, O(budget^2 x ranks x depth) tensor work."""
    acceptance = tuple(float(a) for a in acceptance)
    if not acceptance or min(acceptance) < 0 or sum(acceptance) > 1 + 1e-6:
        raise ValueError(f"acceptance must be probabilities of disjoint events (>= 0, summing to <= 1), got "
                         f"{list(acceptance)}.")
    if int(budget) < 1:
        raise ValueError(f"budget must be >= 1, got {budget}.")
    depth = int(budget) if max_depth is None else max(1, min(int(max_depth), int(budget)))
    return [list(p) for p in _cached_shape(acceptance, int(budget), depth)]


def choose_shape(
    acceptance: Sequence[float], budgets: Sequence[int], step_seconds: Callable[[int, int], float],
    max_depth: int | None = None,
) -> tuple[list[list[int]], dict[str, float]]:
    """Sequoia's hardware-aware choice: among the optimal shapes of each budget, the one with the most tokens per
    second, ``(1 + expected accepted) / step_seconds(nodes, depth)`` (a measured cost curve: one target forward
    over the nodes plus one draft forward per level). Returns the shape and its figures."""
    best: tuple[float, list[list[int]], dict[str, float]] | None = None
    for budget in budgets:
        shape = sequoia_shape(acceptance, budget, max_depth)
        depth = max(len(p) for p in shape)
        tokens = 1 + expected_accepted(shape, acceptance)
        seconds = float(step_seconds(len(shape), depth))
        rate = tokens / seconds
        if best is None or rate > best[0]:
            best = (rate, shape, {"nodes": len(shape), "depth": depth, "tokens_per_step": tokens,
                                  "step_seconds": seconds, "tokens_per_second": rate})
    if best is None:
        raise ValueError("choose_shape needs at least one budget.")
    return best[1], best[2]


@POLICIES.register("static")
class StaticPolicy(TreePolicy):
    """The same tree shape every step (``tree_shape``: child-rank paths), filled level by level, one draft forward
    per level: greedy with the draft's ranked children; when sampling, as Sequoia fills it, with each node's
    children sampled from q without replacement (rank r = the r-th draw), verified by the without-replacement rule
    (``verifier="swor"``, the default; NSS also stays lossless). Unset, the shape is Sequoia's optimum for
    ``tree_budget`` nodes (and ``tree_depth`` levels) under the generic profile :data:`DEFAULT_RANK_ACCEPTANCE`."""

    defaults = {"tree_shape": None, "tree_budget": 25, "tree_depth": None}
    regime = Regime.SWOR
    default_verifier = "swor"

    def __init__(self, do_sample: bool = False, **params):
        self._given = {k for k, v in params.items() if v is not None}
        super().__init__(do_sample=do_sample, **params)

    def validate(self) -> None:
        super().validate()
        if self.params["tree_shape"] is not None:
            both = sorted(self._given & {"tree_budget", "tree_depth"})
            if both:
                raise ValueError(f"tree_policy='static' takes either tree_shape or {both} (which pick Sequoia's "
                                 "shape for the default acceptance profile), not both.")
            self.shape = check_shape(self.params["tree_shape"])
        else:
            self.shape = [tuple(p) for p in sequoia_shape(DEFAULT_RANK_ACCEPTANCE, int(self.params["tree_budget"]),
                                                          self.params["tree_depth"])]
        if self.do_sample:
            known = set(self.shape)
            gaps = [p for p in self.shape if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known]
            if gaps:
                raise ValueError(
                    f"tree_shape {list(gaps[0])} has no sibling of rank {gaps[0][-1] - 1}: when sampling, a node's "
                    "children are the first draws of a sampling-without-replacement sequence, so its ranks must be "
                    "0, 1, ... without gaps (a skipped draw would bias verification).")
        # per level: the shape index of each path's parent and its rank (static, computed once)
        index = {p: i for i, p in enumerate(self.shape)}
        self._levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for depth in range(1, max(len(p) for p in self.shape) + 1):
            level = [i for i, p in enumerate(self.shape) if len(p) == depth]
            parents = torch.tensor([index[self.shape[i][:-1]] if depth > 1 else -1 for i in level])
            ranks = torch.tensor([self.shape[i][-1] for i in level])
            self._levels.append((torch.tensor(level), parents, ranks))

    @property
    def is_chain(self) -> bool:
        return all(p[-1] == 0 for p in self.shape)

    def grow(self, root_token, *, context, capabilities=frozenset(), generator=None) -> Growth:
        device = torch.device("cpu")  # trees are host bookkeeping (see DraftTree)
        tree = DraftTree.root(root_token, device=device, regime=self.regime)
        node_of = torch.full((len(self.shape),), -1, dtype=torch.long, device=device)  # shape path -> tree node
        for level, parent_path, ranks in self._levels:
            parents = torch.zeros_like(ranks) if int(parent_path[0]) < 0 else node_of[parent_path.to(device)]
            ranks = ranks.to(device)
            alive = parents >= 0  # a parent the drafter could not fill has no children
            if not bool(alive.any()):
                break
            parents, ranks, level = parents[alive], ranks[alive], level.to(device)[alive]
            expand, row = parents.unique(return_inverse=True)
            toks, vals, probs, support = yield from sibling_sequence(tree, expand, int(ranks.max()) + 1,
                                                                     self.do_sample, capabilities, generator)
            if probs is not None:  # the verifier tests each node's draws against the q they were sampled from
                tree = tree.record_draft_probs(expand, probs, support)
            toks, vals = to_host(toks, vals)  # [F, <= max rank + 1] sibling sequences to the host tree
            if vals.shape[-1] == 0:  # a sparse source (prompt lookup) proposed nothing at this level
                break
            ranks_ok = ranks < vals.shape[-1]
            logq = torch.where(ranks_ok, vals[row, ranks.clamp(max=vals.shape[-1] - 1)],
                               torch.full_like(ranks, float("-inf"), dtype=vals.dtype))
            token = toks[row, ranks.clamp(max=toks.shape[-1] - 1)]
            order = torch.argsort(parents * (int(ranks.max()) + 1) + ranks)  # siblings in rank order
            parents, token, logq, level = parents[order], token[order], logq[order], level[order]
            finite = torch.isfinite(logq)
            start = tree.num_nodes
            tree = tree.add_children(parents, token, logq)
            node_of[level] = torch.where(finite, start + finite.long().cumsum(0) - 1, torch.full_like(level, -1))
        return Draft(tree)
