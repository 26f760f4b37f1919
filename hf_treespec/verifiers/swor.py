"""Verification of trees whose siblings were sampled without replacement (Sequoia / DySpec, docs/algorithms.md section 6)."""

from __future__ import annotations

import torch

from ..randomness import bernoulli
from ..tree import Regime
from .base import VERIFIERS, residual, sample
from .topdown import TopDownVerifier, accept_prob


@VERIFIERS.register("swor")
class SWORVerifier(TopDownVerifier):
    """Siblings in sampling order: accept x with min(1, p(x)/q(x)); else p <- norm((p - q)+), q(x) <- 0, q <- norm(q).

    Sibling i was drawn from q with siblings 1..i-1 masked out, which is exactly the masked q it is tested against, so
    the sibling order of the tree must be the sampling order (as the ``swor`` policy builds it).
    """

    lossless_regimes = frozenset({Regime.SWOR})

    pools_undrafted = True  # (p - q)+ keeps p's weights where q is zero: they change alike

    def solve(self, p, q, tokens, counts, generator) -> int:
        q = q.clone()
        for x in tokens.tolist():
            if bool(bernoulli(accept_prob(p[x], q[x]), generator)):
                return x
            p = residual(p, q)
            q[x] = 0
            total = q.sum()
            q = torch.where(total > 0, q / total, q)  # on the device: no host read of the total
        return sample(p, generator)
