"""T=0 verification: follow the child whose token is the target argmax. Lossless for any tree."""

from __future__ import annotations

import torch

from ..tree import DraftTree, Regime, host_longs
from .base import VERIFIERS, Verifier, VerifyResult
from .branching import BranchingLaw


def deepest_matching_path(tree: DraftTree, choice: torch.Tensor | list[int]) -> torch.Tensor:
    """Accepted path when the target picks ``choice[v]`` after node v: one pass over the nodes in index order on host
    lists (a node matches when its parent matched and its token is the parent's choice; parents precede children)."""
    choice = choice.tolist() if isinstance(choice, torch.Tensor) else choice
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    matched = [True] + [False] * (len(tokens) - 1)
    deepest = 0
    for node in range(1, len(tokens)):
        parent = parents[node]
        if matched[parent] and tokens[node] == choice[parent]:
            matched[node] = True
            if depth[node] > depth[deepest]:  # the first of the deepest (siblings of a deterministic tree differ)
                deepest = node
    path = [deepest]
    while path[-1]:
        path.append(parents[path[-1]])
    return host_longs(path[::-1])


@VERIFIERS.register("greedy")
class GreedyVerifier(Verifier, BranchingLaw):
    lossless_regimes = frozenset(Regime.ALL)
    sampling = False

    def branching(self, table, order):
        """T=0: the child equal to argmax p is entered surely."""
        return {c: float(table.tokens[c] == table.argmax) for c in order}

    def verify_rows(self, trees, target_logits, generator=None) -> list[VerifyResult]:
        """Every row's argmax choices reach the host in ONE copy; each row then walks its own tree there."""
        if not trees:
            return []
        choices = torch.cat([logits.max(dim=-1).indices for logits in target_logits]).tolist()
        results, start = [], 0
        for tree in trees:
            choice = choices[start : start + tree.num_nodes]
            start += tree.num_nodes
            accepted = deepest_matching_path(tree, choice)
            results.append(VerifyResult(accepted=accepted, next_token=choice[int(accepted[-1])]))
        return results

    def verify(self, tree, target_logits, generator=None) -> VerifyResult:
        # max(dim).indices is argmax (first maximum on ties, as documented), about 3x faster over a vocabulary on CPU
        # then one copy of the [n] choices to the host, where the tree's structure lives
        choice = target_logits.max(dim=-1).indices.tolist()
        accepted = deepest_matching_path(tree, choice)
        return VerifyResult(accepted=accepted, next_token=choice[int(accepted[-1])])
