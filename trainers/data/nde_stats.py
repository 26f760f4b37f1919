"""Equation 3 of the delayed-expansion paper for every action on a sampled trie: expected accepted drafts from the
verifiers' closed-form branching laws, plus each action's tree size and draft width."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hf_treespec.api import Action, NodeTable, branching_law

from .nde_trie import SampledTrees


@dataclass
class ActionStats:
    """Per-sample statistics of every action: ``tau`` (1 + expected accepted drafts), ``nodes`` (target tree rows,
    root included) and ``draft_width`` (nodes fed to the drafter over the step's ``l1 + l2`` calls). ``[N, A]``."""

    tau: torch.Tensor
    nodes: torch.Tensor
    draft_width: torch.Tensor


def action_stats(trees: SampledTrees, tables: dict[int, NodeTable], actions: Sequence[Action],
                 verifier: str) -> ActionStats:
    """Equation 3 for every sample and action: a node counts with the product of branching probabilities on its path.

    Per sample, the trunk's reach probabilities are computed once, and per (trunk length, k) the branch tree's
    per-depth reach sums once for all l2 (an action's tree is the first k paths truncated to depth l2)."""
    branching = branching_law(verifier).branching
    tokens = trees.trie.tokens.tolist()
    n = trees.trunk.shape[0]
    max_branch = trees.branches.shape[-1] - 1
    out = torch.zeros(3, n, len(actions), dtype=torch.float64)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for a, action in enumerate(actions):
        if action.trunk not in trees.trunks or action.paths > trees.branches.shape[2] or action.branch > max_branch:
            raise ValueError(f"action {tuple(action)} is outside the sampled trees (trunks {trees.trunks}, "
                             f"k <= {trees.branches.shape[2]}, l2 <= {max_branch}).")
        by_shape.setdefault((action.trunk, action.paths), []).append(a)

    def enter(parent: int, kids: list[int]) -> dict[int, float]:
        table = tables[parent]
        probs = branching(table, [table.column[tokens[v]] for v in kids])
        return {v: probs[table.column[tokens[v]]] for v in kids}

    for s in range(n):
        trunk = trees.trunk[s].tolist()
        reach, cumulative = [1.0], [0.0]
        for d in range(1, len(trunk)):
            reach.append(reach[-1] * enter(trunk[d - 1], [trunk[d]])[trunk[d]])
            cumulative.append(cumulative[-1] + reach[-1])
        for (l1, k), indices in by_shape.items():
            paths = trees.branches[s, trees.trunks.index(l1), :k].tolist()
            node_reach = {paths[0][0]: 1.0}
            level_sum, level_nodes = [0.0] * (max_branch + 1), [1] + [0] * max_branch
            for d in range(max_branch):
                groups: dict[int, list[int]] = {}
                for path in paths:
                    groups.setdefault(path[d], []).append(path[d + 1])
                for parent, kids in groups.items():
                    for child, prob in enter(parent, kids).items():
                        node_reach[child] = node_reach[parent] * prob
                        level_sum[d + 1] += node_reach[child]
                        level_nodes[d + 1] += 1
            for a in indices:
                l2 = actions[a].branch
                out[0, s, a] = 1.0 + cumulative[l1] + reach[l1] * sum(level_sum[1 : l2 + 1])
                out[1, s, a] = 1 + l1 + sum(level_nodes[1 : l2 + 1])
                out[2, s, a] = l1 + sum(level_nodes[:l2])
    return ActionStats(tau=out[0], nodes=out[1], draft_width=out[2])
