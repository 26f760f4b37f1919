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

from ..randomness import Randomness, categorical, support_columns
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
    reads_visited_rows = True
    #: whether `solve` changes the weights of the tokens q gives nothing alike (each keeps its share of p, as
    #: (p - q)+ does): it then runs over q's columns plus one pooled entry for the rest (`_solve_pooled`)
    pools_undrafted: bool = False

    @abstractmethod
    def solve(
        self, p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, generator: Randomness
    ) -> int:
        """A token y ~ p, coupled with the children ``tokens`` (multiplicities ``counts``) drawn i.i.d. from ``q``."""

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, generator: Randomness = None) -> VerifyResult:
        # p at the nodes the walk visits only (the accepted path and one more): a softmax over the vocabulary per
        # node, where the tree has several times as many
        multiplicity = tree.multiplicity()
        node, path = 0, [0]
        while True:
            kids = tree.children(node)
            p = target_probs(target_logits[node])
            if kids.numel() == 0:
                token = sample(p, generator)
                break
            tokens = tree.tokens[kids]
            token = self._solve_pooled(p, tree.draft_q(node), tokens, multiplicity[kids], generator,
                                       tree.draft_support)
            match = (tokens == token).nonzero().flatten()
            if match.numel() == 0:
                break
            node = int(kids[match[0]])
            path.append(node)
        return VerifyResult(accepted=torch.tensor(path, device=tree.device), next_token=token)

    def _solve_pooled(self, p, q, tokens, counts, generator, support) -> int:
        """`solve`, over the columns q can draw when the solver `pools_undrafted` (``support``, else found on a CPU):
        the tokens outside them, never drafted, enter as one entry holding their mass of p, and a draw of it is
        resolved from p there. The same law, with passes over a reduced draft vocabulary (8192 of SmolLM2's 49152
        tokens for the shipped drafter) instead of the vocabulary."""
        columns = None
        if self.pools_undrafted:
            columns = support if support is not None else support_columns(q[None])
        if columns is None:
            return self.solve(p, q, tokens, counts, generator)
        outside = p.index_fill(0, columns, 0)
        token = self.solve(torch.cat([p.index_select(0, columns), outside.sum()[None]]),
                           torch.cat([q.index_select(0, columns), q.new_zeros(1)]),
                           torch.searchsorted(columns, tokens.to(columns.device)), counts, generator)
        return int(columns[token]) if token < columns.numel() else sample(outside, generator)


def single_draft_law(table, c: int) -> dict[int, float]:
    """Branching law with one drafted copy of child c: accept with min(1, p(c) / q(c)), else y ~ norm((p - q)+)."""
    accept = min(1.0, table.residuals[0][c] / table.draft[c])
    return {c: accept + (1.0 - accept) * table.residuals[1][c]}
