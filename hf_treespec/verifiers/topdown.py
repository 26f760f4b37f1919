"""Top-down verification of i.i.d. draft trees by an OT solver applied node by node (docs/algorithms.md section 3).

At each node an OT ("OTLP") solver couples one token y ~ p(. | node) with the node's draft children (a multiset:
``DraftTree.counts`` holds each child's multiplicity). The walk descends into the child whose token is y and stops,
emitting y, when no child matches. Whatever the solver, the emitted token at every node follows p exactly, and the
subtree under the child it enters is still a fresh i.i.d. sample given that child (the solver only looked at the
children's tokens), so the whole step is lossless for trees whose children are i.i.d. draws from q.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..randomness import Randomness, categorical
from ..tree import DraftTree, Regime
from .base import Verifier, VerifyResult, sample, target_probs


def accept_prob(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for a drafted token (q(x) > 0 because x was drawn from q)."""
    return (p_x / q_x).clamp(max=1)


def pick(weights: torch.Tensor, generator: Randomness) -> int:
    """Index drawn proportionally to ``weights``; no draw at all when there is a single candidate."""
    return 0 if weights.numel() == 1 else categorical(weights, generator)


class TopDownVerifier(Verifier):
    """Walks the tree from the root; subclasses implement the per-node OT solver ``solve``."""

    lossless_regimes = frozenset({Regime.IID})
    needs_draft_probs = True

    @abstractmethod
    def solve(
        self, p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, generator: Randomness
    ) -> int:
        """A token y ~ p, coupled with the children ``tokens`` (multiplicities ``counts``) drawn i.i.d. from ``q``."""

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, generator: Randomness = None) -> VerifyResult:
        probs = target_probs(target_logits)
        multiplicity = tree.multiplicity()
        node, path = 0, [0]
        while True:
            kids = tree.children(node)
            if kids.numel() == 0:
                token = sample(probs[node], generator)
                break
            tokens = tree.tokens[kids]
            token = self.solve(probs[node], tree.draft_q(node), tokens, multiplicity[kids], generator)
            match = (tokens == token).nonzero().flatten()
            if match.numel() == 0:
                break
            node = int(kids[match[0]])
            path.append(node)
        return VerifyResult(accepted=torch.tensor(path, device=tree.device), next_token=token)


def single_draft_law(table, c: int) -> dict[int, float]:
    """Branching law with one drafted copy of child c: accept with min(1, p(c) / q(c)), else y ~ norm((p - q)+)."""
    accept = min(1.0, table.residuals[0][c] / table.draft[c])
    return {c: accept + (1.0 - accept) * table.residuals[1][c]}
