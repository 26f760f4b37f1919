"""Khisti et al.'s truncated LP (`hf_treespec.verifiers.khisti_lp`) against an independent exact LP solve.

The package solves the LP as a max-flow, without an LP library; here scipy's linprog (HiGHS) solves the paper's own
form of it, with one variable per ordered pair of top tokens, on toy vocabularies (3-6 tokens), for the first round
(two drafts from q: k = 2) and the second round of a k = 3 tournament (the winner's law against q), at every
truncation. Both must reach the same optimum acceptance. The law the rule reports must be the law of the token it
selects (enumerated over both drafts), and with two drafts and no truncation the acceptance must equal the optimum
over every lossless two-draft rule, min over token sets W of p(W) + 1 - q(W)^2 (the paper's canonical decomposition
loses nothing).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hf_treespec.verifiers.khisti_lp import truncated_lp

linprog = pytest.importorskip("scipy.optimize").linprog


def toy(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2.0 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    if seed % 3 == 0:  # exact zeros, as top-k / top-p warping makes
        probs[seed % vocab] = 0
    return probs / probs.sum()


def priority_mass(q1, q2, order, pos) -> float:
    """Mass selecting the token at ``pos`` of ``order`` when every pair goes to the higher-ranked token."""
    i, lower = order[pos], order[pos + 1:]
    return q1[i] * q2[i] + q1[i] * sum(q2[j] for j in lower) + sum(q1[j] for j in lower) * q2[i]


def linprog_acceptance(p, q1, q2, top: int) -> float:
    """max sum_x min(p(x), r(x)) over the selection probabilities y[a, b] = P(select a | X1 = a, X2 = b) of every
    ordered pair of distinct top tokens; tokens are ranked by p - q1 * q2 and pairs with a lower token go to the
    higher-ranked one."""
    p, q1, q2 = (t.tolist() for t in (p, q1, q2))
    vocab = len(p)
    order = sorted(range(vocab), key=lambda i: (-(p[i] - q1[i] * q2[i]), i))
    tops, rest = order[:top], order[top:]
    out1, out2 = sum(q1[j] for j in rest), sum(q2[j] for j in rest)
    var = {pair: n for n, pair in enumerate(itertools.permutations(tops, 2))}
    nw, nz = len(var), len(tops)
    a_ub, b_ub = [], []
    for t, i in enumerate(tops):
        row = np.zeros(nw + nz)
        row[nw + t] = 1.0
        a_ub.append(row)
        b_ub.append(p[i])  # z_i <= p_i
        row = np.zeros(nw + nz)
        row[nw + t] = 1.0
        const = q1[i] * q2[i] + q1[i] * out2 + out1 * q2[i]
        for j in tops:
            if j != i:
                row[var[(i, j)]] -= q1[i] * q2[j]  # X1 = i, X2 = j: i selected with y[i, j]
                row[var[(j, i)]] += q1[j] * q2[i]  # X1 = j, X2 = i: i selected with 1 - y[j, i]
                const += q1[j] * q2[i]
        a_ub.append(row)
        b_ub.append(const)  # z_i <= r_i
    res = linprog(np.r_[np.zeros(nw), -np.ones(nz)], A_ub=np.array(a_ub), b_ub=np.array(b_ub),
                  bounds=[(0, 1)] * nw + [(None, None)] * nz, method="highs")
    assert res.success
    fixed = sum(min(p[order[pos]], priority_mass(q1, q2, order, pos)) for pos in range(top, vocab))
    return -res.fun + fixed


def enumerated_law(rule, q1, q2) -> torch.Tensor:
    """Law of the selected token over both drafts, from the rule's own selection probabilities."""
    vocab = q1.numel()
    law = torch.zeros(vocab, dtype=torch.float64)
    for a, b in itertools.product(range(vocab), repeat=2):
        mass = float(q1[a] * q2[b])
        ra, rb = int(rule.rank[a]), int(rule.rank[b])
        if a == b:
            law[a] += mass
        elif ra < rule.top and rb < rule.top:
            law[a] += mass * rule.wins[ra][rb]
            law[b] += mass * rule.wins[rb][ra]
        else:
            law[a if ra < rb else b] += mass
    return law


CASES = [(vocab, seed) for vocab in (3, 4, 5, 6) for seed in range(6)]


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("k", [2, 3])
def test_truncated_lp_reaches_the_linprog_optimum(vocab, seed, k):
    p, q = toy(vocab, 2 * seed), toy(vocab, 2 * seed + 1)
    for top in range(1, vocab + 1):
        q1 = q if k == 2 else truncated_lp(p, q, q, top).law  # round 2 of a 3-draft tournament: winner vs X3
        rule = truncated_lp(p, q1, q, top)
        assert rule.acceptance(p) == pytest.approx(linprog_acceptance(p, q1, q, top), abs=1e-9)
        assert torch.allclose(rule.law, enumerated_law(rule, q1, q), atol=1e-14, rtol=0)
        assert float(rule.law.sum()) == pytest.approx(1.0, abs=1e-14)
        for i, j in itertools.combinations(range(rule.top), 2):
            assert 0.0 <= rule.wins[i][j] <= 1.0 and rule.wins[i][j] + rule.wins[j][i] == pytest.approx(1.0)


@pytest.mark.parametrize("vocab,seed", CASES)
def test_two_drafts_untruncated_reach_the_optimal_transport_bound(vocab, seed):
    p, q = toy(vocab, 2 * seed), toy(vocab, 2 * seed + 1)
    best = min(float(p[list(w)].sum()) + 1 - float(q[list(w)].sum()) ** 2
               for n in range(vocab + 1) for w in itertools.combinations(range(vocab), n))
    assert truncated_lp(p, q, q, vocab).acceptance(p) == pytest.approx(best, abs=1e-12)


def test_truncation_never_beats_the_full_lp():
    p, q = toy(6, 4), toy(6, 5)
    full = truncated_lp(p, q, q, 6).acceptance(p)
    assert all(truncated_lp(p, q, q, top).acceptance(p) <= full + 1e-12 for top in range(1, 6))


def test_bad_truncation_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        truncated_lp(toy(3, 0), toy(3, 1), toy(3, 1), 0)


def test_verifier_refuses_an_empty_lp():
    from hf_treespec.verifiers.khisti import KhistiVerifier

    with pytest.raises(ValueError, match="lp_tokens"):
        KhistiVerifier(lp_tokens=0)
