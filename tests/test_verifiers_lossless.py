"""Every sampling verifier preserves the target distribution, checked exactly on toy problems.

One speculative step = the policy samples a tree from fixed draft tables q(. | path), the verifier emits accepted
drafts + one token. Its output law is computed *exactly*: `enumerate_outcomes` walks every random choice of the
policy (which tree) and of the verifier (Bernoulli tests, residual draws, orderings) with its probability, in the
production code paths. Completing each emitted sequence with the target p up to a fixed length must give exactly the
target's law of sequences of that length (so every prefix, first token included, is right) to 1e-9, in float64.
A Monte-Carlo run through torch.Generator checks the same with a chi-square bound.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from scipy.stats import chi2

from hf_treespec.policies import POLICIES, DraftSource, StepContext
from hf_treespec.randomness import enumerate_outcomes
from hf_treespec.tree import DraftTree, Regime
from hf_treespec.verifiers import VERIFIERS
from hf_treespec.verifiers.khisti import KhistiVerifier
from hf_treespec.verifiers.khisti_lp import truncated_lp
from hf_treespec.verifiers.spectr import kseq_division_factor

ROOT = 0
SAMPLING = [name for name in VERIFIERS if VERIFIERS.get(name).sampling]



# --------------------------------------------------------------------------------------------------- toy tables
@functools.lru_cache(maxsize=None)
def toy_table(kind: int, path: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A fixed distribution per (kind, path): kind 0 = target p, kind 1 = draft q. Some entries are exact zeros
    (as top-k / top-p warping makes), placed differently for p and q so both p>0=q and q>0=p occur."""
    seed = 7919 * kind + sum((t + 1) * (vocab + 1) ** i for i, t in enumerate(path)) + 101 * len(path)
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(1.5 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    if kind == 0 and len(path) % 2 == 1:
        probs[(path[-1] + 1) % vocab] = 0
    if kind == 1 and len(path) % 2 == 0:
        probs[sum(path) % vocab] = 0
    return probs / probs.sum()


class TableSource(DraftSource):
    """A `DraftSource` reading q(. | path) from a table instead of a network."""

    def __init__(self, q_fn):
        self.q_fn = q_fn

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.q_fn(node_path(tree, int(v))) for v in nodes]).log()


def node_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.paths()[node, 1 : int(tree.depth[node]) + 1].tolist())


def target_logits(tree: DraftTree, p_fn) -> torch.Tensor:
    return torch.stack([p_fn(node_path(tree, v)) for v in range(tree.num_nodes)]).log()


def tree_key(tree: DraftTree) -> tuple:
    return (tuple(tree.tokens.tolist()), tuple(tree.parents.tolist()), tuple(tree.multiplicity().tolist()))


# ----------------------------------------------------------------------------------------------- exact machinery
def tree_law(policy, q_fn, source_type=TableSource) -> list[tuple[DraftTree, float]]:
    """Every tree the policy can draft, with its exact probability."""
    trees: dict[tuple, DraftTree] = {}

    def run(source):  # deterministic policies draw nothing: a single outcome of probability 1
        tree = policy.build(source_type(q_fn), ROOT, context=StepContext(ROOT), generator=source)
        trees[tree_key(tree)] = tree
        return tree_key(tree)

    law = enumerate_outcomes(run)
    assert math.isclose(sum(law.values()), 1.0, abs_tol=1e-12)
    return [(trees[key], prob) for key, prob in law.items()]


def emitted(tree: DraftTree, result) -> tuple[int, ...]:
    return tuple(tree.tokens[result.accepted[1:]].tolist()) + (int(result.next_token),)


def step_law(verifier, trees, p_fn) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted tokens of one step, integrated over trees and verifier randomness."""
    law: dict[tuple[int, ...], float] = {}
    for tree, weight in trees:
        logits = target_logits(tree, p_fn)
        outcomes = enumerate_outcomes(lambda source: emitted(tree, verifier.verify(tree, logits, generator=source)))
        for seq, prob in outcomes.items():
            law[seq] = law.get(seq, 0.0) + weight * prob
    return law


def completed(law: dict[tuple[int, ...], float], p_fn, length: int) -> dict[tuple[int, ...], float]:
    """Extends every emitted sequence with the target p up to ``length`` tokens (what later steps would do)."""
    out: dict[tuple[int, ...], float] = {}
    stack = list(law.items())
    while stack:
        seq, prob = stack.pop()
        if len(seq) == length:
            out[seq] = out.get(seq, 0.0) + prob
            continue
        for token, pt in enumerate(p_fn(seq).tolist()):
            if pt > 0:
                stack.append((seq + (token,), prob * pt))
    return out


def target_law(p_fn, vocab: int, length: int) -> dict[tuple[int, ...], float]:
    law = {}
    for seq in itertools.product(range(vocab), repeat=length):
        law[seq] = math.prod(float(p_fn(seq[:i])[t]) for i, t in enumerate(seq))
    return law


def assert_lossless(law, p_fn, vocab: int, length: int, atol: float = 1e-9) -> None:
    assert math.isclose(sum(law.values()), 1.0, abs_tol=atol)
    first = {}
    for seq, prob in law.items():
        first[seq[0]] = first.get(seq[0], 0.0) + prob
    p_root = p_fn(())
    for token in range(vocab):
        assert abs(first.get(token, 0.0) - float(p_root[token])) < atol, (token, first, p_root)
    got, want = completed(law, p_fn, length), target_law(p_fn, vocab, length)
    worst = max(abs(got.get(seq, 0.0) - prob) for seq, prob in want.items())
    assert worst < atol, f"max |P(emitted prefix) - p| = {worst:.3g}"
    assert set(got) <= set(want)


# ---------------------------------------------------------------------------------------------------- problems
# (policy, params, vocab): trees whose shapes exercise chains, multiplicities, trunks and without-replacement siblings
PROBLEMS = {
    "chain": ("iid", {"tree_paths": 1, "tree_depth": 3}, 3),
    "iid-2x2": ("iid", {"tree_paths": 2, "tree_depth": 2}, 3),
    "iid-3x1": ("iid", {"tree_paths": 3, "tree_depth": 1}, 4),
    "delayed-1-2-1": ("delayed", {"delay_trunk": 1, "tree_paths": 2, "delay_branch": 1}, 3),
    "swor-2x2": ("swor", {"tree_topk": 2, "tree_depth": 2}, 3),
    "swor-3x1": ("swor", {"tree_topk": 3, "tree_depth": 1}, 4),
    "eagle2": ("eagle2", {"tree_topk": 2, "tree_depth": 2, "tree_budget": 6}, 3),
    # DySpec heap trees: how many siblings a node gets depends on earlier draws (budget-N cut and threshold)
    "dyspec-b4": ("dyspec", {"tree_budget": 4}, 3),
    "dyspec-b5-t": ("dyspec", {"tree_budget": 5, "dyspec_threshold": 0.15}, 3),
    # Sequoia's static shape filled by sampling without replacement (ranks = draw order)
    "static-sampled": ("static", {"tree_shape": [[0], [1], [0, 0], [0, 1], [1, 0]]}, 3),
}


def make_policy(name: str):
    policy_name, params, vocab = PROBLEMS[name]
    return POLICIES.get(policy_name)(do_sample=True, **params), vocab


def allowed(verifier: str, policy) -> bool:
    try:
        VERIFIERS.get(verifier).check_compatible(policy.regime_for(), is_chain=policy.is_chain, do_sample=True)
    except ValueError:
        return False
    return True


CASES = [
    (problem, verifier)
    for problem in PROBLEMS
    for verifier in SAMPLING
    if allowed(verifier, make_policy(problem)[0])
]


def test_every_sampling_verifier_is_covered():
    covered = {verifier for _, verifier in CASES}
    assert covered == set(SAMPLING) == {
        "nss", "naive", "block", "naivetree", "specinfer", "spectr", "khisti", "khisti_priority", "traversal", "swor"
    }


@pytest.fixture(scope="module")
def tree_laws():
    cache = {}

    def get(problem: str, p_fn=None, q_fn=None):
        policy, vocab = make_policy(problem)
        q_fn = q_fn or (lambda path: toy_table(1, path, vocab))
        key = (problem, q_fn)
        if key not in cache:
            cache[key] = tree_law(policy, q_fn)
        return cache[key]

    return get


@pytest.mark.parametrize("problem,verifier", CASES)
def test_exact_lossless(problem, verifier, tree_laws):
    policy, vocab = make_policy(problem)
    p_fn = lambda path: toy_table(0, path, vocab)  # noqa: E731
    trees = tree_laws(problem)
    law = step_law(VERIFIERS.get(verifier)(), trees, p_fn)
    depth = max(int(tree.max_depth) for tree, _ in trees)
    assert_lossless(law, p_fn, vocab, depth + 1)


class ReducedVocabSource(TableSource):
    """A drafter's reduced vocabulary: q is zero outside ``support`` at every node (and at one more column at some
    nodes: the support is a superset), p is not."""

    support = torch.tensor([0, 2, 4])


def reduced_q(path: tuple[int, ...]) -> torch.Tensor:
    q = toy_table(1, path, 5).clone()
    q[[1, 3]] = 0
    return q / q.sum()


@pytest.mark.parametrize("problem", ["dyspec-b4", "static-sampled"])
def test_exact_lossless_over_a_declared_support(problem):
    """The SWOR walk over the source's declared columns (`DraftSource.support` -> `DraftTree.draft_support`, or the
    positive ones among them), the tokens outside them pooled into one entry and drawn from p there: every tree was
    drawn from the support, the verification still emits the target law."""
    policy, _ = make_policy(problem)
    trees = tree_law(policy, reduced_q, ReducedVocabSource)
    for tree in (tree for tree, _ in trees if tree.num_nodes > 1):  # the declared columns, or the positive ones
        assert set(tree.draft_support.tolist()) <= {0, 2, 4}
        assert set((tree.draft_probs > 0).any(0).nonzero().squeeze(-1).tolist()) <= set(tree.draft_support.tolist())
    assert all(set(tree.tokens[1:].tolist()) <= {0, 2, 4} for tree, _ in trees)
    p_fn = lambda path: toy_table(0, path, 5)  # noqa: E731
    law = step_law(VERIFIERS.get("swor")(), trees, p_fn)
    assert_lossless(law, p_fn, 5, max(int(tree.max_depth) for tree, _ in trees) + 1)


def varying_q(path: tuple[int, ...]) -> torch.Tensor:
    """q zero on one or two columns that change with the node (found by the draws, not declared)."""
    q = toy_table(1, path, 5).clone()
    q[[len(path) % 5, (sum(path) + 3) % 5]] = 0
    return q / q.sum()


@pytest.mark.parametrize("problem", ["dyspec-b4", "static-sampled"])
def test_exact_lossless_over_the_columns_the_draws_found(problem):
    """No declared support, q zero on columns that vary by node: a draw round finds its rows' positive columns once
    (`support_columns`), the tree keeps the union over its rounds, and the SWOR walk over it still emits the target
    law; every column where a recorded q row is positive is in the tree's support."""
    policy, _ = make_policy(problem)
    trees = tree_law(policy, varying_q, TableSource)
    drafted = [tree for tree, _ in trees if tree.num_nodes > 1]
    assert drafted and all(tree.draft_support is not None for tree in drafted)
    for tree in drafted:
        positive = (tree.draft_probs > 0).any(0).nonzero().squeeze(-1)
        assert set(positive.tolist()) <= set(tree.draft_support.tolist())
        assert torch.equal(tree.draft_support, tree.draft_support.sort().values)
    p_fn = lambda path: toy_table(0, path, 5)  # noqa: E731
    law = step_law(VERIFIERS.get("swor")(), trees, p_fn)
    assert_lossless(law, p_fn, 5, max(int(tree.max_depth) for tree, _ in trees) + 1)


@pytest.mark.parametrize("verifier", ["specinfer", "spectr", "khisti", "khisti_priority", "traversal", "naivetree"])
def test_exact_lossless_when_draft_equals_target(verifier):
    """p == q everywhere: still exactly p, and every draft is accepted except by the priority tournament, whose
    selected draft follows the law r != q (Khisti's LP splits every pair so that r == p)."""
    policy, vocab = make_policy("iid-3x1")
    fn = lambda path: toy_table(0, path, vocab)  # noqa: E731
    trees = tree_law(policy, fn)
    law = step_law(VERIFIERS.get(verifier)(), trees, fn)
    assert_lossless(law, fn, vocab, 2)
    full = sum(prob for seq, prob in law.items() if len(seq) == 2)
    assert full < 1 - 1e-3 if verifier == "khisti_priority" else full == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("verifier", ["naivetree", "specinfer", "spectr", "khisti", "khisti_priority", "traversal"])
def test_multi_draft_acceptance(verifier, tree_laws):
    """Losslessness alone would not catch a verifier that never accepts: with k = 3 i.i.d. drafts at the root, the
    acceptance rate must reach single-draft speculative sampling's sum min(p, q), and exceed it for the verifiers
    that test more than one draft."""
    policy, vocab = make_policy("iid-3x1")
    p_fn = lambda path: toy_table(0, path, vocab)  # noqa: E731
    law = step_law(VERIFIERS.get(verifier)(), tree_laws("iid-3x1"), p_fn)
    accepted = sum(prob for seq, prob in law.items() if len(seq) == 2)
    single = float(torch.minimum(p_fn(()), toy_table(1, (), vocab)).sum())
    assert accepted >= single - 1e-12
    if verifier in ("specinfer", "spectr", "khisti", "traversal"):
        assert accepted > single + 1e-3


@pytest.mark.parametrize("problem", ["iid-3x1", "iid-2x2", "delayed-1-2-1"])
@pytest.mark.parametrize("lp_tokens", [1, 2])
def test_khisti_with_a_truncated_lp_is_exactly_lossless(problem, lp_tokens, tree_laws):
    """With fewer LP tokens than the vocabulary, pairs with a token outside the LP go by the fixed priority: exact."""
    policy, vocab = make_policy(problem)
    p_fn = lambda path: toy_table(0, path, vocab)  # noqa: E731
    trees = tree_laws(problem)
    law = step_law(KhistiVerifier(lp_tokens=lp_tokens), trees, p_fn)
    assert_lossless(law, p_fn, vocab, max(int(tree.max_depth) for tree, _ in trees) + 1)


def test_khisti_on_two_drafts_reaches_the_optimal_acceptance():
    """Two i.i.d. drafts, LP untruncated: P(a draft is emitted) is the optimum over every lossless two-draft rule,
    min over token sets W of p(W) + 1 - q(W)^2; the three-draft tournament accepts at least its final
    single-draft test, sum min(p, r_3)."""
    vocab = 4
    p, q = toy_table(0, (), vocab), toy_table(1, (), vocab)
    policy = POLICIES.get("iid")(do_sample=True, tree_paths=2, tree_depth=1)
    trees = tree_law(policy, lambda path: toy_table(1, path, vocab))
    law = step_law(KhistiVerifier(lp_tokens=vocab), trees, lambda path: toy_table(0, path, vocab))
    best = min(float(p[list(w)].sum()) + 1 - float(q[list(w)].sum()) ** 2
               for n in range(vocab + 1) for w in itertools.combinations(range(vocab), n))
    assert sum(prob for seq, prob in law.items() if len(seq) == 2) == pytest.approx(best, abs=1e-12)

    law = step_law(KhistiVerifier(), tree_law(make_policy("iid-3x1")[0], lambda path: toy_table(1, path, vocab)),
                   lambda path: toy_table(0, path, vocab))
    r3 = truncated_lp(p, truncated_lp(p, q, q, 5).law, q, 5).law
    assert sum(prob for seq, prob in law.items() if len(seq) == 2) >= float(torch.minimum(p, r3).sum()) - 1e-12


# ------------------------------------------------------------------------------------------------- block / traversal
def constant_fn(values):
    probs = torch.tensor(values, dtype=torch.float64)
    return lambda path: probs


def chain_law(verifier: str, p_fn, q_fn, depth: int):
    policy = POLICIES.get("iid")(do_sample=True, tree_paths=1, tree_depth=depth)
    return step_law(VERIFIERS.get(verifier)(), tree_law(policy, q_fn), p_fn)


def expected_accepted(law) -> float:
    return sum(prob * (len(seq) - 1) for seq, prob in law.items())


def test_block_verification_toy_case():
    """Sun et al.'s example: p = [1/3, 2/3], q = [2/3, 1/3], g = 2: E[tau] = 10/9 token-wise, 11/9 with BV."""
    p_fn, q_fn = constant_fn([1 / 3, 2 / 3]), constant_fn([2 / 3, 1 / 3])
    naive, block = chain_law("naive", p_fn, q_fn, 2), chain_law("block", p_fn, q_fn, 2)
    assert expected_accepted(naive) == pytest.approx(10 / 9, abs=1e-12)
    assert expected_accepted(block) == pytest.approx(11 / 9, abs=1e-12)
    assert_lossless(naive, p_fn, 2, 3)
    assert_lossless(block, p_fn, 2, 3)
    assert expected_accepted(chain_law("traversal", p_fn, q_fn, 2)) == pytest.approx(11 / 9, abs=1e-12)


@pytest.mark.parametrize("vocab,depth", [(3, 3), (4, 2)])
def test_traversal_on_a_chain_is_block_verification(vocab, depth):
    p_fn = lambda path: toy_table(0, path, vocab)  # noqa: E731
    q_fn = lambda path: toy_table(1, path, vocab)  # noqa: E731
    block, traversal = chain_law("block", p_fn, q_fn, depth), chain_law("traversal", p_fn, q_fn, depth)
    assert set(block) == set(traversal)
    for seq, prob in block.items():
        assert traversal[seq] == pytest.approx(prob, abs=1e-12)
    # and block verification accepts at least as much as token-wise verification
    assert expected_accepted(block) >= expected_accepted(chain_law("naive", p_fn, q_fn, depth)) - 1e-12


def test_traversal_on_one_level_is_specinfer_and_wins_deeper(tree_laws):
    """On one level of i.i.d. drafts traversal has SpecInfer's law; deeper, bottom-up verification accepts more."""
    for problem, deeper in (("iid-3x1", False), ("iid-2x2", True)):
        vocab = PROBLEMS[problem][2]
        p_fn = lambda path: toy_table(0, path, vocab)  # noqa: E731
        specinfer = step_law(VERIFIERS.get("specinfer")(), tree_laws(problem), p_fn)
        traversal = step_law(VERIFIERS.get("traversal")(), tree_laws(problem), p_fn)
        if not deeper:
            assert set(specinfer) == set(traversal)
            assert all(traversal[seq] == pytest.approx(prob, abs=1e-12) for seq, prob in specinfer.items())
        else:
            assert expected_accepted(traversal) > expected_accepted(specinfer) + 0.01


def test_traversal_refuses_unmerged_duplicate_siblings():
    tree = DraftTree.root(ROOT, regime=Regime.IID)
    tree = tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 1]), torch.zeros(2))
    tree = tree.record_draft_probs(torch.tensor([0]), torch.full((1, 3), 1 / 3))
    with pytest.raises(ValueError, match="merged"):
        VERIFIERS.get("traversal")().verify(tree, torch.zeros(3, 3))


def test_kseq_division_factor():
    gen = torch.Generator().manual_seed(0)
    for k in (2, 3, 5):
        p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)
        q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)
        rho, beta, p_acc = kseq_division_factor(p, q, k)
        assert 1 <= rho <= k
        assert float(p_acc) <= rho * float(beta) + 1e-15  # the side that keeps the residual non-negative
        assert float(p_acc) == pytest.approx(rho * float(beta), abs=1e-4)  # and close to the root
    p = torch.tensor([0.2, 0.8], dtype=torch.float64)
    assert kseq_division_factor(p, p.flip(0), 1)[0] == 1.0


# ---------------------------------------------------------------------------------------------------- refusals
PAIRS = [(regime, name) for regime in Regime.ALL for name in SAMPLING]


@pytest.mark.parametrize("regime,name", PAIRS)
def test_regime_compatibility(regime, name):
    """A (regime, verifier) pair is accepted exactly when the verifier is lossless for it (docs/algorithms.md table)."""
    lossless = {
        Regime.DETERMINISTIC: {"nss"},
        Regime.IID: {"nss", "naive", "block", "naivetree", "specinfer", "spectr", "khisti", "khisti_priority",
                     "traversal"},
        Regime.SWOR: {"nss", "naive", "block", "swor"},
    }
    cls = VERIFIERS.get(name)
    if name in lossless[regime]:
        cls.check_compatible(regime, is_chain=True, do_sample=True)
        if not cls.chain_only:
            cls.check_compatible(regime, is_chain=False, do_sample=True)
    else:
        with pytest.raises(ValueError, match="not lossless"):
            cls.check_compatible(regime, is_chain=True, do_sample=True)


@pytest.mark.parametrize("name", ["naive", "block"])
def test_chain_only_verifiers_refuse_trees(name):
    with pytest.raises(ValueError, match="single chain"):
        VERIFIERS.get(name).check_compatible(Regime.IID, is_chain=False, do_sample=True)


@pytest.mark.parametrize("name", SAMPLING)
def test_sampling_verifiers_refuse_greedy(name):
    with pytest.raises(ValueError, match="greedy"):
        VERIFIERS.get(name).check_compatible(Regime.IID, is_chain=True, do_sample=False)


# ------------------------------------------------------------------------------------------------- Monte Carlo
# one case per random primitive of hf_treespec.randomness on the torch.Generator path: multinomial counts (iid
# policy), Gumbel-top-k (swor policy), scalar and vector Bernoulli trials, categorical draws
MC_CASES = [("iid-2x2", "specinfer"), ("iid-2x2", "spectr"), ("iid-2x2", "traversal"), ("swor-2x2", "swor"),
            ("dyspec-b4", "swor"), ("static-sampled", "swor")]


@pytest.mark.parametrize("problem,verifier", MC_CASES)
def test_monte_carlo_lossless(problem, verifier):
    """The torch.Generator path: the first two emitted tokens (completed with p) follow p, chi-square p-value > 1e-6
    (the seed is fixed, so this is deterministic; a bias of about 0.06 in one cell would fail it)."""
    policy, vocab = make_policy(problem)
    p_fn = lambda path: toy_table(0, path, vocab)  # noqa: E731
    source = TableSource(lambda path: toy_table(1, path, vocab))
    gen = torch.Generator().manual_seed(1234)
    verifier_ = VERIFIERS.get(verifier)()
    runs = 1000
    counts = torch.zeros(vocab, vocab)
    for _ in range(runs):
        tree = policy.build(source, ROOT, context=StepContext(ROOT), generator=gen)
        seq = emitted(tree, verifier_.verify(tree, target_logits(tree, p_fn), generator=gen))
        second = seq[1] if len(seq) > 1 else int(torch.multinomial(p_fn(seq[:1]), 1, generator=gen))
        counts[seq[0], second] += 1
    want = torch.tensor([[float(p_fn(())[a] * p_fn((a,))[b]) for b in range(vocab)] for a in range(vocab)])
    cells = want > 0
    assert counts[~cells].sum() == 0
    expected = want[cells] * runs
    stat = float(((counts[cells] - expected) ** 2 / expected).sum())
    assert chi2.sf(stat, int(cells.sum()) - 1) > 1e-6, stat


@pytest.mark.parametrize("verifier", sorted(VERIFIERS.names()))
def test_target_choice_is_the_root_only_verification(verifier):
    """A draft-free step skips verification and asks the verifier for the target's own choice: exactly what
    verifying a root-only tree gives (the argmax at T=0, else a draw from the target distribution)."""
    cls = VERIFIERS.get(verifier)
    logits = torch.tensor([[0.3, -1.0, 1.2, 0.1, float("-inf")]], dtype=torch.float32)
    tree = DraftTree.root(2)
    if not cls.sampling:
        assert cls().target_choice(logits[0]) == cls().verify(tree, logits).next_token == 2
        return
    law = enumerate_outcomes(lambda source: cls().target_choice(logits[0], source))
    target = logits[0].double().softmax(-1)
    assert set(law) == {0, 1, 2, 3}
    for token, prob in law.items():
        assert prob == pytest.approx(float(target[token]), abs=1e-6)
    if not cls.chain_only and not cls.needs_draft_probs:
        assert enumerate_outcomes(lambda source: cls().verify(tree, logits, source).next_token) == pytest.approx(law)


def test_categorical_rows_draws_each_rows_law_and_never_a_zero_weight(monkeypatch):
    """The inverse-CDF draw that replaces ``torch.multinomial(probs, 1)``: Monte-Carlo frequencies of 200k draws per
    row within 5 standard errors of each row's (unnormalised) weights, a zero weight never drawn, and a uniform that
    rounds onto the total still lands on the row's last positive weight."""
    from hf_treespec.randomness import categorical_rows

    weights = torch.tensor([[0.0, 1.0, 0.0, 6.0, 3.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    n = 200_000
    draws = categorical_rows(weights.repeat_interleave(n, dim=0), torch.Generator().manual_seed(3)).view(2, n)
    for row, law in zip(draws, weights / weights.sum(-1, keepdim=True)):
        freq = torch.bincount(row, minlength=6).double() / n
        assert torch.all(freq[law == 0] == 0)
        assert torch.all((freq - law.double()).abs() <= 5 * (law.double() * (1 - law.double()) / n).sqrt() + 1e-12)
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *args, **kwargs: self.fill_(1.0))
    assert categorical_rows(weights).tolist() == [4, 5]
