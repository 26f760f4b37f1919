"""The sampled drafting policies (iid, delayed, swor): tree shapes, regimes, recorded q, sampling laws, and generate.

Their exact losslessness together with every verifier they allow is proved in test_verifiers_lossless.py.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import hf_treespec
from hf_treespec.generation.components import resolve
from hf_treespec.policies import POLICIES, DraftSource, StepContext
from hf_treespec.randomness import multinomial_counts, without_replacement
from hf_treespec.tree import DraftTree, Regime
from hf_treespec.verifiers import VERIFIERS

from conftest import assert_drafted, fixed_budget

VOCAB = 6



def table(path: tuple[int, ...]) -> torch.Tensor:
    """Fixed q(. | path); the last token always has probability 0 (like a top-k warped draft)."""
    gen = torch.Generator().manual_seed(17 + sum((t + 1) * 7**i for i, t in enumerate(path)))
    probs = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
    probs[-1] = 0
    return probs / probs.sum()


class FakeSource(DraftSource):
    """A `DraftSource` over ``table``, recording every batch of nodes it was asked to expand."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        self.batches.append(nodes.tolist())
        return torch.stack([table(path_of(tree, int(v))) for v in nodes]).log()


def path_of(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.paths()[node, 1 : int(tree.depth[node]) + 1].tolist())


def build(name: str, seed: int = 0, do_sample: bool = True, **params):
    torch.manual_seed(seed)
    source = FakeSource()
    policy = POLICIES.get(name)(do_sample=do_sample, **params)
    return policy, policy.build(source, 5, context=StepContext(5)), source


def check_common(tree: DraftTree, source: FakeSource, regime: str) -> None:
    assert tree.regime == regime
    assert int(tree.tokens[0]) == 5 and int(tree.parents[0]) == -1
    assert bool((tree.parents[1:] < torch.arange(1, tree.num_nodes)).all())
    expanded = sorted(v for batch in source.batches for v in batch)
    assert len(expanded) == len(set(expanded))
    # q recorded at exactly the expanded nodes, equal to what the source returned; scores are cumulative log q
    recorded = (tree.q_index >= 0).nonzero().flatten().tolist()
    assert recorded == expanded
    for v in expanded:
        assert torch.allclose(tree.draft_q(v), table(path_of(tree, v)), atol=1e-6)
    for v in range(1, tree.num_nodes):
        parent = int(tree.parents[v])
        step = table(path_of(tree, parent))[int(tree.tokens[v])].log()
        assert torch.allclose(tree.scores[v], tree.scores[parent] + step, atol=1e-5)
    assert bool((tree.tokens[1:] != VOCAB - 1).all()), "sampled a token of draft probability 0"
    for v in range(tree.num_nodes):  # equal draws are merged: siblings are distinct
        kids = tree.tokens[tree.children(v)]
        assert kids.unique().numel() == kids.numel()


@pytest.mark.parametrize("seed", range(4))
def test_iid_policy_shape(seed):
    k, depth = 5, 3
    policy, tree, source = build("iid", seed, tree_paths=k, tree_depth=depth)
    check_common(tree, source, Regime.IID)
    assert policy.regime_for() == Regime.IID and not policy.is_chain
    assert len(source.batches) == depth  # one draft call per level
    counts = tree.multiplicity()
    assert int(counts[tree.children(0)].sum()) == k
    for v in range(1, tree.num_nodes):
        kids = tree.children(v)
        if int(tree.depth[v]) < depth:  # every path continues: a node's paths split among its children
            assert int(counts[kids].sum()) == int(counts[v])
        else:
            assert kids.numel() == 0
    leaves = tree.depth == depth
    assert int(counts[leaves].sum()) == k  # k paths of length l
    assert tree.num_nodes <= 1 + k * depth


@pytest.mark.parametrize("seed", range(4))
def test_delayed_policy_shape(seed):
    trunk, k, branch = 2, 4, 2
    policy, tree, source = build("delayed", seed, delay_trunk=trunk, tree_paths=k, delay_branch=branch)
    check_common(tree, source, Regime.IID)
    assert len(source.batches) == trunk + branch
    assert [len(b) for b in source.batches[: trunk + 1]] == [1] * (trunk + 1)
    counts = tree.multiplicity()
    for d in range(1, trunk + 1):  # a single sampled trunk
        level = (tree.depth == d).nonzero().flatten()
        assert level.numel() == 1 and int(counts[level]) == 1
    tip = int((tree.depth == trunk).nonzero().flatten())
    assert int(counts[tree.children(tip)].sum()) == k
    assert tree.max_depth == trunk + branch
    assert int(counts[tree.depth == trunk + branch].sum()) == k
    assert policy.default_verifier == "specinfer"


def test_delayed_without_trunk_is_iid():
    _, delayed, _ = build("delayed", 3, delay_trunk=0, tree_paths=3, delay_branch=2)
    _, iid, _ = build("iid", 3, tree_paths=3, tree_depth=2)
    assert torch.equal(delayed.tokens, iid.tokens) and torch.equal(delayed.counts, iid.counts)


@pytest.mark.parametrize("seed", range(4))
def test_swor_policy_shape(seed):
    k, depth = 3, 3
    policy, tree, source = build("swor", seed, tree_topk=k, tree_depth=depth)
    check_common(tree, source, Regime.SWOR)
    assert policy.default_verifier == "swor"
    assert len(source.batches) == depth
    assert [len(b) for b in source.batches] == [1] + [k] * (depth - 1)
    for batch in source.batches:
        for v in batch:
            assert tree.children(v).numel() == k
    # the expanded nodes of each level are that level's k best by cumulative score
    for d, batch in enumerate(source.batches[1:], start=1):
        level = (tree.depth == d).nonzero().flatten()
        best = level[tree.scores[level].topk(k).indices]
        assert sorted(best.tolist()) == sorted(batch)
    assert tree.max_depth == depth and tree.num_nodes == 1 + k + (depth - 1) * k * k


def test_swor_width_beyond_support():
    """Only 5 of 6 tokens have draft mass: a node gets at most 5 children, all distinct."""
    _, tree, _ = build("swor", 0, tree_topk=6, tree_depth=1)
    assert tree.children(0).numel() == VOCAB - 1


@pytest.mark.parametrize("name,params", [("iid", {"tree_paths": 1, "tree_depth": 4}),
                                         ("delayed", {"delay_trunk": 2, "tree_paths": 1, "delay_branch": 2}),
                                         ("swor", {"tree_topk": 1, "tree_depth": 4})])
def test_single_path_is_a_chain(name, params):
    policy, tree, _ = build(name, 1, **params)
    assert policy.is_chain and tree.is_chain() and tree.num_nodes == 5


@pytest.mark.parametrize("name", ["iid", "delayed", "swor"])
def test_greedy_mode_records_no_q(name):
    _, tree, _ = build(name, 0, do_sample=False)
    assert tree.q_index is None and tree.num_nodes > 1


@pytest.mark.parametrize(
    "name,params,match",
    [("iid", {"tree_paths": 0}, "tree_paths"), ("iid", {"tree_depth": 0}, "tree_depth"),
     ("delayed", {"delay_trunk": -1}, "delay_trunk"), ("delayed", {"delay_branch": 0}, "delay_branch"),
     ("swor", {"tree_topk": 0}, "tree_topk")],
)
def test_bad_parameters(name, params, match):
    with pytest.raises(ValueError, match=match):
        POLICIES.get(name)(do_sample=True, **params)


def test_generation_kwargs_resolve():
    config = GenerationConfig(do_sample=True, tree_policy="delayed", delay_trunk=3, tree_paths=2, delay_branch=1)
    policy, verifier = resolve(config)
    assert policy.params == {"delay_trunk": 3, "tree_paths": 2, "delay_branch": 1}
    assert verifier.name == "specinfer"
    with pytest.raises(ValueError, match="does not use"):
        resolve(GenerationConfig(do_sample=True, tree_policy="iid", delay_trunk=2))
    with pytest.raises(ValueError, match="not lossless"):
        resolve(GenerationConfig(do_sample=True, tree_policy="swor", verifier="specinfer"))
    with pytest.raises(ValueError, match="single chain"):
        resolve(GenerationConfig(do_sample=True, tree_policy="iid", verifier="block"))
    chain = GenerationConfig(do_sample=True, tree_policy="iid", tree_paths=1, verifier="block")
    assert resolve(chain)[1].name == "block"
    assert resolve(GenerationConfig(do_sample=True, tree_policy="swor"))[1].name == "swor"


# ------------------------------------------------------------------------------------- sampling laws (torch path)
def test_multinomial_counts_law():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 20000
    counts = multinomial_counts(probs.expand(n, -1), torch.full((n,), 3), torch.Generator().manual_seed(0))
    assert bool((counts.sum(-1) == 3).all()) and int(counts[:, 3].sum()) == 0
    # per-row count of token 0 is Binomial(3, 0.5)
    observed = torch.bincount(counts[:, 0], minlength=4).double()
    expected = torch.tensor([0.125, 0.375, 0.375, 0.125], dtype=torch.float64) * n
    assert chi2.sf(float(((observed - expected) ** 2 / expected).sum()), 3) > 1e-6


def test_exp_on_a_support_equals_the_full_exp():
    """q from log q, exponentiated on the declared support only: the same table (zeros where log q is -inf)."""
    from hf_treespec.policies.base import exp_on

    support = torch.tensor([1, 4, 6])
    logq = torch.full((2, 8), float("-inf"))
    logq[:, support] = torch.log_softmax(torch.randn(2, 3, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(exp_on(logq, support), logq.exp())
    assert torch.equal(exp_on(logq, None), logq.exp())


def test_without_replacement_law():
    """Gumbel-top-k order = sequential sampling without replacement: P(a, b) = q(a) q(b) / (1 - q(a))."""
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 20000
    tokens, valid = without_replacement(q.expand(n, -1), 3, torch.Generator().manual_seed(0))
    assert bool(valid.all()) and bool((tokens != 3).all())
    pairs = tokens[:, 0] * 4 + tokens[:, 1]
    observed = torch.bincount(pairs, minlength=16).double()
    expected = torch.zeros(16, dtype=torch.float64)
    for a in range(3):
        for b in range(3):
            if a != b:
                expected[a * 4 + b] = float(q[a] * q[b] / (1 - q[a])) * n
    cells = expected > 0
    assert observed[~cells].sum() == 0
    stat = float(((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    assert chi2.sf(stat, int(cells.sum()) - 1) > 1e-6
    tokens, valid = without_replacement(q[None], 4, torch.Generator().manual_seed(1))
    assert valid.tolist() == [[True, True, True, False]]


# -------------------------------------------------------------------------------------------- generate end to end
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    model = hf_treespec.enable(LlamaForCausalLM(config).eval())
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked distributions, so drafts get accepted
    return model, hf_treespec.drafters.truncated(model, 1)


SMALL = {"iid": {"tree_paths": 3, "tree_depth": 3}, "delayed": {"delay_trunk": 1, "tree_paths": 3, "delay_branch": 2},
         "swor": {"tree_topk": 3, "tree_depth": 3}}
CHAIN = {"iid": {"tree_paths": 1, "tree_depth": 3}, "delayed": {"delay_trunk": 1, "tree_paths": 1, "delay_branch": 2},
         "swor": {"tree_topk": 1, "tree_depth": 3}}


def allowed_verifiers(policy_name: str, params: dict) -> list[str]:
    policy = POLICIES.get(policy_name)(do_sample=True, **params)
    names = []
    for name in VERIFIERS:
        try:
            VERIFIERS.get(name).check_compatible(policy.regime_for(), is_chain=policy.is_chain, do_sample=True)
        except ValueError:
            continue
        names.append(name)
    return names


SAMPLE_CASES = [pytest.param(p, params, v, id=f"{p}-{'chain' if shapes is CHAIN else 'tree'}-{v}")
                for shapes in (SMALL, CHAIN) for p, params in shapes.items() for v in allowed_verifiers(p, params)]


def test_sample_cases_cover_every_sampling_verifier():
    assert {case.values[2] for case in SAMPLE_CASES} == {n for n in VERIFIERS if VERIFIERS.get(n).sampling}


@pytest.mark.parametrize("policy,params,verifier", SAMPLE_CASES)
def test_generate_samples(tiny, policy, params, verifier):
    model, drafter = tiny
    prompt = torch.tensor([[3, 17, 42, 8, 8, 21]])
    kwargs = dict(do_sample=True, temperature=0.9, top_k=20, max_new_tokens=12, assistant_model=drafter,
                  tree_policy=policy, verifier=verifier, **fixed_budget(policy), **params)
    outs = []
    for seed in range(3):  # a small sampled tree went 11 steps without an acceptance in about 1 seed of 8
        torch.manual_seed(seed)
        outs.append(model.generate(prompt, return_dict_in_generate=True, **kwargs))
    for out in outs:
        assert out.sequences.shape == (1, prompt.shape[1] + 12)
        assert torch.equal(out.sequences[:, : prompt.shape[1]], prompt)
        assert sum(out.accepted_lengths) + 1 == 12 and len(out.tree_sizes) == len(out.accepted_lengths)
    assert_drafted(outs, accepting=params is SMALL[policy])  # one sampled chain may go 11 steps without acceptance
    torch.manual_seed(0)  # seeded sampling reproduces the same tokens
    assert torch.equal(model.generate(prompt, **kwargs), outs[0].sequences)


@pytest.mark.parametrize("policy", ["iid", "delayed", "swor"])
def test_greedy_generate_is_plain_greedy(tiny, policy):
    model, drafter = tiny
    prompt = torch.tensor([[5, 9, 33, 2, 60, 11, 4]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=20)
    torch.manual_seed(0)  # the shapes are sampled even when greedy
    out = model.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter, tree_policy=policy,
                         return_dict_in_generate=True, **fixed_budget(policy), **SMALL[policy])
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    assert sum(out.accepted_lengths) + 1 == 20
