"""NDE: the delay selector, the ``nde`` policy inside generate, the Equation-3 data estimates and the NDE trainer.

The block-efficiency estimator of the offline data is checked *exactly* against the verifiers themselves: on toy
tables, its expectation over every draft draw (``enumerate_outcomes``) equals the expected accepted length of the
``delayed`` policy's trees under the real verifier, enumerated over drafting and verification randomness.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import string

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList

from hf_treespec.generation.components import resolve
from hf_treespec.policies import POLICIES, DelaySelector, DelaySelectorConfig, DraftSource, StepContext
from hf_treespec.drafters import as_drafter
from hf_treespec.policies.nde import (
    DIVERGENCE_FEATURES, FEATURE_SETS, SCALAR_FEATURES, SELECTOR_SUBFOLDER, Action, NDEPolicy, action_space,
    divergences, root_features,
)
from hf_treespec.randomness import enumerate_outcomes
from hf_treespec.tree import DraftTree, Regime
from hf_treespec.trainers import (
    LatencyModel,
    NDEConfig,
    NDEData,
    NDETrainer,
    load_nde_data,
    throughput_objective,
)
from hf_treespec.trainers.data.nde_data import draft_probe
from hf_treespec.trainers.data.nde_stats import action_stats
from hf_treespec.trainers.data.nde_trie import sample_trees, trie_tables
from hf_treespec.verifiers import VERIFIERS

from conftest import VOCAB, assert_drafted, char_tokenizer  # VOCAB: conftest's tiny Llama
ACTIONS = action_space((1, 2, 3), (0, 1, 2), (1, 2))


def fixed_selector(actions, choice: int | None, hidden: int = 32, seed: int = 0) -> DelaySelector:
    """A selector that always picks ``actions[choice]`` (random weights when ``choice`` is None)."""
    torch.manual_seed(seed)
    selector = DelaySelector(DelaySelectorConfig(actions=[list(a) for a in actions],
                                                 hidden_inputs={"target_hidden": hidden}, shared_dim=8))
    if choice is not None:
        with torch.no_grad():
            selector.mlp[-1].weight.zero_()
            selector.mlp[-1].bias.zero_()
            selector.mlp[-1].bias[choice] = 5.0
    return selector.eval()


# ------------------------------------------------------------------------------------------------ selector
def test_action_space_drops_duplicate_chains():
    actions = action_space((1, 2), (0, 1, 2), (1, 2))
    chains = [a for a in actions if a.paths == 1]
    assert sorted(a.trunk + a.branch for a in chains) == [1, 2, 3, 4]  # one chain per length
    assert len([a for a in actions if a.paths == 2]) == 6
    with pytest.raises(ValueError, match="l2 >= 1"):
        action_space((1,), (0,), (0,))


def test_selector_save_load_round_trip(tmp_path):
    selector = fixed_selector(ACTIONS, None)
    scalars, hidden = torch.randn(20, len(SCALAR_FEATURES)) * 3 + 1, torch.randn(20, 32) * 40
    scalars[:5, -1] = float("nan")
    selector.fit_standardisation(scalars, target_hidden=hidden)
    selector.save_pretrained(tmp_path / "sel")
    assert sorted(p.name for p in (tmp_path / "sel").iterdir()) == ["config.json", "model.safetensors"]
    loaded = DelaySelector.from_pretrained(tmp_path / "sel")
    assert loaded.config == selector.config and loaded.config.standardised
    for key, value in selector.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert torch.equal(loaded(scalars, target_hidden=hidden), selector(scalars, target_hidden=hidden))
    assert torch.isfinite(loaded(scalars, target_hidden=hidden)).all()  # NaN (unknown latency) -> training mean
    assert loaded.actions == list(ACTIONS)
    with pytest.raises(ValueError, match="hf-treespec train nde"):
        DelaySelector.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="width 16"):
        loaded(scalars, target_hidden=torch.randn(20, 16))


def test_nde_needs_a_selector_and_declares_the_iid_regime(tmp_path):
    with pytest.raises(ValueError, match="tree_selector.*hf-treespec train nde-data"):
        resolve(GenerationConfig(do_sample=True, tree_policy="nde"))
    with pytest.raises(ValueError, match="does not use"):
        resolve(GenerationConfig(do_sample=True, tree_policy="delayed", tree_selector="x"))
    fixed_selector(ACTIONS, 0).save_pretrained(tmp_path / "sel")
    policy, verifier = resolve(GenerationConfig(do_sample=True, tree_policy="nde", tree_selector=str(tmp_path / "sel")))
    assert policy.regime_for() == Regime.IID and verifier.name == "specinfer"
    assert "latencies" in policy.context_needs
    with pytest.raises(ValueError, match="target's probabilities"):
        policy.build(FakeSource(), 3, context=StepContext(3))


# ------------------------------------------------------------------------------------------------ policy
def table(path: tuple[int, ...], vocab: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(17 + sum((t + 1) * 7**i for i, t in enumerate(path)))
    return torch.softmax(torch.randn(vocab, generator=gen), -1)


class FakeSource(DraftSource):
    def __init__(self):
        self.batches: list[list[int]] = []

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        self.batches.append(nodes.tolist())
        paths = tree.paths()
        return torch.stack([table(tuple(paths[v, 1 : int(tree.depth[v]) + 1].tolist())) for v in nodes]).log()


def toy_context(hidden: int = 32) -> StepContext:
    return StepContext(target_probs=table((9,)), root_token=2, context_length=40, temperature=1.0, top_p=1.0,
                       target_hidden=torch.randn(hidden), draft_seconds=0.002, target_seconds=0.03)


@pytest.mark.parametrize("choice", [Action(3, 2, 2), Action(2, 0, 2), Action(1, 1, 2)])
def test_nde_policy_builds_the_chosen_delayed_tree(choice):
    policy = NDEPolicy(do_sample=True, tree_selector=fixed_selector(ACTIONS, ACTIONS.index(choice)))
    context = toy_context()
    torch.manual_seed(5)
    source = FakeSource()
    tree = policy.build(source, 2, context=context)
    # one draft call per level, q(. | root) reused from the selector's look at the root
    assert len(source.batches) == choice.trunk + choice.branch and source.batches[0] == [0]
    counts = tree.multiplicity()
    for d in range(1, choice.trunk + 1):
        level = (tree.depth == d).nonzero().flatten()
        assert level.numel() == 1 and int(counts[level]) == 1
    tip = int((tree.depth == choice.trunk).nonzero().flatten()[0])
    assert int(counts[tree.children(tip)].sum()) == choice.paths
    assert tree.max_depth == choice.trunk + choice.branch
    assert int(counts[tree.depth == tree.max_depth].sum()) == choice.paths
    assert bool((tree.q_index[tree.depth < tree.max_depth] >= 0).all())  # q recorded for the verifier
    # the same draws as tree_policy="delayed" with that shape
    torch.manual_seed(5)
    delayed = POLICIES.get("delayed")(do_sample=True, delay_trunk=choice.trunk, tree_paths=choice.paths,
                                      delay_branch=choice.branch).build(FakeSource(), 2, context=StepContext(2))
    assert torch.equal(tree.tokens, delayed.tokens) and torch.equal(tree.multiplicity(), delayed.multiplicity())


def test_root_features():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    f = dict(zip(SCALAR_FEATURES, root_features(p, 1, q, 100, 0.8, 0.95, None, 0.05).tolist()))
    assert f["target_entropy"] == pytest.approx(math.log(2)) and f["target_top1"] == pytest.approx(0.5)
    assert f["root_target_logprob"] == pytest.approx(math.log(0.5))
    assert f["draft_top1"] == pytest.approx(0.7) and f["draft_top4"] == pytest.approx(0.1)
    assert f["log_context_length"] == pytest.approx(math.log(100)) and f["temperature"] == pytest.approx(0.8)
    assert math.isnan(f["log_draft_seconds"]) and f["log_target_seconds"] == pytest.approx(math.log(0.05))


def test_divergences_at_the_parent():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    kl_pq, kl_qp, l1 = divergences(p, q).tolist()
    assert kl_pq == pytest.approx(0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.1), rel=1e-5)
    floor = math.log(1e-10)  # p = 0 where q > 0: the KL(q || p) terms use the floor
    expected = 0.7 * math.log(0.7 / 0.5) + 0.1 * math.log(0.1 / 0.5) + 2 * 0.1 * (math.log(0.1) - floor)
    assert kl_qp == pytest.approx(expected, rel=1e-5) and l1 == pytest.approx(0.8, rel=1e-6)
    assert divergences(p, p).tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-7)
    f = dict(zip(SCALAR_FEATURES, root_features(p, 1, q, 100, 0.8, 0.95, None, 0.05, q).tolist()))
    assert f["l1_target_draft"] == pytest.approx(0.8, rel=1e-6) and f["kl_target_draft"] == pytest.approx(kl_pq)
    assert all(math.isnan(v) for v in root_features(p, 1, q, 100, 0.8, 0.95, None, 0.05)[-3:].tolist())


def paper_selector(actions, choice: int, draft_width: int = 32) -> DelaySelector:
    """A ``paper`` feature-set selector that always picks ``actions[choice]``."""
    chosen = FEATURE_SETS["paper"]
    selector = DelaySelector(DelaySelectorConfig(
        actions=[list(a) for a in actions], scalar_features=list(chosen.scalars), feature_set="paper",
        hidden_inputs={"target_hidden": 32, "draft_hidden": draft_width}, shared_dim=8))
    with torch.no_grad():
        selector.mlp[-1].weight.zero_()
        selector.mlp[-1].bias.zero_()
        selector.mlp[-1].bias[choice] = 5.0
    return selector.eval()


def test_feature_set_is_saved_and_checked(tmp_path):
    paper_selector(ACTIONS, 0).save_pretrained(tmp_path / "paper")
    loaded = DelaySelector.from_pretrained(tmp_path / "paper")
    assert loaded.config.feature_set == "paper" and set(loaded.config.hidden_inputs) == {"target_hidden",
                                                                                         "draft_hidden"}
    config = json.loads((tmp_path / "paper" / "config.json").read_text())
    del config["feature_set"]  # a selector saved before the field existed reads as ours
    (tmp_path / "paper" / "config.json").write_text(json.dumps(config))
    assert DelaySelector.from_pretrained(tmp_path / "paper").config.feature_set == "root"
    with pytest.raises(ValueError, match="unknown feature_set"):
        DelaySelectorConfig(actions=[[1, 0, 1]], feature_set="mine")
    assert set(FEATURE_SETS["paper"].scalars) - set(FEATURE_SETS["root"].scalars) == {
        *DIVERGENCE_FEATURES, "log_draft_seconds", "log_target_seconds"}


@pytest.mark.parametrize("drafter_name", ["perturbed", "truncated"])
def test_paper_features_reach_the_selector(target, drafters, prompt, monkeypatch, drafter_name):
    """Inside generate: the drafter's state at the root and q at the root's parent are the drafter's own, computed
    from the committed text; greedy output stays plain greedy."""
    seen = []
    original = NDEPolicy.choose

    def spy(self, context, draft_probs, draft_hidden=None):
        seen.append((context, draft_probs, draft_hidden, self._parent_q))
        return original(self, context, draft_probs, draft_hidden)

    monkeypatch.setattr(NDEPolicy, "choose", spy)
    drafter = drafters[drafter_name]
    selector = paper_selector(ACTIONS, ACTIONS.index(Action(2, 1, 2)))
    out = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=drafter, tree_policy="nde",
                          tree_selector=selector, return_dict_in_generate=True)
    assert_drafted(out, accepting=False)  # sampled paths: whether greedy accepts one in 15 steps is chance
    assert torch.equal(out.sequences, target.generate(prompt, do_sample=False, max_new_tokens=16))
    assert len(seen) == len(out.accepted_lengths) >= 3
    assert seen[0][3] is None  # no previous tree at the first root
    full = out.sequences[0]
    probe = functools.partial(draft_probe, as_drafter(drafter), LogitsProcessorList(), full)
    for context, draft_probs, draft_hidden, parent_q in seen[1:]:
        root = context.context_length - 1  # the root's position (committed tokens, root included)
        root_q, root_hidden = probe(root, None)  # what nde-data records, from the committed text alone
        parent_probe_q, parent_hidden = probe(root - 1, None)
        # the decoding drafter's cache rows come from tree forwards, the probe's from one prefill: they agree to
        # ~1e-3 here (a sharpened tiny head), ten times closer than the neighbouring position's values
        gap = lambda a, b: float((a - b).abs().max())  # noqa: E731
        assert gap(draft_hidden, root_hidden) < min(3e-3, 0.1 * gap(draft_hidden, parent_hidden))
        assert gap(draft_probs, root_q) < min(1e-2, 0.1 * gap(draft_probs, parent_probe_q))
        assert gap(parent_q, parent_probe_q) < min(3e-2, 0.25 * gap(parent_q, root_q))
        scalars = dict(zip(SCALAR_FEATURES, root_features(context.target_probs, context.root_token, draft_probs,
                                                          root + 1, 0.0, 1.0, None, None, parent_q).tolist()))
        assert all(math.isfinite(scalars[n]) for n in DIVERGENCE_FEATURES)


def test_paper_features_refuse_batched_decoding(target, drafters):
    ids = torch.randint(1, VOCAB, (2, 6))
    with pytest.raises(ValueError, match="batched decoding"):
        target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4, pad_token_id=0,
                        assistant_model=drafters["perturbed"], tree_policy="nde",
                        tree_selector=paper_selector(ACTIONS, 0))


# ------------------------------------------------------------------------------------------------ generate
@pytest.mark.parametrize("choice", [None, ACTIONS.index(Action(3, 1, 2))])
def test_greedy_generate_is_plain_greedy(target, drafters, prompt, choice):
    ref = target.generate(prompt, do_sample=False, max_new_tokens=24)
    out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafters["perturbed"],
                          tree_policy="nde", tree_selector=fixed_selector(ACTIONS, choice),
                          return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, ref)
    if choice is not None:
        assert all(size <= Action(3, 1, 2).max_nodes for size in out.tree_sizes) and max(out.tree_sizes) > 3


def test_selector_folder_survives_generation_config_save(target, drafters, prompt, tmp_path):
    fixed_selector(ACTIONS, None).save_pretrained(tmp_path / "sel")
    GenerationConfig(do_sample=False, max_new_tokens=16, tree_policy="nde",
                     tree_selector=str(tmp_path / "sel")).save_pretrained(tmp_path / "gen")
    config = GenerationConfig.from_pretrained(tmp_path / "gen")
    assert config.tree_selector == str(tmp_path / "sel")
    out = target.generate(prompt, generation_config=config, assistant_model=drafters["copy"],
                          return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, target.generate(prompt, do_sample=False, max_new_tokens=16))


def saved_drafter_with_selector(drafter, folder, selector: DelaySelector | None):
    """``drafter`` saved to ``folder`` (with ``selector`` in its ``delay_selector/``) and loaded back from there."""
    from transformers import AutoModelForCausalLM

    drafter.save_pretrained(folder)
    if selector is not None:
        selector.save_pretrained(folder / SELECTOR_SUBFOLDER)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def test_selector_shipped_with_the_drafter_is_the_default(target, drafters, prompt, tmp_path):
    chain = ACTIONS.index(Action(1, 0, 1))  # one draft node per step: visible in tree_sizes
    bundled = saved_drafter_with_selector(drafters["copy"], tmp_path / "drafter", fixed_selector(ACTIONS, chain))
    assert as_drafter(bundled).bundled_path(SELECTOR_SUBFOLDER) == tmp_path / "drafter" / SELECTOR_SUBFOLDER
    policy, verifier = resolve(GenerationConfig(do_sample=True, tree_policy="nde"), as_drafter(bundled))
    assert policy.params["tree_selector"] == str(tmp_path / "drafter" / SELECTOR_SUBFOLDER)
    assert policy.selector.actions == list(ACTIONS) and verifier.name == "specinfer"

    ref = target.generate(prompt, do_sample=False, max_new_tokens=16)
    out = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=bundled, tree_policy="nde",
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and set(out.tree_sizes) == {1}
    # an explicit tree_selector wins over the bundled one
    wide = ACTIONS.index(Action(3, 1, 2))
    out = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=bundled, tree_policy="nde",
                          tree_selector=fixed_selector(ACTIONS, wide), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and max(out.tree_sizes) > 3
    torch.manual_seed(0)
    sampled = target.generate(prompt, do_sample=True, max_new_tokens=16, assistant_model=bundled, tree_policy="nde",
                              return_dict_in_generate=True)
    assert sampled.sequences.shape == (1, prompt.shape[1] + 16) and set(sampled.tree_sizes) == {1}


def test_drafter_without_a_selector_gets_a_clear_error(target, drafters, prompt, tmp_path):
    plain = saved_drafter_with_selector(drafters["copy"], tmp_path / "drafter", None)  # a folder, but no selector
    for drafter in (plain, drafters["copy"], drafters["truncated"]):  # from a folder; in memory; a view of the target
        assert as_drafter(drafter).bundled_path(SELECTOR_SUBFOLDER) is None
        with pytest.raises(ValueError, match="tree_selector=.*delay_selector/.*hf-treespec train nde-data"):
            target.generate(prompt, do_sample=True, max_new_tokens=4, assistant_model=drafter, tree_policy="nde")
    # other policies ignore what ships with the drafter
    bundled = saved_drafter_with_selector(drafters["copy"], tmp_path / "with", fixed_selector(ACTIONS, 0))
    policy, _ = resolve(GenerationConfig(do_sample=True, tree_policy="delayed"), as_drafter(bundled))
    assert "tree_selector" not in policy.params


def test_sampling_verifiers_and_refusals(target, drafters, prompt):
    selector = fixed_selector(ACTIONS, ACTIONS.index(Action(2, 1, 2)))
    kwargs = dict(do_sample=True, max_new_tokens=12, assistant_model=drafters["perturbed"], tree_policy="nde",
                  tree_selector=selector)
    for verifier in (None, "specinfer", "traversal", "nss"):  # lossless for i.i.d. trees
        torch.manual_seed(0)
        out = target.generate(prompt, verifier=verifier, **kwargs)
        assert out.shape == (1, prompt.shape[1] + 12)
    with pytest.raises(ValueError, match="not lossless"):
        target.generate(prompt, verifier="swor", **kwargs)
    with pytest.raises(ValueError, match="single chain"):
        target.generate(prompt, verifier="block", **kwargs)
    with pytest.raises(ValueError, match="argmax"):
        target.generate(prompt, verifier="greedy", **kwargs)
    chains = [a for a in ACTIONS if a.paths == 1]  # a selector over chains only may use chain verifiers
    kwargs["tree_selector"] = fixed_selector(chains, 1)
    assert target.generate(prompt, verifier="block", **kwargs).shape == (1, prompt.shape[1] + 12)


def test_step_context_reaches_the_policy(target, drafters, prompt, monkeypatch):
    seen: list[StepContext] = []
    original = NDEPolicy.choose

    def spy(self, context, draft_probs):
        seen.append(context)
        return original(self, context, draft_probs)

    monkeypatch.setattr(NDEPolicy, "choose", spy)
    out = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=drafters["truncated"],
                          tree_policy="nde", tree_selector=fixed_selector(ACTIONS, ACTIONS.index(Action(2, 0, 2))),
                          return_dict_in_generate=True)
    assert len(seen) == len(out.accepted_lengths)
    with torch.no_grad():
        ref = target(prompt, output_hidden_states=True)
    first = seen[0]
    assert first.context_length == prompt.shape[1] + 1 and first.root_token == int(out.sequences[0, prompt.shape[1]])
    assert torch.allclose(first.target_probs, ref.logits[0, -1].softmax(-1), atol=1e-5)
    norm = target.model.norm(first.target_hidden[None])  # the pre-norm last state at the root's parent
    assert torch.allclose(target.lm_head(norm)[0], ref.logits[0, -1], atol=1e-4)
    assert (first.temperature, first.top_p, first.draft_seconds, first.target_seconds) == (0.0, 1.0, None, None)
    lengths = [c.context_length for c in seen]
    assert lengths == [prompt.shape[1] + 1 + sum(out.accepted_lengths[:i]) for i in range(len(seen))]
    for context, length in zip(seen, lengths):
        assert context.root_token == int(out.sequences[0, length - 1])
    assert all(c.draft_seconds > 0 and c.target_seconds > 0 for c in seen[1:])


# ------------------------------------------------------------------------------------------------ Equation 3
TOY_V = 3


@functools.cache
def toy_q(path: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3 + sum((t + 1) * 5**i for i, t in enumerate(path)))
    q = torch.softmax(torch.randn(TOY_V, generator=gen, dtype=torch.float64) * 1.5, -1)
    q[-1] = 0  # two draftable tokens keep the enumeration small; p still puts mass on the third
    return q / q.sum()


@functools.cache
def toy_p(path: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(101 + sum((t + 1) * 5**i for i, t in enumerate(path)))
    return torch.softmax(torch.randn(TOY_V, generator=gen, dtype=torch.float64) * 1.5, -1)


def _rows(fn, tree, nodes):
    paths = tree.paths()
    return torch.stack([fn(tuple(paths[v, 1 : int(tree.depth[v]) + 1].tolist())) for v in nodes.tolist()])


class ToySource(DraftSource):
    def logprobs(self, tree, nodes):
        return _rows(toy_q, tree, nodes).log()


def test_branching_laws_are_their_own_protocol():
    """Only the NDE data reads branching laws: `Verifier` has none, the six top-down verifiers with a closed form
    implement `BranchingLaw`, and asking another verifier for one says which have one."""
    from hf_treespec.verifiers import VERIFIERS
    from hf_treespec.verifiers.base import Verifier
    from hf_treespec.verifiers.branching import BranchingLaw, branching_law, laws

    assert not any(hasattr(Verifier, name) for name in ("branching", "branching_rows", "branching_columns"))
    assert laws() == ["greedy", "khisti_priority", "naivetree", "nss", "specinfer", "spectr"]
    assert all(isinstance(branching_law(name), BranchingLaw) and isinstance(branching_law(name), VERIFIERS.get(name))
               for name in laws())
    with pytest.raises(ValueError, match="traversal.*no closed-form branching law.*specinfer"):
        branching_law("traversal")


@pytest.mark.parametrize("verifier", ["specinfer", "naivetree", "nss", "greedy", "spectr", "khisti_priority"])
def test_block_efficiency_estimate_is_exact_in_expectation(verifier):
    actions = [Action(1, 0, 2), Action(2, 0, 1), Action(2, 0, 2), Action(2, 1, 1), Action(2, 1, 2)]
    draft = functools.partial(_rows, toy_q)
    target = functools.partial(_rows, toy_p)

    def estimate(source):
        trees = sample_trees(draft, 0, 1, [0, 1], 2, 2, source)
        stats = action_stats(trees, trie_tables(trees, target, verifier, 2), actions, verifier)
        return tuple(stats.tau[0].tolist())

    law = enumerate_outcomes(estimate)
    expected = [sum(prob * taus[a] for taus, prob in law.items()) for a in range(len(actions))]
    checker = VERIFIERS.get(verifier)()
    for a, action in enumerate(actions):
        policy = POLICIES.get("delayed")(do_sample=True, delay_trunk=action.trunk, tree_paths=action.paths,
                                         delay_branch=action.branch)

        def accepted(source, policy=policy):
            tree = policy.build(ToySource(), 0, context=StepContext(0), generator=source)
            logits = _rows(toy_p, tree, torch.arange(tree.num_nodes)).log()
            return checker.verify(tree, logits, generator=source).num_accepted_drafts

        truth = 1 + sum(k * prob for k, prob in enumerate_outcomes(accepted).items())
        assert expected[a] == pytest.approx(truth, abs=1e-12), action


def test_slot_draws_follow_q():
    """The fast inverse-CDF draw: each slot is an independent draw from its row; zero-probability tokens never come."""
    from scipy.stats import chi2

    from hf_treespec.trainers.data.nde_trie import _draw

    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 1.0, 0.0]])
    n = 20000
    inverse = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(10, dtype=torch.long)])[torch.randperm(n + 10)]
    tokens = _draw(probs, inverse, torch.Generator().manual_seed(0))
    assert bool((tokens[inverse == 1] == 2).all()) and not bool((tokens == 3).any())
    first = tokens[inverse == 0]
    pairs = torch.bincount(first[0::2] * 3 + first[1::2], minlength=9).double()  # consecutive slots: independent
    expected = torch.outer(probs[0, :3], probs[0, :3]).flatten().double() * (n // 2)
    assert chi2.sf(float(((pairs - expected) ** 2 / expected).sum()), 8) > 1e-6


def test_latency_model_fit_and_step_time():
    target = [(c, n, 0.03 + 0.001 * n + 0.01 * c / 1000) for c in (100, 500, 900) for n in (1, 8, 32)]
    draft = [(c, n, 0.002 + 0.0002 * n + 0.001 * c / 1000) for c in (100, 500, 900) for n in (1, 4, 8)]
    model = LatencyModel.fit(target, draft, overhead=0.004)
    assert model.target == pytest.approx([0.03, 0.001, 0.01, 0.0], abs=1e-9)
    assert model.draft == pytest.approx([0.002, 0.0002, 0.001, 0.0], abs=1e-9)
    # (k, l1, l2) = (4, 2, 2): 4 draft calls over 2 + 1 + 4 nodes, one target forward over 1 + 2 + 8 rows
    seconds = model.step_seconds(500, calls=4, draft_width=7, nodes=11)
    assert seconds == pytest.approx(4 * 0.0025 + 7 * 0.0002 + 0.03 + 0.011 + 0.005 + 0.004)


# ------------------------------------------------------------------------------------------------ trainer
def test_throughput_objective():
    tau = torch.tensor([[2.0, 3.0], [2.0, 1.0]])
    seconds = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    baseline = torch.tensor([0, 0])
    sure = torch.tensor([[0.0, 30.0], [0.0, 30.0]])  # always action 1: ratio 1.5 on row 0, 0.5 on row 1
    loss, stats = throughput_objective(sure, tau, seconds, baseline, penalty_weight=2.0, penalty_fraction=0.5)
    assert loss.item() == pytest.approx(-(1.5 + 0.5) / 2 + 2.0 * 0.5, abs=1e-6)
    assert stats["argmax_ratio"].tolist() == pytest.approx([1.5, 0.5])
    assert stats["oracle_ratio"].tolist() == pytest.approx([1.5, 1.0]) and stats["regression"].tolist() == [0, 1]
    even = torch.zeros(2, 2)  # Equation 4: ratio of expected tau to expected time
    _, stats = throughput_objective(even, tau, torch.tensor([[1.0, 3.0], [1.0, 1.0]]), baseline, 0.0)
    assert stats["ratio"].tolist() == pytest.approx([(2.5 / 2.0) / 2.0, 1.5 / 2.0])


def synthetic_data(rows: int = 256, seed: int = 0) -> NDEData:
    """Two actions; the first scalar feature says which one is faster (a learnable rule)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    scalars = torch.randn(rows, len(SCALAR_FEATURES), generator=gen)
    good = scalars[:, 0] > 0
    tau = torch.stack([torch.where(good, 3.0, 1.2), torch.where(good, 1.2, 2.5)], 1)
    columns = {"scalars": scalars.tolist(), "target_hidden": torch.randn(rows, 8, generator=gen).tolist(),
               "block_efficiency": tau.tolist(), "seconds": torch.ones(rows, 2).tolist(),
               "temperature": [1.0] * rows, "top_p": [1.0] * rows}
    meta = {"actions": [[2, 0, 2], [1, 0, 3]], "scalar_features": list(SCALAR_FEATURES), "hidden_size": 8,
            "verifier": "specinfer"}
    return NDEData(Dataset.from_dict(columns), meta)


def test_trainer_loss_falls(tmp_path):
    from hf_treespec.trainers import build_selector

    data = synthetic_data()
    torch.manual_seed(0)
    selector = build_selector(data, shared_dim=8, dropout=0.0)
    assert "log_draft_seconds" not in selector.config.scalar_features  # opt-in: --latency-features
    with_latency = build_selector(data, latency_features=True).config.scalar_features
    assert with_latency == [n for n in SCALAR_FEATURES if n not in DIVERGENCE_FEATURES]
    args = NDEConfig(output_dir=str(tmp_path / "out"), max_steps=40, per_device_train_batch_size=32,
                     learning_rate=3e-3, logging_steps=40, save_strategy="no", use_cpu=True, disable_tqdm=True,
                     lr_scheduler_type="constant")
    trainer = NDETrainer(selector, args, train_dataset=data, eval_dataset=data)
    assert selector.config.baseline_actions == {"T=1,top_p=1": [2, 0, 2]}  # best static action of the data
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before["eval_loss"] - 0.1
    assert after["eval_argmax_ratio"] > max(1.4, before["eval_argmax_ratio"] + 0.1)  # the oracle reaches ~1.54
    trainer.save_model(str(tmp_path / "sel"))
    loaded = DelaySelector.from_pretrained(tmp_path / "sel")
    assert loaded.config.baseline_actions == selector.config.baseline_actions and loaded.config.standardised
    with pytest.raises(ValueError, match="actions differ"):
        NDETrainer(fixed_selector(ACTIONS, 0, hidden=8), args, train_dataset=data)


# ------------------------------------------------------------------------------------------------ data + CLI
CHARS = (string.ascii_letters + string.digits + "+/")[:VOCAB]


@pytest.fixture
def saved_target(target, tmp_path):
    tokenizer = char_tokenizer(CHARS, chat=True)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    lines = [{"question_id": i, "turns": [text]} for i, text in enumerate(["hello there", "abc def ghi", "xyz"])]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return tmp_path


def test_cli_nde_data_then_train_then_generate(saved_target, target, drafters, prompt, capsys):
    from hf_treespec.trainers.cli import add_parser

    tmp = saved_target
    parser = argparse.ArgumentParser(prog="hf-treespec")
    add_parser(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> dict:
        args = parser.parse_args(["train", *argv, "--no-progress"])
        assert args.handler(args) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    data_args = ["nde-data", "--target", str(tmp / "target"), "--questions", str(tmp / "q.jsonl"), "--num-prompts",
                 "2", "--drafter", "truncated:2", "--dtype", "fp32", "--max-new-tokens", "24", "--root-every", "8",
                 "--num-samples", "2", "--trees-per-forward", "2", "--paths", "1,2", "--trunks", "0,1",
                 "--branches", "1,2", "--chunk-size", "1", "--latency-contexts", "8,32", "--latency-repeats", "1",
                 "--output", str(tmp / "data")]
    summary = run(*data_args)
    assert summary["prompts"] == 2 and summary["roots"] == 6 and summary["actions"] == 7
    data = load_nde_data(tmp / "data")
    columns = data.dataset.with_format("torch")[:]
    tau, seconds, nodes = columns["block_efficiency"], columns["seconds"], columns["tree_nodes"]
    assert tau.shape == (6, 7) and columns["target_hidden"].shape == (6, 32)
    limit = torch.tensor([1.0 + a.max_nodes for a in data.actions])
    assert bool((tau >= 1).all()) and bool((tau <= limit + 1e-5).all()) and bool((nodes <= limit + 1e-5).all())
    assert bool((seconds > 0).all()) and columns["scalars"].shape == (6, len(SCALAR_FEATURES))
    assert data.dataset["position"][:3] == sorted(data.dataset["position"][:3])
    assert run(*data_args)["roots"] == 6  # finished chunks are skipped on a rerun

    summary = run("nde", "--data", str(tmp / "data"), "--eval-data", str(tmp / "data"), "--max-steps", "3",
                  "--batch-size", "4", "--output-dir", str(tmp / "sel"), "--shared-dim", "8")
    assert summary["steps"] == 3 and "eval_argmax_ratio" in summary["eval"]
    out = target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=drafters["truncated"],
                          tree_policy="nde", tree_selector=str(tmp / "sel"), return_dict_in_generate=True)
    assert_drafted(out, accepting=False)  # a selector trained for 3 steps picks the shapes
    assert torch.equal(out.sequences, target.generate(prompt, do_sample=False, max_new_tokens=12))

    # several verifiers on the same tries; a paper-feature selector for one of them
    summary = run(*data_args[:-1], str(tmp / "multi"), "--verifier", "specinfer,spectr,khisti_priority")
    assert summary["roots"] == 6
    own, khisti = load_nde_data(tmp / "multi"), load_nde_data(tmp / "multi", verifier="khisti_priority")
    assert khisti.meta["verifier"] == "khisti_priority" and "block_efficiency_spectr" not in khisti.dataset.column_names
    assert torch.allclose(own.dataset.with_format("torch")[:]["block_efficiency"], tau)  # same draws as before
    assert not torch.allclose(khisti.dataset.with_format("torch")[:]["block_efficiency"], tau)
    assert own.meta["draft_hidden_size"] == 32 and len(own.dataset[0]["draft_hidden"]) == 32
    with pytest.raises(ValueError, match="not 'nss'"):
        load_nde_data(tmp / "multi", verifier="nss")
    summary = run("nde", "--data", str(tmp / "multi"), "--verifier", "khisti_priority", "--feature-set", "paper",
                  "--max-steps", "3", "--batch-size", "4", "--output-dir", str(tmp / "sel-paper"), "--shared-dim", "8")
    loaded = DelaySelector.from_pretrained(tmp / "sel-paper")
    assert loaded.config.feature_set == "paper" and loaded.config.verifier == "khisti_priority"
    assert set(DIVERGENCE_FEATURES) <= set(loaded.config.scalar_features)
    out = target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=drafters["truncated"],
                          tree_policy="nde", tree_selector=str(tmp / "sel-paper"), return_dict_in_generate=True)
    assert_drafted(out, accepting=False)
    assert torch.equal(out.sequences, target.generate(prompt, do_sample=False, max_new_tokens=12))
