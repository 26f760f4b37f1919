"""``tree_policy="dyspec"``: the batched construction equals the paper's one-draw-at-a-time heap, the threshold
variant, regimes and errors, and generate (greedy identity, sampling). Exact losslessness with ``swor`` / ``nss`` is
proved in test_verifiers_lossless.py (problems ``dyspec-*``)."""

from __future__ import annotations

import heapq
import itertools

import pytest
import torch

from hf_treespec.step_context import StepContext
from hf_treespec.policies.base import DraftSource

from hf_treespec.generation.components import resolve
from hf_treespec.policies import POLICIES
from hf_treespec.tree import DraftTree, Regime

from conftest import assert_drafted

VOCAB = 6
ROOT = 5


def table(path: tuple[int, ...]) -> torch.Tensor:
    """Fixed q(. | path), peaked enough that trees get deep; token 4 never has draft mass after token 1."""
    gen = torch.Generator().manual_seed(31 + sum((t + 1) * 7**i for i, t in enumerate(path)))
    probs = torch.softmax(2.5 * torch.randn(VOCAB, generator=gen), -1)
    if path and path[-1] == 1:
        probs[4] = 0
    return probs / probs.sum()


class TableSource(DraftSource):
    def __init__(self, q_fn=table):
        self.q_fn = q_fn
        self.batches: list[int] = []

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        self.batches.append(nodes.numel())
        return torch.stack([self.q_fn(path_of(tree, int(v))) for v in nodes]).log()


def path_of(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.paths()[node, 1 : int(tree.depth[node]) + 1].tolist())


class AscendingDraws:
    """A RandomSource whose sample without replacement is always the support in ascending token order (a fixed,
    non-greedy draw sequence the reference heap can replay)."""

    def without_replacement(self, probs: torch.Tensor, num: int) -> torch.Tensor:
        return probs.nonzero().flatten()[:num]


def reference_heap(q_fn, budget: int, order, threshold: float = 0.0, max_depth=None) -> list[tuple[int, ...]]:
    """Algorithm 1 of the paper, one draw per pop: returns the drawn paths in draw order. ``order(q)`` is the
    sibling draw sequence at a node (ranking or fixed sample)."""
    counter = itertools.count()
    heap = [(-1.0, next(counter), (), 0)]  # (-value, tie, node path, draws made at that node)
    drawn = []
    while heap and len(drawn) < budget:
        neg, _, path, j = heapq.heappop(heap)
        value = -neg
        if value < threshold or value <= 0:
            break
        q = q_fn(path)
        seq = order(q)
        if j >= len(seq):
            continue
        y = seq[j]
        child = path + (y,)
        drawn.append(child)
        mass_before = float(sum(q[t] for t in seq[: j + 1]))
        node_value = value / (1 - float(sum(q[t] for t in seq[:j]))) if j else value  # exp(score(path))
        heapq.heappush(heap, (-(node_value * (1 - mass_before)), next(counter), path, j + 1))
        if max_depth is None or len(child) < max_depth:
            heapq.heappush(heap, (-(node_value * float(q[y])), next(counter), child, 0))
    return drawn


def greedy_order(q):
    return [int(t) for t in torch.argsort(q, descending=True, stable=True) if q[t] > 0]


def ascending_order(q):
    return [int(t) for t in q.nonzero().flatten()]


def build(do_sample=False, generator=None, **params):
    source = TableSource()
    policy = POLICIES.get("dyspec")(do_sample=do_sample, **params)
    return policy.build(source, ROOT, context=StepContext(ROOT), generator=generator), source


def sibling_lists(tree: DraftTree) -> dict[tuple[int, ...], list[int]]:
    return {path_of(tree, v): tree.tokens[tree.children(v)].tolist() for v in range(tree.num_nodes)
            if tree.children(v).numel()}


def reference_sibling_lists(paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    out: dict[tuple[int, ...], list[int]] = {}
    for p in paths:
        out.setdefault(p[:-1], []).append(p[-1])
    return out


def test_hand_made_tree():
    """q(.|root) = [.5 .3 .2], q(.|0) = [.9 .1 0], q(.|1) = [.6 .4 0], q(.|0,0) = [.7 .3 0], budget 5. Heap pops by
    value: root's 1st draw (1) -> 0; 0's 1st (.5) -> 0,0; root's 2nd (.5) -> 1; 0,0's 1st (.45) -> 0,0,0;
    0,0,0's 1st (.315 if q = [.7 .3 0]) ties nothing above 1's 1st (.3) -> 0,0,0,0."""
    tables = {(): [0.5, 0.3, 0.2], (0,): [0.9, 0.1, 0.0], (1,): [0.6, 0.4, 0.0], (0, 0): [0.7, 0.3, 0.0],
              (0, 0, 0): [0.7, 0.3, 0.0]}

    def q_fn(path):
        return torch.tensor(tables.get(path, [0.4, 0.35, 0.25]))

    policy = POLICIES.get("dyspec")(do_sample=False, tree_budget=5)
    tree = policy.build(TableSource(q_fn), 2, context=StepContext(2))
    got = sorted(path_of(tree, v) for v in range(1, tree.num_nodes))
    assert got == sorted([(0,), (0, 0), (1,), (0, 0, 0), (0, 0, 0, 0)])
    assert sibling_lists(tree)[()] == [0, 1]  # siblings in draw order
    assert got == sorted(reference_heap(q_fn, 5, greedy_order))


@pytest.mark.parametrize("budget", [1, 3, 8, 20, 40])
@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_equals_reference_heap_greedy(budget, threshold):
    tree, source = build(tree_budget=budget, dyspec_threshold=threshold)
    ref = reference_heap(table, budget, greedy_order, threshold)
    assert sibling_lists(tree) == reference_sibling_lists(ref)
    assert tree.num_nodes - 1 == len(ref) <= budget
    assert len(source.batches) <= tree.max_depth + 1  # one draft forward per layer (never per node)


@pytest.mark.parametrize("budget", [4, 12, 30])
def test_equals_reference_heap_sampled(budget):
    """Sampling mode with a fixed draw sequence: same tree as the heap replaying those draws, q recorded at every
    node that has children, siblings in draw order."""
    tree, _ = build(do_sample=True, generator=AscendingDraws(), tree_budget=budget)
    ref = reference_heap(table, budget, ascending_order)
    assert sibling_lists(tree) == reference_sibling_lists(ref)
    assert tree.regime == Regime.SWOR
    for v in range(tree.num_nodes):
        if tree.children(v).numel():
            assert torch.allclose(tree.draft_q(v), table(path_of(tree, v)))


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_wide_layer_never_grows_the_tree_past_the_budget(monkeypatch, do_sample):
    """Draws that cannot make the budget's cut never enter the tree, so it never holds more than twice the budget (a
    512-node tree's second layer once asked for 230k nodes and a 53 GB ancestor matrix); the tree is the heap's."""
    sizes = []
    add_children = DraftTree.add_children

    def spy(self, *args, **kwargs):
        grown = add_children(self, *args, **kwargs)
        sizes.append(grown.num_nodes)
        return grown

    monkeypatch.setattr(DraftTree, "add_children", spy)
    generator = AscendingDraws() if do_sample else None
    tree, _ = build(do_sample=do_sample, generator=generator, tree_budget=20)
    ref = reference_heap(table, 20, ascending_order if do_sample else greedy_order)
    assert sibling_lists(tree) == reference_sibling_lists(ref)
    assert max(sizes) <= 1 + 2 * 20  # the kept draws + this layer's that make the cut, before the cut


def test_depth_bound_and_threshold_variant():
    tree, _ = build(tree_budget=40, tree_depth=2)
    assert tree.max_depth <= 2
    assert sibling_lists(tree) == reference_sibling_lists(reference_heap(table, 40, greedy_order, max_depth=2))
    # threshold variant: every drawn node's slot value is >= t, so at most ~1/t per layer
    small, _ = build(tree_budget=1000, dyspec_threshold=0.1)
    big, _ = build(tree_budget=1000, dyspec_threshold=0.01)
    assert small.num_nodes < big.num_nodes < 1000


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2])
def test_threshold_out_of_range(bad):
    with pytest.raises(ValueError, match="dyspec_threshold must be in"):
        POLICIES.get("dyspec")(do_sample=True, dyspec_threshold=bad)


def test_resolve_regime():
    from transformers import GenerationConfig

    policy, verifier = resolve(GenerationConfig(do_sample=True, tree_policy="dyspec"))
    assert policy.regime_for() == Regime.SWOR and verifier.name == "swor"
    assert resolve(GenerationConfig(do_sample=True, tree_policy="dyspec", verifier="nss"))[1].name == "nss"
    with pytest.raises(ValueError, match="not lossless"):
        resolve(GenerationConfig(do_sample=True, tree_policy="dyspec", verifier="specinfer"))


# -------------------------------------------------------------------------------------------- generate end to end
@pytest.mark.parametrize("params", [{"tree_budget": 12}, {"tree_budget": 30, "dyspec_threshold": 0.02},
                                    {"tree_budget": 1}])
def test_greedy_generate_is_plain_greedy(target, drafters, prompt, params):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=24)
    out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafters["perturbed"],
                          tree_policy="dyspec", return_dict_in_generate=True, **params)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    assert max(out.tree_sizes) <= params["tree_budget"]


def test_monte_carlo_through_generate(target, drafters):
    """dyspec + swor through generate: the law of the first two new tokens matches plain sampling from the target
    (p computed exactly from the target's logits), chi-square p-value > 1e-6 with a fixed seed."""
    from scipy.stats import chi2

    prompt = torch.tensor([[3, 17, 42, 8, 8, 21]])
    kwargs = dict(do_sample=True, temperature=1.0, top_k=3)
    with torch.no_grad():
        logits = target(prompt).logits[0, -1]
    p1 = torch.softmax(logits.masked_fill(logits < logits.topk(3).values[-1], float("-inf")), -1)
    want = {}
    for a in p1.nonzero().flatten().tolist():
        with torch.no_grad():
            la = target(torch.cat([prompt, torch.tensor([[a]])], 1)).logits[0, -1]
        p2 = torch.softmax(la.masked_fill(la < la.topk(3).values[-1], float("-inf")), -1)
        for b in p2.nonzero().flatten().tolist():
            want[(a, b)] = float(p1[a] * p2[b])
    torch.manual_seed(0)
    runs = 400
    counts: dict[tuple[int, int], int] = {}
    outs = []
    for _ in range(runs):
        out = target.generate(prompt, max_new_tokens=2, assistant_model=drafters["perturbed"], tree_policy="dyspec",
                              tree_budget=6, return_dict_in_generate=True, **kwargs)
        outs.append(out)
        key = tuple(out.sequences[0, -2:].tolist())
        counts[key] = counts.get(key, 0) + 1
    # the second token comes from the tree step (an accepted draft or the verifier's own draw), but max_new_tokens
    # cuts every step's chunk to that one token: accepted lengths cannot show an acceptance here
    assert_drafted(outs, accepting=False)
    assert set(counts) <= set(want)
    cells = [k for k in want if want[k] * runs >= 5]
    stat = sum((counts.get(k, 0) - want[k] * runs) ** 2 / (want[k] * runs) for k in cells)
    rest = runs - sum(counts.get(k, 0) for k in cells)
    rest_want = runs * (1 - sum(want[k] for k in cells))
    if rest_want > 0:
        stat += (rest - rest_want) ** 2 / rest_want
    assert chi2.sf(stat, len(cells)) > 1e-6, stat
