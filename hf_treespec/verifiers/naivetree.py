"""NaiveTree: chain speculative sampling on the first i.i.d. draft only, other drafts reachable through the residual."""

from __future__ import annotations

from ..randomness import bernoulli
from .base import VERIFIERS, residual, sample
from .branching import BranchingLaw
from .topdown import TopDownVerifier, accept_prob, pick


@VERIFIERS.register("naivetree")
class NaiveTreeVerifier(TopDownVerifier, BranchingLaw):
    """Test one draft x with min(1, p(x)/q(x)); on rejection y ~ norm((p - q)+), which may still match another child.

    Merged children carry no draw order, so "the first draft" is drawn with probability multiplicity / k, which is
    exactly the law of the first of k i.i.d. draws given the multiset.
    """


    def branching(self, table, order):
        """The first copy with min(1, p / q); else y ~ norm((p - q)+), which may match another child."""
        first = order[0]
        accept = min(1.0, table.residuals[0][first] / table.draft[first])
        out = {c: (1.0 - accept) * table.residuals[1][c] for c in order}
        out[first] += accept
        return out

    def branching_rows(self, copies: int) -> int:
        return 2

    def solve(self, p, q, tokens, counts, generator) -> int:
        x = int(tokens[pick(counts.to(p.dtype), generator)])
        if bool(bernoulli(accept_prob(p[x], q[x]), generator)):
            return x
        return sample(residual(p, q), generator)
