"""``tree_policy="chain"`` early exits (``chain_min_prob``: DyMax, ``chain_min_joint``: DyJoint, the C2T paper's
chain-mode baselines): where the chain stops on hand-made tables, greedy identity, and the sampled law through
``generate`` (Monte-Carlo chi-square, a correct sampler fails with probability 1e-3)."""

from __future__ import annotations

import pytest
import torch

from hf_treespec.policies import POLICIES, DraftSource, StepContext
from hf_treespec.tree import DraftTree

from conftest import assert_drafted

# top draft probability at each depth of the greedy path: .9, .6, .4, .8, .8, ...
TOPS = [0.9, 0.6, 0.4, 0.8, 0.8, 0.8, 0.8]


class Source(DraftSource):
    """q at depth d: TOPS[d] on token 0, the rest spread evenly over tokens 1..3."""

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        rows = []
        for v in nodes.tolist():
            top = TOPS[int(tree.depth[v])]
            rows.append(torch.tensor([top] + [(1 - top) / 3] * 3))
        return torch.stack(rows).log()


def chain_length(do_sample: bool = False, seed: int = 0, **params) -> int:
    torch.manual_seed(seed)
    policy = POLICIES.get("chain")(do_sample=do_sample, tree_depth=6, **params)
    tree = policy.build(Source(), 9, context=StepContext(9))
    assert tree.is_chain()
    if not do_sample:
        assert tree.tokens[1:].tolist() == [0] * (tree.num_nodes - 1)
    return tree.num_nodes - 1


def test_greedy_early_exits():
    assert chain_length() == 6  # off by default: the full depth
    assert chain_length(chain_min_prob=0.5) == 2  # .9, .6 pass; .4 stops
    assert chain_length(chain_min_prob=0.95) == 0
    assert chain_length(chain_min_joint=0.5) == 2  # joints .9, .54, .216
    assert chain_length(chain_min_joint=0.6) == 1
    assert chain_length(chain_min_prob=0.3, chain_min_joint=0.1) == 6  # joints .9 .54 .216 .173 .138 .111
    assert chain_length(chain_min_prob=0.3, chain_min_joint=0.15) == 4


def test_sampled_exit_looks_only_at_the_next_distribution():
    """DyMax at .5 stops before depth 2 whatever was drawn (the top probability there is .4); DyJoint uses the drawn
    tokens' own probabilities: drawing token 0 first (.9) keeps the joint above .3 one level longer than drawing a
    .033 token, which stops the chain at once."""
    lengths = {chain_length(do_sample=True, seed=s, chain_min_prob=0.5) for s in range(20)}
    assert lengths == {2}
    for seed in range(20):
        torch.manual_seed(seed)
        policy = POLICIES.get("chain")(do_sample=True, tree_depth=6, chain_min_joint=0.3)
        tree = policy.build(Source(), 9, context=StepContext(9))
        first = int(tree.tokens[1])
        assert tree.num_nodes - 1 == (2 if first == 0 else 1)


@pytest.mark.parametrize("key,bad", [("chain_min_prob", 1.0), ("chain_min_prob", -0.1), ("chain_min_joint", 2)])
def test_bad_thresholds(key, bad):
    with pytest.raises(ValueError, match=f"{key} must be in"):
        POLICIES.get("chain")(**{key: bad})


@pytest.mark.parametrize("params", [{"chain_min_prob": 0.09}, {"chain_min_joint": 0.001}])
def test_greedy_generate_is_plain_greedy(target, drafters, prompt, params):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafters["perturbed"],
                          tree_policy="chain", tree_depth=6, return_dict_in_generate=True, **params)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    assert len(set(out.tree_sizes)) > 1, "the early exit never changed the chain length: the test checks nothing"


@pytest.mark.parametrize("params", [{"chain_min_prob": 0.4}, {"chain_min_joint": 0.2}])
def test_three_token_law_is_preserved(target, drafters, params):
    from test_generate_sampling import chi_square_pvalue, exact_law, sample_three_tokens

    law = exact_law(target)
    n = 600
    counts, outs = sample_three_tokens(target, n, assistant_model=drafters["perturbed"], tree_policy="chain",
                                       verifier="naive", tree_depth=3, **params)
    sizes = {size for out in outs for size in out.tree_sizes}
    assert_drafted(outs)
    assert len(sizes) > 1, "the early exit never changed the chain length: the test checks nothing"
    assert chi_square_pvalue(counts, law, n) > 1e-3
