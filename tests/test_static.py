"""``tree_policy="static"`` and the Sequoia dynamic program that picks its shape."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_treespec.step_context import StepContext
from hf_treespec.policies.base import DraftSource

from hf_treespec.policies import POLICIES
from hf_treespec.policies.static import check_shape, choose_shape, expected_accepted, sequoia_shape
from hf_treespec.tree import DraftTree

from conftest import assert_drafted


def path_of(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.paths()[node, 1 : int(tree.depth[node]) + 1].tolist())


class Source(DraftSource):
    """q(. | path) over 5 tokens: ranks are a fixed permutation per path; token 4 has no mass below token 3."""

    def __init__(self):
        self.calls = []

    def q(self, path):
        gen = torch.Generator().manual_seed(5 + sum((t + 1) * 7**i for i, t in enumerate(path)))
        probs = torch.softmax(2 * torch.randn(5, generator=gen), -1)
        if path and path[-1] == 3:
            probs[4] = 0
        return probs / probs.sum()

    def logprobs(self, tree, nodes):
        self.calls.append(nodes.numel())
        return torch.stack([self.q(path_of(tree, int(v))) for v in nodes]).log()


def test_hand_made_shape():
    source = Source()
    shape = [[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 1, 0]]
    tree = POLICIES.get("static")(tree_shape=shape).build(source, 9, context=StepContext(9))
    assert len(source.calls) == 3 and source.calls == [1, 2, 1]  # one forward per level
    rank = lambda path: [int(t) for t in torch.argsort(source.q(path), descending=True, stable=True)]  # noqa: E731
    want = []
    for ranks in shape:
        tokens = []
        for r in ranks:
            tokens.append(rank(tuple(tokens))[r])
        want.append(tuple(tokens))
    assert [path_of(tree, v) for v in range(1, tree.num_nodes)] == want
    for v in range(1, tree.num_nodes):
        parent = int(tree.parents[v])
        assert torch.allclose(tree.scores[v], tree.scores[parent] + source.q(path_of(tree, parent))[tree.tokens[v]].log())


def test_missing_draft_mass_drops_the_subtree():
    """Rank 4 below a token-3 node has no draft mass: that node and its descendants are left out."""
    source = Source()
    q_root = source.q(())
    r3 = int(torch.argsort(q_root, descending=True, stable=True).tolist().index(3))
    shape = [[r3], [r3, 0], [r3, 4], [r3, 4, 0]]
    tree = POLICIES.get("static")(tree_shape=shape).build(source, 9, context=StepContext(9))
    assert tree.num_nodes == 3 and 4 not in tree.tokens[2:].tolist()


@pytest.mark.parametrize("shape,match", [([], "empty"), ([[0], [0, 1], [1, 1, 0]], "parent"), ([[0], [0]], "twice"),
                                         ([[0], [-1]], "ranks >= 0"), ("abc", "child-rank paths")])
def test_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        POLICIES.get("static")(tree_shape=shape)


def test_shape_and_budget_are_exclusive():
    with pytest.raises(ValueError, match="either tree_shape"):
        POLICIES.get("static")(tree_shape=[[0]], tree_budget=10)
    assert len(POLICIES.get("static")(tree_budget=10).shape) == 10


def brute_force(acceptance, budget, depth):
    """Best expected_accepted over every prefix-closed set of <= budget paths (ranks < len(acceptance))."""
    candidates = [p for d in range(1, depth + 1) for p in itertools.product(range(len(acceptance)), repeat=d)]
    best = 0.0
    for size in range(1, budget + 1):
        for subset in itertools.combinations(candidates, size):
            chosen = set(subset)
            if all(len(p) == 1 or p[:-1] in chosen for p in subset):
                best = max(best, expected_accepted(subset, acceptance))
    return best


@pytest.mark.parametrize("acceptance,budget,depth", [((0.5, 0.3), 4, 3), ((0.7, 0.1, 0.15), 4, 2),
                                                     ((0.2, 0.6), 5, 3), ((0.9, 0.05), 5, 4)])
def test_dp_is_optimal(acceptance, budget, depth):
    shape = sequoia_shape(acceptance, budget, depth)
    check_shape(shape)
    assert len(shape) <= budget and max(len(p) for p in shape) <= depth
    assert expected_accepted(shape, acceptance) == pytest.approx(brute_force(acceptance, budget, depth), abs=1e-12)


def test_choose_shape_trades_tokens_for_time():
    acceptance = (0.6, 0.2, 0.05)
    free, _ = choose_shape(acceptance, [4, 16, 48], lambda nodes, depth: 1.0)
    costly, info = choose_shape(acceptance, [4, 16, 48], lambda nodes, depth: 1.0 + 0.1 * nodes)
    assert len(free) == 48 and len(costly) == 4 and info["nodes"] == 4


def test_greedy_generate_is_plain_greedy(target, drafters, prompt):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    for params in ({"tree_shape": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}, {"tree_budget": 12}, {}):
        out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafters["perturbed"],
                              tree_policy="static", return_dict_in_generate=True, **params)
        assert_drafted(out)
        assert torch.equal(out.sequences, ref), params


def test_sampling_fills_the_shape_without_replacement_and_verifies_with_swor(target, drafters, prompt):
    """Sequoia at T > 0: each node's children are the first draws of a sampling-without-replacement sequence (the
    SWOR verifier's regime, its default); NSS stays allowed. Losslessness: test_verifiers_lossless.py
    ('static-sampled', exact and Monte-Carlo)."""
    from transformers import GenerationConfig

    from hf_treespec.generation.components import resolve

    policy, verifier = resolve(GenerationConfig(do_sample=True, tree_policy="static"))
    assert verifier.name == "swor" and policy.regime_for() == "swor"
    assert resolve(GenerationConfig(do_sample=True, tree_policy="static", verifier="nss"))[1].name == "nss"
    torch.manual_seed(0)
    out = target.generate(prompt, do_sample=True, max_new_tokens=10, assistant_model=drafters["perturbed"],
                          tree_policy="static", return_dict_in_generate=True)
    assert out.sequences.shape[1] == prompt.shape[1] + 10
    assert_drafted(out)
    assert max(out.tree_sizes) > 1


def test_sampled_shape_must_not_skip_a_rank():
    with pytest.raises(ValueError, match="no sibling of rank 0"):
        POLICIES.get("static")(do_sample=True, tree_shape=[[0], [0, 1]])
    POLICIES.get("static")(do_sample=False, tree_shape=[[0], [0, 1]])  # greedy: any ranks
