"""SpecInfer's multi-round speculative sampling (MSS) over the k i.i.d. drafts of a node."""

from __future__ import annotations

from ..randomness import bernoulli
from .base import VERIFIERS, residual, sample
from .topdown import TopDownVerifier, accept_prob, pick


@VERIFIERS.register("specinfer")
class SpecInferVerifier(TopDownVerifier):
    """Visits the drafts one copy at a time: accept x with min(1, p(x)/q(x)), else p <- norm((p - q)+), drop the copy.

    The copies are visited in a uniformly random arrangement of the multiset (the law of the i.i.d. draw order given
    the multiset), drawn lazily: the next copy is a child with probability proportional to its remaining copies.
    """

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
