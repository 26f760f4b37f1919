"""Khisti et al. (2025)'s truncated LP: how to choose between two drafts so that the chosen one is accepted most often.

Two independent drafts X1 ~ q1, X2 ~ q2 go in, one comes out (Z), and single-draft speculative sampling then accepts
Z with min(1, p(Z) / r(Z)), r being the law of Z. The selection that maximises the acceptance sum_x min(p(x), r(x))
is a linear program over the pairwise selection probabilities (one per ordered pair of tokens: n^2 variables).
The truncated LP keeps variables only for the ``s`` tokens ranked highest by p - q1 * q2; a pair involving any other
token goes to the higher-ranked of the two, so r is known in closed form outside the top ``s`` and the LP has O(s^2)
variables.

Solved exactly here, without an LP library: both orders of a pair {a, b} of top tokens have the same two possible
outcomes, so their masses q1(a) q2(b) + q1(b) q2(a) merge into one amount to split between a and b, and the LP becomes
a max-flow from pairs to tokens (token i can usefully take (p(i) - c(i))+ more, c(i) being the mass it gets without any
choice). A max-flow maximises that same objective, so its split is an optimum of the LP. Pair mass nobody needs goes
to the higher-ranked token, as outside the top ``s``. Losslessness never depends on the optimum: r is computed from
the split actually used.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..randomness import Randomness, bernoulli

#: residual capacities at or below this count as saturated (masses are probabilities, at most 1)
_EPS = 1e-15


@dataclass
class PairRule:
    """How one of two drafts is chosen, and the law ``law`` of the chosen one.

    Attributes:
        rank: ``[V]`` priority rank of every token (0 = highest), by p - q1 * q2.
        top: how many tokens (ranks ``< top``) have LP weights.
        wins: ``wins[i][j]``: probability that the rank-i token is chosen over the rank-j token (i, j < top), whichever
            draft each came from.
        law: ``[V]`` the law r of the chosen token when X1 ~ q1 and X2 ~ q2 independently.
    """

    rank: torch.Tensor
    top: int
    wins: list[list[float]]
    law: torch.Tensor

    def select(self, a: int, b: int, generator: Randomness = None) -> int:
        """The chosen one of the drafts ``a`` and ``b`` (token ids)."""
        if a == b:
            return a
        ra, rb = int(self.rank[a]), int(self.rank[b])
        if ra >= self.top or rb >= self.top:
            return a if ra < rb else b
        win = self.wins[ra][rb]
        if win >= 1.0 or win <= 0.0:
            return a if win >= 1.0 else b
        return a if bool(bernoulli(self.law.new_tensor(win), generator)) else b

    def acceptance(self, p: torch.Tensor) -> float:
        """sum_x min(p(x), r(x)): how often single-draft speculative sampling accepts the chosen draft."""
        return float(torch.minimum(p, self.law).sum())


def truncated_lp(p: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor, top: int) -> PairRule:
    """The acceptance-maximising choice between X1 ~ q1 and X2 ~ q2 with LP weights for the ``top`` best-ranked
    tokens (module docstring)."""
    if top < 1:
        raise ValueError(f"the truncated LP needs at least one token, got top={top}")
    vocab = p.shape[-1]
    top = min(top, vocab)
    order = (p - q1 * q2).argsort(descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(vocab, device=p.device))
    q1s, q2s = q1[order], q2[order]
    below1 = q1s.flip(0).cumsum(0).flip(0) - q1s  # mass of every lower-ranked token
    below2 = q2s.flip(0).cumsum(0).flip(0) - q2s
    law_sorted = q1s * q2s + q1s * below2 + below1 * q2s  # the priority rule: right outside the top

    a1, a2, pt = q1s[:top].tolist(), q2s[:top].tolist(), p[order[:top]].tolist()
    out1, out2 = float(below1[top - 1]), float(below2[top - 1])  # mass outside the top
    fixed = [a1[i] * a2[i] + a1[i] * out2 + out1 * a2[i] for i in range(top)]
    pairs = [(i, j, a1[i] * a2[j] + a1[j] * a2[i]) for i in range(top) for j in range(i + 1, top)]
    room = [max(pt[i] - fixed[i], 0.0) for i in range(top)]
    to_first, to_second = _split_pairs(pairs, room)

    wins = [[1.0] * top for _ in range(top)]
    got = list(fixed)
    for (i, j, mass), first, second in zip(pairs, to_first, to_second):
        share = 1.0 - second / mass if mass > 0 else 1.0  # what nobody needs stays with the higher-ranked token
        share = min(max(share, 0.0), 1.0)
        wins[i][j], wins[j][i] = share, 1.0 - share
        got[i] += mass * share
        got[j] += mass * (1.0 - share)
    law_sorted[:top] = law_sorted.new_tensor(got)
    law = torch.empty_like(law_sorted).scatter_(0, order, law_sorted)
    return PairRule(rank=rank, top=top, wins=wins, law=law)


def _split_pairs(pairs: list[tuple[int, int, float]], room: list[float]) -> tuple[list[float], list[float]]:
    """Max-flow (shortest augmenting paths) from every pair (i, j, mass) into its two tokens, token t taking at most
    ``room[t]``. Returns the amounts each pair sends to its first and to its second token."""
    n_pairs, n_tok = len(pairs), len(room)
    source, sink = n_pairs + n_tok, n_pairs + n_tok + 1
    heads: list[int] = []
    caps: list[float] = []
    adj: list[list[int]] = [[] for _ in range(n_pairs + n_tok + 2)]

    def edge(u: int, v: int, cap: float) -> int:
        adj[u].append(len(heads))
        heads.append(v)
        caps.append(cap)
        adj[v].append(len(heads))
        heads.append(u)
        caps.append(0.0)
        return len(heads) - 2

    into = []
    for e, (i, j, mass) in enumerate(pairs):
        edge(source, e, mass)
        into.append((edge(e, n_pairs + i, mass), edge(e, n_pairs + j, mass)))
    for t, cap in enumerate(room):
        edge(n_pairs + t, sink, cap)

    while True:
        via = [-1] * len(adj)
        via[source] = -2
        queue = deque([source])
        while queue and via[sink] == -1:
            u = queue.popleft()
            for e in adj[u]:
                v = heads[e]
                if via[v] == -1 and caps[e] > _EPS:
                    via[v] = e
                    queue.append(v)
        if via[sink] == -1:
            break
        path, v = [], sink
        while v != source:
            path.append(via[v])
            v = heads[via[v] ^ 1]
        push = min(caps[e] for e in path)
        for e in path:
            caps[e] -= push
            caps[e ^ 1] += push
    return [caps[a ^ 1] for a, _ in into], [caps[b ^ 1] for _, b in into]
