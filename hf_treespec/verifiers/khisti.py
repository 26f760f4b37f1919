"""Khisti et al. (2025): select one of the k i.i.d. drafts by importance weights from a truncated LP, then run
single-draft speculative sampling against the law r of the selected draft.

The paper's canonical decomposition: every multi-draft verifier can be written as a selection step (which of the k
drafts goes forward) followed by single-draft speculative sampling with the selected draft's law r in place of q.
Its practical scheme chooses between two drafts by the truncated LP of `khisti_lp`; with k drafts the choice runs as a
pairwise tournament, in draw order: the winner so far (law r_t) meets the next draft (law q), the LP is solved again
for that pair of laws, and the law of the new winner is r_{t+1}. As in the delayed-expansion paper's description
(its appendix B.5). The selected draft Z is accepted with min(1, p(Z) / r_k(Z)); otherwise y ~ norm((p - r_k)+).

Lossless for i.i.d. children: the children arrive as a multiset, so the tournament visits the copies in a uniformly
random order (the law of the i.i.d. draw order given the multiset), which makes the winner's law exactly r_k. With k = 2
and the LP untruncated (``lp_tokens`` >= vocabulary) the acceptance is the optimum over every lossless rule.
"""

from __future__ import annotations

from ..randomness import bernoulli
from .base import VERIFIERS, residual, sample
from .khisti_lp import truncated_lp
from .topdown import TopDownVerifier, accept_prob, pick


@VERIFIERS.register("khisti")
class KhistiVerifier(TopDownVerifier):
    """Pairwise tournament of the drafts by the truncated LP, then a single-draft test against the winner's law.

    ``lp_tokens``: how many tokens keep LP weights (the paper's truncation threshold s; 5 as in its experiments).
    """

    def __init__(self, lp_tokens: int = 5):
        if lp_tokens < 1:
            raise ValueError(f"lp_tokens must be >= 1, got {lp_tokens}")
        self.lp_tokens = lp_tokens

    def solve(self, p, q, tokens, counts, generator) -> int:
        remaining = counts.to(p.dtype).clone()
        winner, law = None, q
        for _ in range(int(counts.sum())):  # copies in a uniformly random order, drawn lazily
            i = pick(remaining, generator)
            remaining[i] -= 1
            draft = int(tokens[i])
            if winner is None:
                winner = draft
                continue
            rule = truncated_lp(p, law, q, self.lp_tokens)
            winner, law = rule.select(winner, draft, generator), rule.law
        if bool(bernoulli(accept_prob(p[winner], law[winner]), generator)):
            return winner
        return sample(residual(p, law), generator)
