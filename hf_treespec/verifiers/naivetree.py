"""NaiveTree: chain speculative sampling on the first i.i.d. draft only, other drafts reachable through the residual."""

from __future__ import annotations

from ..randomness import bernoulli
from .base import VERIFIERS, residual, sample
from .topdown import TopDownVerifier, accept_prob, pick


@VERIFIERS.register("naivetree")
class NaiveTreeVerifier(TopDownVerifier):
    """Test one draft x with min(1, p(x)/q(x)); on rejection y ~ norm((p - q)+), which may still match another child.

    Merged children carry no draw order, so "the first draft" is drawn with probability multiplicity / k, which is
    exactly the law of the first of k i.i.d. draws given the multiset.
    """

    def solve(self, p, q, tokens, counts, generator) -> int:
        x = int(tokens[pick(counts.to(p.dtype), generator)])
        if bool(bernoulli(accept_prob(p[x], q[x]), generator)):
            return x
        return sample(residual(p, q), generator)
