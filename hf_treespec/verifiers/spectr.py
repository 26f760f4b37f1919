"""SpecTr's K-SEQ solver (Sun et al. 2023) with the division factor rho* found by bracketing."""

from __future__ import annotations

import torch

from ..randomness import bernoulli
from .base import VERIFIERS, sample
from .branching import BranchingLaw
from .topdown import TopDownVerifier, accept_prob, pick
from .topdown import single_draft_law


def kseq_division_factor(
    p: torch.Tensor, q: torch.Tensor, k: int, rounds: int = 4, points: int = 15
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """rho* in [1, k]: the root of p_acc(rho) - rho * beta(rho), with beta(rho) = sum min(p / rho, q) and
    p_acc(rho) = 1 - (1 - beta)^k. Returns (rho, beta(rho), p_acc(rho)).

    The bracket is refined on a grid of ``points`` per round (one batched evaluation instead of one per bisection
    step). The upper end is returned: there p_acc <= rho * beta, which is what keeps the residual non-negative, so the
    verifier stays exactly lossless however coarse the bracket; precision only affects the acceptance rate.
    """
    if k <= 1:
        beta = torch.minimum(p, q).sum()
        return 1.0, beta, beta
    lo, hi = 1.0, float(k)
    for _ in range(rounds):
        grid = torch.linspace(lo, hi, points + 2, dtype=p.dtype, device=p.device)[1:-1]
        beta = torch.minimum(p[None] / grid[:, None], q[None]).sum(-1)
        f = 1 - (1 - beta) ** k - grid * beta
        below = (f <= 0).nonzero().flatten()
        if below.numel() == 0:
            lo = float(grid[-1])
            continue
        first = int(below[0])
        hi = float(grid[first])
        lo = float(grid[first - 1]) if first > 0 else lo
    beta = torch.minimum(p / hi, q).sum()
    return hi, beta, 1 - (1 - beta) ** k


@VERIFIERS.register("spectr")
class SpecTrVerifier(TopDownVerifier, BranchingLaw):
    """Each of the k draft copies is accepted independently with min(1, p(x) / (rho* q(x))); the first accepted copy in
    the i.i.d. order wins (given the multiset: a uniformly random accepted copy). If none is accepted,
    y ~ norm((p - gamma min(p / rho*, q))+) with gamma = p_acc / beta, which removes exactly the mass accepted above.

    Branching law (NDE data): with copies visited in draw order (whose law given the multiset is uniform, so "first
    accepted in draw order" has the law of "a uniformly random accepted copy"), copy i wins with
    prod_{j<i}(1 - a_j) a_i, a = min(1, p / (rho* q)); if none is accepted the child c comes from the residual.
    """


    def solve(self, p, q, tokens, counts, generator) -> int:
        k = int(counts.sum())
        rho, rest = kseq_terms(p, q, k)
        copies = tokens.repeat_interleave(counts)
        accepted = bernoulli(accept_prob(p[copies], rho * q[copies]), generator)
        if bool(accepted.any()):
            return int(copies[pick(accepted.to(p.dtype), generator)])
        return sample(rest, generator)

    def branching_rows(self, copies: int) -> int:
        return 2  # p and norm((p - q)+), for the nodes with one draft

    def branching_columns(self, p, q, tokens, k):
        rho, rest = kseq_terms(p, q, k)
        index = torch.tensor(tokens, device=p.device)
        return {"accept": accept_prob(p[index], rho * q[index]).tolist(), "rest": rest[index].tolist()}

    def branching(self, table, order):
        if len(order) == 1:  # one draft: both solvers are single-draft speculative sampling (rho* = 1, r = q)
            return single_draft_law(table, order[0])
        columns = table.columns_for(len(order))
        out: dict[int, float] = dict.fromkeys(order, 0.0)
        left = 1.0
        for c in order:
            accept = columns["accept"][c]
            out[c] += left * accept
            left *= 1.0 - accept
        if left > 0:
            for c in out:
                out[c] += left * columns["rest"][c]
        return out


def kseq_terms(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    """(rho*, residual law) of K-SEQ with k copies: what the solver and its branching law both read."""
    rho, beta, p_acc = kseq_division_factor(p, q, k)
    rest = p
    if float(beta) > 0:
        rest = (p - (p_acc / beta) * torch.minimum(p / rho, q)).clamp(min=0)
        total = rest.sum()
        rest = rest / total if float(total) > 0 else p
    return rho, rest
