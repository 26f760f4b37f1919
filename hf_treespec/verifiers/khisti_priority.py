"""A cheaper variant of Khisti et al. (2025)'s canonical decomposition: select one of the k drafts by a fixed
priority order instead of the paper's truncated LP (`khisti`), then single-draft speculative sampling.

Not the paper's rule: no LP is solved and the selection never randomises. What losslessness needs is a selection
whose induced distribution r is known exactly: the selected draft is the one whose token ranks highest, so
r(x) = A(x)^k - (A(x) - q(x))^k with A(x) = q-mass of x and every token ranked below it. The order is chosen, from
the node's p and q only (never from the drafts), among three candidates (by p/q, by p, by p - q) to maximise the
acceptance sum min(p, r).
"""

from __future__ import annotations

import torch

from ..randomness import bernoulli
from .base import VERIFIERS, residual, sample
from .branching import BranchingLaw
from .topdown import TopDownVerifier, accept_prob, single_draft_law


def selection_distribution(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, rank): the winner law of the priority tournament among k i.i.d. drafts from q, and the priority rank of
    every token (0 = highest), for the candidate order with the highest acceptance sum min(p, r)."""
    ratio = torch.where(q > 0, p / q.clamp(min=torch.finfo(q.dtype).tiny), torch.zeros_like(p))
    keys = torch.stack([ratio, p, p - q])
    order = keys.argsort(dim=-1, descending=True, stable=True)
    q_sorted = q[order]
    tail = q_sorted.flip(-1).cumsum(-1).flip(-1)  # q-mass of this token and every lower-priority one
    r_sorted = tail.pow(k) - (tail - q_sorted).clamp(min=0).pow(k)
    r = torch.zeros_like(keys).scatter_(1, order, r_sorted)
    best = int(torch.minimum(p[None], r).sum(-1).argmax())
    positions = torch.arange(p.shape[-1], device=p.device)
    rank = torch.empty_like(order[best]).scatter_(0, order[best], positions)
    return r[best], rank


@VERIFIERS.register("khisti_priority")
class KhistiPriorityVerifier(TopDownVerifier, BranchingLaw):
    """Select Z = the highest-priority draft, accept it with min(1, p(Z)/r(Z)), else y ~ norm((p - r)+).

    Branching law (NDE data): Z is fixed by the multiset, so child c is entered with [c = Z] a_Z + (1 - a_Z) res(c).
    """


    def branching_rows(self, copies: int) -> int:
        return 2  # p and norm((p - q)+), for the nodes with one draft

    def branching_columns(self, p, q, tokens, k):
        r, rank = selection_distribution(p, q, k)
        index = torch.tensor(tokens, device=p.device)
        return {"accept": accept_prob(p[index], r[index]).tolist(), "rank": rank[index].tolist(),
                "rest": residual(p, r)[index].tolist()}

    def branching(self, table, order):
        if len(order) == 1:  # one draft: both solvers are single-draft speculative sampling (rho* = 1, r = q)
            return single_draft_law(table, order[0])
        columns = table.columns_for(len(order))
        winner = min(set(order), key=lambda c: columns["rank"][c])
        accept = columns["accept"][winner]
        out = {c: (1.0 - accept) * columns["rest"][c] for c in order}
        out[winner] += accept
        return out

    def solve(self, p, q, tokens, counts, generator) -> int:
        r, rank = selection_distribution(p, q, int(counts.sum()))
        x = int(tokens[rank[tokens].argmin()])
        if bool(bernoulli(accept_prob(p[x], r[x]), generator)):
            return x
        return sample(residual(p, r), generator)
