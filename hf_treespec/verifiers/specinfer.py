"""SpecInfer's multi-round speculative sampling (MSS) over the k i.i.d. drafts of a node."""

from __future__ import annotations

from ..randomness import bernoulli
from .base import VERIFIERS, residual, sample
from .branching import BranchingLaw
from .topdown import TopDownVerifier, accept_prob, pick


@VERIFIERS.register("specinfer")
class SpecInferVerifier(TopDownVerifier, BranchingLaw):
    """Visits the drafts one copy at a time: accept x with min(1, p(x)/q(x)), else p <- norm((p - q)+), drop the copy.

    The copies are visited in a uniformly random arrangement of the multiset (the law of the i.i.d. draw order given
    the multiset), drawn lazily: the next copy is a child with probability proportional to its remaining copies.
    """


    def branching(self, table, order):
        """Copy i (in order) is accepted with min(1, p_i(x) / q(x)) after i rejections; else y ~ p_k."""
        out: dict[int, float] = dict.fromkeys(order, 0.0)
        left = 1.0
        for i, c in enumerate(order):
            accept = min(1.0, table.residuals[i][c] / table.draft[c])
            out[c] += left * accept
            left *= 1.0 - accept
        if left > 0:
            final = table.residuals[len(order)]
            for c in out:
                out[c] += left * final[c]
        return out

    def branching_rows(self, copies: int) -> int:
        return copies + 1

    def solve(self, p, q, tokens, counts, generator) -> int:
        remaining = counts.to(p.dtype).clone()
        for _ in range(int(counts.sum())):
            i = pick(remaining, generator)
            x = int(tokens[i])
            if bool(bernoulli(accept_prob(p[x], q[x]), generator)):
                return x
            p = residual(p, q)
            remaining[i] -= 1
        return sample(p, generator)
