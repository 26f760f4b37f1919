"""tree_budget="auto": cost model, stopping rule, draft-free steps, calibration cache, hardware detection."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import hf_treespec
from hf_treespec.cost import forget_speed_models
from hf_treespec.cost.hardware import Hardware, cpu_info, detect
from hf_treespec.cost.speed_model import (
    CONTROL_EVERY,
    CONTROL_STEPS,
    MIN_EVIDENCE,
    PROBE_BUDGET,
    MAX_REPROBE_EVERY,
    PROBE_STEPS,
    REPROBE_EVERY,
    AcceptanceTable,
    SpeedModel,
)
from hf_treespec.cost.curve import CostCurve, calibrate_batches, calibrate_target, load_or_calibrate
from hf_treespec.policies import POLICIES, StepContext
from hf_treespec.policies.base import DraftSource
from hf_treespec.cost.held_size import (
    EXPLORE_EVERY,
    LADDER,
    PRICED_START,
    RARE_EXPLORE,
    HeldSize,
    HeldSizes,
    SizeLadder,
)
from hf_treespec.cost.sizer import TreeSizer
from hf_treespec.generation.sizing import TreeSizing
from hf_treespec.step_context import StepOutcome
from hf_treespec.tree import DraftTree

from conftest import assert_drafted

VOCAB = 64


class PeakedSource(DraftSource):
    """Every node's children: token (parent token + 1 + i) with probability ~ 0.8 * 0.2^i (a confident drafter)."""

    def __init__(self):
        self.calls = 0

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        probs = torch.full((nodes.numel(), VOCAB), 1e-6)
        for r, tok in enumerate(tree.tokens[nodes].tolist()):
            for i in range(4):
                probs[r, (tok + 1 + i) % VOCAB] = 0.8 * 0.2**i
        return (probs / probs.sum(-1, keepdim=True)).log()


def curve(seconds_per_rows) -> CostCurve:
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostCurve(sizes, [256], [[seconds_per_rows(n) for n in sizes]])


# fresh curves for every use: a speed model moves its curve towards what it measures (`CostCurve.observe`), so a
# shared module-level one would carry what one test observed into the next test's pricing
def steep_curve() -> CostCurve:
    return curve(lambda n: 0.05 * n)  # every extra row costs a full step: no tree can pay


def flat_curve() -> CostCurve:
    return curve(lambda n: 0.05 + 0.0001 * n)  # a GPU: 100 rows for the price of one


def context_for(speed: SpeedModel) -> StepContext:
    """A step context carrying the step's budget from ``speed``, as the loop's sizing hands it to a policy."""
    return StepContext(root_token=3, context_length=256, temperature=0.0, top_p=1.0, budget=TreeSizer(speed, 256))


def auto_policy(cls, speed: SpeedModel, **kwargs):
    """An auto-sized policy driven by hand (its budget comes in `context_for`'s context)."""
    return cls(tree_budget="auto", **kwargs)


@pytest.mark.parametrize("policy", ["salf", "optimal", "eagle2"])
def test_steep_curve_drafts_nothing_flat_curve_grows_large_trees(policy):
    cls = POLICIES.get(policy)
    steep = SpeedModel(steep_curve(), draft_prior=0.02 / 0.05)
    source = PeakedSource()
    tree = auto_policy(cls, steep).build(source, 3, context=context_for(steep))
    assert tree.num_nodes == 1 and source.calls == 0  # the drafter never ran

    flat = SpeedModel(flat_curve(), draft_prior=0.001 / 0.05)
    tree = auto_policy(cls, flat).build(PeakedSource(), 3, context=context_for(flat))
    assert tree.num_nodes - 1 >= 20


def test_auto_needs_a_speed_model():
    with pytest.raises(ValueError, match="StepContext\\(budget="):
        POLICIES.get("salf")(tree_budget="auto").build(PeakedSource(), 3, context=StepContext(3))


@pytest.mark.auto_budget
@pytest.mark.parametrize("policy", ["chain", "delayed"])
def test_auto_refused_by_policies_without_a_budget(target, drafters, prompt, policy):
    with pytest.raises(ValueError, match="tree_budget"):
        target.generate(prompt, assistant_model=drafters["copy"], tree_policy=policy, tree_budget="auto",
                        max_new_tokens=4)


@pytest.mark.parametrize("policy", ["iid", "swor"])
def test_sampled_policies_take_only_auto_as_budget(policy):
    with pytest.raises(ValueError, match="only 'auto'"):
        POLICIES.get(policy)(tree_budget=16)
    assert POLICIES.get(policy).takes("tree_budget", "auto") and not POLICIES.get(policy).takes("tree_budget", 16)


@pytest.mark.parametrize("policy,bound", [("iid", {"tree_paths": 8, "tree_depth": 8}),
                                          ("swor", {"tree_topk": 8, "tree_depth": 8})])
def test_sampled_shape_by_cost(policy, bound):
    """Steep curve: no drafts; flat curve and a good drafter: a wide, deep shape."""
    cls = POLICIES.get(policy)
    steep = SpeedModel(steep_curve(), draft_prior=0.02 / 0.05)
    source = PeakedSource()
    tree = auto_policy(cls, steep, do_sample=True, **bound).build(source, 3, context=context_for(steep))
    assert tree.num_nodes == 1 and source.calls == 0
    flat = SpeedModel(flat_curve(), draft_prior=0.001 / 0.05)
    for _ in range(50):  # a drafter whose chains are accepted 4 deep out of 4
        flat.depth_acceptance.observe(1, 4, 4)
    assert flat.depth_acceptance.alpha > 0.9
    source = PeakedSource()
    draft = auto_policy(cls, flat, do_sample=True, **bound).draft(source, 3, context=context_for(flat))
    assert draft.tree.max_depth >= 5 and source.calls >= 5
    assert draft.shape is not None and draft.shape[1] >= 5  # returned for the loop's observation of the step


def test_depth_acceptance_learns_alpha():
    from hf_treespec.cost.speed_model import DepthAcceptance

    acc = DepthAcceptance()
    for _ in range(200):  # alpha 0.5 per token, chains of 4: E[accepted] ~ 0.94, stops early most of the time
        acc.observe(1, 4, 1)
    assert 0.3 < acc.alpha < 0.7
    assert acc.expected_tokens(2, 3) > acc.expected_tokens(1, 3)


@pytest.mark.auto_budget
@pytest.mark.parametrize("policy", ["iid", "swor"])
def test_sampled_auto_greedy_identical_and_sampling_runs(target, drafters, prompt, policy, tmp_path, monkeypatch):
    """The flat curve (pinned) and the truncated self-drafter (priced below a target step): auto draws shapes that
    draft, so the identity is one of trees, not of draft-free steps."""
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate",
                        lambda m, cache_dir=None, compiled=None, batch=1: flat_curve())
    plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
    out = target.generate(prompt, assistant_model=drafters["truncated"], tree_policy=policy, tree_budget="auto",
                          do_sample=False, max_new_tokens=30, return_dict_in_generate=True)
    assert_drafted(out)
    assert torch.equal(out.sequences, plain)
    torch.manual_seed(0)
    out = target.generate(prompt, assistant_model=drafters["truncated"], tree_policy=policy, tree_budget="auto",
                          do_sample=True, max_new_tokens=20, return_dict_in_generate=True)
    assert_drafted(out, accepting=False)
    assert out.sequences.shape[1] == prompt.shape[1] + 20


def test_bad_budget_string():
    with pytest.raises(ValueError, match="'auto'"):
        POLICIES.get("salf")(tree_budget="big")


def hand_tree(probs: list[float], parents: list[int]) -> DraftTree:
    """Root plus nodes with the given parents and conditional draft probabilities (node i is token i + 1)."""
    tree = DraftTree.root(0)
    for i, (q, p) in enumerate(zip(probs, parents)):
        tree = tree.add_children(torch.tensor([p]), torch.tensor([i + 1]), torch.tensor([q]).log())
    return tree


class FixedAcceptance:
    """Acceptance = exp(score) (a perfectly calibrated drafter)."""

    def __call__(self, scores):
        return scores.exp()


def test_stopping_rule_on_hand_made_tree():
    # chain of 3 nodes with path probs 0.9, 0.81, 0.729, then two weak siblings of the root (0.01 each)
    tree = hand_tree([0.9, 0.9, 0.9, 0.01, 0.01], [0, 1, 2, 0, 0])
    # target: 1 row 10 ms, each extra row +1 ms; a draft forward costs 0 (already spent)
    speed = SpeedModel(CostCurve([1, 2, 3, 4, 5, 6], [256], [[0.010, 0.011, 0.012, 0.013, 0.014, 0.015]]))
    speed.acceptance = FixedAcceptance()
    sizer = TreeSizer(speed, 256)
    sizer.t_draft = 0.0
    n, tokens, rate = sizer.best(tree)
    # keeping the chain: (1 + 0.9 + 0.81 + 0.729) / 13 ms beats adding the 0.01 siblings at 1 ms each
    assert n == 3 and tokens == pytest.approx(3.439, abs=1e-3)
    pruned = sizer.prune(tree)
    assert pruned.tokens.tolist() == [0, 1, 2, 3]
    # expanding the chain tip (mass 0.729) pays on this flat-ish curve; a 1e-4 leaf does not
    assert sizer.worth_expanding(tree, torch.tensor([3]))
    leaf = hand_tree([1e-4], [0])
    sizer.expansions = 1
    sizer.t_draft = 0.005
    assert not sizer.worth_expanding(leaf, torch.tensor([1]))


def test_auto_expands_only_nodes_the_kept_tree_holds():
    # the chain (0.9, 0.81, 0.729) is kept, the two 0.01 siblings of the root are not: expanding them cannot pay
    tree = hand_tree([0.9, 0.9, 0.9, 0.01, 0.01], [0, 1, 2, 0, 0])
    speed = SpeedModel(CostCurve([1, 2, 3, 4, 5, 6], [256], [[0.010, 0.011, 0.012, 0.013, 0.014, 0.015]]))
    speed.acceptance = FixedAcceptance()
    sizer = TreeSizer(speed, 256)
    sizer.t_draft, sizer.expansions = 0.0, 1
    assert sizer.in_best_prefix(tree, torch.arange(6)).tolist() == [True, True, True, True, False, False]
    # G's members only: the root's children outside G are never kept
    members = torch.tensor([True, True, False, False, True, True])
    assert sizer.in_best_prefix(tree, torch.tensor([1, 4]), members).tolist() == [True, False]


class WideSource(DraftSource):
    """Every node's children: 30 tokens of nearly equal probability (an unsure drafter)."""

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        probs = torch.full((nodes.numel(), VOCAB), 1e-6)
        probs[:, :30] = torch.linspace(1.0, 0.9, 30)
        return (probs / probs.sum(-1, keepdim=True)).log()


@pytest.mark.parametrize("policy", ["salf", "optimal"])
def test_auto_drafts_at_most_max_children_per_node(policy):
    flat = SpeedModel(flat_curve(), draft_prior=0.001 / 0.05)
    context = context_for(flat)
    tree = auto_policy(POLICIES.get(policy), flat).build(WideSource(), 3, context=context)
    children = torch.bincount(tree.parents[1:], minlength=tree.num_nodes)
    assert tree.num_nodes > 1 and int(children.max()) <= context.budget.max_children < 30


PLAIN_STEP = 0.04  # seconds of a draft-free step in the simulations below


def simulate(speed: SpeedModel, steps: int, drafted_step, seed: int = 0, seconds: list | None = None) -> list[str]:
    """Runs ``steps`` decoding steps against ``speed`` as the loop does: "skip" and "control" give a draft-free step
    (one token in PLAIN_STEP seconds, +-10% noise), "size" / "probe" a drafted one, ``(tokens, seconds) =
    drafted_step(generator)``. Returns each step's mode (and appends each step's seconds to ``seconds`` when given)."""
    gen = torch.Generator().manual_seed(seed)
    modes = []
    for _ in range(steps):
        mode = speed.step_mode(256)
        modes.append(mode)
        if mode in ("skip", "control"):
            step = PLAIN_STEP * (0.9 + 0.2 * float(torch.rand(1, generator=gen)))
            speed.observe_step(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1,
                               context=256, draft_seconds=0.0, draft_forwards=0, verify_seconds=step, tokens=1)
        else:
            tokens, step = drafted_step(gen)
            on_path = torch.arange(4) < tokens - 1
            speed.observe_step(tree_scores=torch.full((4,), -0.7), on_path=on_path, rows=5, context=256,
                               draft_seconds=0.2 * step, draft_forwards=2, verify_seconds=0.8 * step,
                               tokens=tokens)
        if seconds is not None:
            seconds.append(step)
    return modes


def geometric_step(accept: float, slowdown: float):
    """A drafted step: 1 + Geometric(accept) tokens (at most 5), in ``slowdown`` draft-free steps' time (+-20%)."""

    def step(gen: torch.Generator) -> tuple[int, float]:
        tokens = 1
        while tokens < 5 and float(torch.rand(1, generator=gen)) < accept:
            tokens += 1
        return tokens, slowdown * PLAIN_STEP * (0.8 + 0.4 * float(torch.rand(1, generator=gen)))

    return step


def flat_speed() -> SpeedModel:
    return SpeedModel(curve(lambda n: PLAIN_STEP + 0.0005 * n))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paying_drafter_is_not_switched_off_by_unlucky_steps(seed):
    # tau ~1.9 in 1.5 draft-free steps' time: drafting is ~1.25x faster, but single steps often commit one token
    speed = flat_speed()
    modes = simulate(speed, 2000, geometric_step(accept=0.47, slowdown=1.5), seed=seed)
    assert modes.count("skip") / len(modes) < 0.03
    # (judged over the ~100-step window of drafted steps; the 20-step `drafted` window is for inspection and noisy)
    assert speed.gain.mean > 0 and speed.steps.tokens / speed.steps.seconds > speed.plain_rate(256)


@pytest.mark.parametrize("accept, slowdown, clear", [(0.1, 1.4, True), (0.0, 1.15, True), (0.1, 1.2, False)])
def test_losing_drafter_is_switched_off_and_reprobed_in_doubling_intervals(accept, slowdown, clear):
    # tau ~1.1 (or 1) in 1.4 / 1.15 / 1.2 draft-free steps' time: drafted steps lose ~0.3 / 0.15 / 0.1 tokens each
    speed = flat_speed()
    modes = simulate(speed, 4000, geometric_step(accept=accept, slowdown=slowdown))
    assert "skip" in modes[:40]  # off after a few dozen drafted steps at most ...
    assert modes.count("skip") / len(modes) > 0.85  # ... and off for most of the run
    # probes come as bursts of at least PROBE_STEPS drafted steps, after 16, 32, 64 ... draft-free steps, or later
    # when the last probe lost more than PROBE_BUDGET of the draft-free time since
    text = "".join("s" if m == "skip" else "p" if m == "probe" else "d" for m in modes)
    # (a lone first skip may be the step that measures the draft-free rate before drafting is judged against it)
    runs = re.findall(r"s+|[pd]+", text[text.index("ss"):])
    assert all(r.startswith("p" * PROBE_STEPS) for r in runs[1:-1:2])  # the last run may be cut short
    gaps = [len(r) for r in runs[0:-1:2]]  # the last run is cut by the end of the simulation
    assert min(gaps) >= REPROBE_EVERY - 1
    if clear:  # a probe that pays now and then (the marginal loser's lucky streaks) brings the interval back to 16
        assert gaps[-1] >= 255 and gaps[-1] == max(gaps)
    assert speed.reprobe_every <= MAX_REPROBE_EVERY


@pytest.mark.parametrize("slowdown", [2.0, 8.0])
def test_reprobing_a_costly_drafter_costs_at_most_the_probe_budget(slowdown):
    # a probe of a large batch drafts every row: here one drafted step costs 2x / 8x a draft-free step and gains
    # nothing, so each probe loses 4-28 steps' time; after the first decision the probes' share of the run's time
    # stays near PROBE_BUDGET (the doubling alone would spend 4 x 7 / 16 = 175% at 8x early on)
    speed = flat_speed()
    seconds: list[float] = []
    modes = simulate(speed, 6000, geometric_step(accept=0.0, slowdown=slowdown), seconds=seconds)
    first_skip = modes.index("skip")
    probe = sum(t for m, t in zip(modes[first_skip:], seconds[first_skip:]) if m != "skip")
    plain = sum(t for m, t in zip(modes[first_skip:], seconds[first_skip:]) if m == "skip")
    excess = probe - modes[first_skip:].count("probe") * PLAIN_STEP  # time beyond what draft-free steps would take
    assert modes[first_skip:].count("probe") >= PROBE_STEPS  # it still re-probes
    assert excess / (probe + plain) < 2 * PROBE_BUDGET


def test_drafter_switched_off_by_a_bad_start_comes_back_after_a_probe():
    speed = flat_speed()
    bad = simulate(speed, 40, geometric_step(accept=0.0, slowdown=1.6))
    assert bad[-1] == "skip"
    good = simulate(speed, 400, geometric_step(accept=0.7, slowdown=1.3), seed=1)
    assert "probe" in good and good[-100:].count("skip") == 0 and speed.reprobe_every == REPROBE_EVERY


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_probe_switches_drafting_back_on_only_when_it_gains(seed):
    # a marginal loser with noisy steps (1 or 3 tokens in 1.7 draft-free steps' time: -0.2 tokens a step, a standard
    # deviation of ~1): once the evidence switched it off, a probe's few lucky steps lift the mean within two
    # standard errors of zero, which is not a gain; only a positive mean gain switches drafting back on
    def marginal(gen: torch.Generator) -> tuple[int, float]:
        tokens = 3 if float(torch.rand(1, generator=gen)) < 0.25 else 1
        return tokens, 1.7 * PLAIN_STEP * (0.8 + 0.4 * float(torch.rand(1, generator=gen)))

    speed = flat_speed()
    modes = simulate(speed, 3000, marginal, seed=seed)
    after = modes[modes.index("skip"):]
    assert after.count("size") == 0 and "probe" in after and speed.gain.mean < 0


def test_a_batch_drafter_that_loses_a_little_is_switched_off():
    # a batch of 4 on a CPU: draft-free steps commit 4 tokens, drafted ones 6 in 1.58 times as long (5% fewer tokens
    # per second): the ~100-step window of drafted steps tells that from breaking even
    speed = SpeedModel(curve(lambda n: PLAIN_STEP + 0.0005 * n), batch=4)
    free = dict(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1, context=256,
                draft_seconds=0.0, draft_forwards=0, verify_seconds=PLAIN_STEP, tokens=4)
    speed.observe_step(**free)
    modes = []
    for _ in range(200):
        modes.append(speed.step_mode(256))
        if modes[-1] in ("skip", "control"):
            speed.observe_step(**free)
        else:
            speed.observe_step(tree_scores=torch.full((8,), -0.7), on_path=torch.arange(8) < 2, rows=3, context=256,
                               draft_seconds=0.2 * PLAIN_STEP, draft_forwards=1, verify_seconds=1.38 * PLAIN_STEP,
                               tokens=6)
    assert speed.gain.mean < 0
    assert "skip" in modes[:40] and modes.count("skip") > 150


def test_drafting_is_switched_off_against_a_draft_free_rate_measured_while_it_drafts():
    # batch 4 on the OpenVINO step: the cost curve priced a draft-free step at 1.3x its real time and every call
    # drafted from its first step, so drafted steps that lost 21% against real draft-free steps (1.43 tokens in 1.8x
    # the time) looked like a gain and were never switched off. Controls measure the real rate while drafting
    speed = SpeedModel(curve(lambda n: 1.3 * PLAIN_STEP + 0.0005 * n))
    modes = simulate(speed, 1000, geometric_step(accept=0.3, slowdown=1.8))
    controls = "".join("c" if m == "control" else "." for m in modes)
    assert "c" * (CONTROL_STEPS + 1) in controls[:MIN_EVIDENCE + 5 + CONTROL_STEPS]  # measured once it is judged
    assert "skip" in modes[:200] and modes.count("skip") / len(modes) > 0.8


@pytest.mark.parametrize("seed", [0, 1])
def test_a_paying_drafter_measures_the_draft_free_rate_now_and_then(seed):
    # a drafter that pays keeps drafting; every CONTROL_EVERY drafted steps a control (a transition, then
    # CONTROL_STEPS rated draft-free steps) refreshes the rate it is judged against (the context grows, the
    # machine's speed drifts)
    speed = flat_speed()
    modes = simulate(speed, 2000, geometric_step(accept=0.6, slowdown=1.5), seed=seed)
    runs = [len(r) for r in re.findall(r"c+", "".join("c" if m == "control" else "." for m in modes))]
    assert runs and set(runs) == {CONTROL_STEPS + 1}
    assert len(runs) == pytest.approx(len(modes) / (CONTROL_EVERY + CONTROL_STEPS + 1), abs=2)
    assert speed.plain.steps == CONTROL_STEPS * len(runs)  # a control's first step is not rated
    assert modes.count("skip") / len(modes) < 0.03 and speed.gain.mean > 0


def test_steps_of_a_batch_whose_rows_finished_do_not_set_its_rates():
    # batch 4: a step of the last row left commits 1 token in nearly a full step's time; taken as the batch's
    # draft-free rate it made every drafted step of the full batch look like a gain
    speed = SpeedModel(curve(lambda n: PLAIN_STEP + 0.0005 * n), batch=4)
    free = dict(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1, context=256,
                draft_seconds=0.0, draft_forwards=0)
    speed.observe_step(**free, verify_seconds=0.035, tokens=1, trees=1)
    assert speed.plain.rate is None and speed.host_seconds(False) == 0.0
    speed.observe_step(**free, verify_seconds=0.045, forward_seconds=0.04, other_seconds=0.001, tokens=4, trees=4)
    assert speed.plain.rate == pytest.approx(4 / 0.046)


def test_host_work_outside_the_forward_is_priced_into_step_costs():
    # the curve prices forwards; a step also spends host time after them (verification, commits, emission), more
    # when its trees had drafts: step_costs adds each kind's measured host seconds to the curve's forward
    speed = flat_speed()
    speed.observe_step(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1, context=256,
                       draft_seconds=0.0, draft_forwards=0, verify_seconds=0.042, forward_seconds=0.040,
                       other_seconds=0.001, tokens=1)
    assert speed.host_seconds(True) == pytest.approx(0.003)  # no drafted step yet: the draft-free steps' host work
    speed.observe_step(tree_scores=torch.full((4,), -0.7), on_path=torch.arange(4) < 1, rows=5, context=256,
                       draft_seconds=0.01, draft_forwards=1, verify_seconds=0.050, forward_seconds=0.042,
                       other_seconds=0.002, tokens=2)
    forwards = speed.curve.costs(8, 256)
    costs = speed.step_costs(8, 256)
    assert float(costs[0] - forwards[0]) == pytest.approx(0.003)
    assert torch.allclose(costs[1:] - forwards[1:], torch.full((7,), 0.010, dtype=costs.dtype))


def test_a_warm_up_step_only_lowers_cost_estimates():
    # a call's first drafted step runs the drafter over the whole prompt (and new shapes for the first time): on the
    # OpenVINO step it measured 18 ms a draft forward instead of 5, and that one sample priced every later tree out.
    # Its times bound the steady costs from above: they may lower an estimate (a prior far too high), never raise it
    speed = flat_speed()
    drafted = dict(tree_scores=torch.full((4,), -0.7), on_path=torch.arange(4) < 2, rows=5, context=256,
                   draft_forwards=2, tokens=3)
    prior_draft, prior_curve = speed.draft_seconds(256), speed.curve.costs(8, 256).clone()
    prior_acceptance = speed.acceptance.rates()
    speed.observe_step(**drafted, draft_seconds=20 * prior_draft, verify_seconds=0.2, forward_seconds=0.15,
                       other_seconds=0.05, warm_up=True)
    assert speed.draft_seconds(256) == prior_draft and speed.host_seconds(True) == 0.0
    assert torch.equal(speed.curve.costs(8, 256), prior_curve) and speed.steps.count == 0
    assert not torch.equal(speed.acceptance.rates(), prior_acceptance)
    assert TreeSizer(speed, 256).could_pay()
    speed.observe_step(**drafted, draft_seconds=prior_draft / 2, verify_seconds=0.2, forward_seconds=0.15,
                       other_seconds=0.05, warm_up=True)
    assert speed.draft_seconds(256) == pytest.approx(prior_draft / 4) and speed.steps.count == 0
    speed.observe_step(**drafted, draft_seconds=prior_draft, verify_seconds=PLAIN_STEP, other_seconds=0.001)
    assert prior_draft / 4 < speed.draft_seconds(256) < prior_draft / 2 and speed.steps.count == 1  # steady: raises


def test_a_warm_up_draft_free_step_is_not_the_draft_free_rate():
    # a call's first step carries its one-time work: as the only measured draft-free rate (23.8 ms a step at batch 4
    # on the OpenVINO step against 19 later) it made 1-node trees that lost 26% look within noise of plain decoding
    speed = flat_speed()
    free = dict(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1, context=256,
                draft_seconds=0.0, draft_forwards=0, tokens=1, other_seconds=0.001)
    speed.observe_step(**free, verify_seconds=3 * PLAIN_STEP, warm_up=True)
    assert speed.plain.rate is None
    speed.observe_step(**free, verify_seconds=PLAIN_STEP)
    assert speed.plain.rate == pytest.approx(1 / (PLAIN_STEP + 0.001))


def test_a_few_slow_first_draft_forwards_do_not_price_trees_out():
    # the drafter's first forwards (each a shape's first run) measured 10-14 ms against 5 ms later on the OpenVINO
    # step; an average seeded by them priced every tree out before the cost was measured again
    speed = flat_speed()
    for seconds in (0.014, 0.012, 0.005, 0.005, 0.006):
        speed.observe_step(tree_scores=torch.full((4,), -0.7), on_path=torch.arange(4) < 2, rows=5, context=256,
                           draft_seconds=seconds, draft_forwards=1, verify_seconds=PLAIN_STEP, tokens=2,
                           other_seconds=0.001 if seconds > 0.01 else 0.0005)
    assert speed.draft_seconds(256) == pytest.approx(0.006)
    assert speed.host_seconds(True) == pytest.approx(0.0005)


@pytest.mark.auto_budget
def test_the_sizing_learns_each_step_with_its_host_tail(target, drafters, prompt, monkeypatch):
    # every verified step reaches the speed model once, after its tail (commits, emission) ended, the last one too
    seen = []
    original = SpeedModel.observe_step

    def record(self, **step):
        seen.append(step)
        original(self, **step)

    monkeypatch.setattr(SpeedModel, "observe_step", record)
    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate", lambda model, *a, **k: flat_curve())
    forget_speed_models(target)  # a fresh speed model: what earlier tests taught it may switch drafting off
    out = target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=drafters["truncated"],
                          tree_policy="salf", return_dict_in_generate=True)
    assert_drafted(out)
    assert len(seen) == len(out.tree_sizes)
    assert all(step["other_seconds"] > 0 and 0 < step["forward_seconds"] <= step["verify_seconds"] for step in seen)
    # the call's first step and its first drafted step (the drafter's forward over the prompt) are its warm-ups
    first = next(i for i, step in enumerate(seen) if step["draft_forwards"])
    assert [step["warm_up"] for step in seen] == [i in (0, first) for i in range(len(seen))]


def test_a_step_that_ran_the_drafter_but_kept_no_node_counts_as_drafted():
    speed = flat_speed()
    for _ in range(12):  # the drafter ran (2 forwards), the cost rule kept the root alone: one token, 1.75 steps' time
        speed.observe_step(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1, context=256,
                           draft_seconds=0.03, draft_forwards=2, verify_seconds=PLAIN_STEP, tokens=1)
    assert speed.plain.rate is None and speed.gain.count > 9
    # judged against a measured draft-free rate: a control measures it first, then drafting is off
    free = dict(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1, context=256,
                draft_seconds=0.0, draft_forwards=0, verify_seconds=PLAIN_STEP, tokens=1)
    for _ in range(CONTROL_STEPS + 1):
        assert speed.step_mode(256) == "control"
        speed.observe_step(**free)
    assert speed.step_mode(256) == "skip" and speed.plain.steps == CONTROL_STEPS


def test_best_child_probability_is_learned_from_drafted_trees():
    speed = SpeedModel(steep_curve())
    assert speed.child_logprob == pytest.approx(math.log(0.5))  # the prior
    # root -> 0.6 (best), 0.3; node 1 -> 0.2 (its only child); node 2 and 3 are leaves
    tree = hand_tree([0.6, 0.3, 0.2], [0, 0, 1])
    speed.observe_children(tree.scores, tree.parents)
    assert speed.child_logprob == pytest.approx(math.log((0.6 + 0.2) / 2), abs=1e-5)
    speed.observe_children(torch.zeros(1), torch.tensor([-1]))  # a root alone tells nothing
    assert speed.child_logprob == pytest.approx(math.log(0.4), abs=1e-5)


@pytest.mark.parametrize("best_child, worth", [(0.5, False), (0.95, True)])
def test_lookahead_expects_the_learned_best_child(best_child, worth):
    # a chain root -> a (q 0.5) already drafted with one forward; target: 10 ms + 1 ms per row, drafting 2 ms
    speed = SpeedModel(CostCurve([1, 2, 3, 4, 5, 6], [256], [[0.010, 0.011, 0.012, 0.013, 0.014, 0.015]]))
    speed.acceptance = FixedAcceptance()
    speed.observe_children(torch.tensor([0.0, math.log(best_child)]), torch.tensor([-1, 0]))
    sizer = TreeSizer(speed, 256)
    sizer.t_draft, sizer.expansions = 0.002, 1
    tree = hand_tree([0.5], [0])
    # bounding the next level by a's own acceptance (0.5) would expand: (1.5 + 0.5) / 16 ms > 1.5 / 13 ms; what the
    # best child is expected to add (0.5 * best_child) pays only for a confident drafter
    assert sizer.worth_expanding(tree, torch.tensor([1])) is worth
    # the root's first expansion stays optimistic: a root alone always tries the drafter on this curve
    root = DraftTree.root(0)
    sizer.expansions = 0
    assert sizer.worth_expanding(root, torch.tensor([0]))


def test_acceptance_table_learns_and_is_monotone():
    table = AcceptanceTable()
    high = torch.full((200,), -0.1)  # p ~ 0.9 by the drafter ...
    table.observe(high, torch.zeros(200, dtype=torch.bool))  # ... but never accepted
    assert float(table(torch.tensor([-0.1]))) < 0.1
    rates = table.rates()
    assert bool((rates[1:] >= rates[:-1]).all())


def test_cost_curve_interpolates_and_learns_online():
    c = CostCurve([1, 4], [100, 300], [[0.01, 0.02], [0.02, 0.04]])
    assert c(1, 100) == pytest.approx(0.01) and c(4, 300) == pytest.approx(0.04)
    assert c(2, 200) == pytest.approx((0.01 + 1 / 3 * 0.01 + 0.02 + 1 / 3 * 0.02) / 2)
    assert c.costs(4, 100)[3] == pytest.approx(0.02)
    for _ in range(100):
        c.observe(1, 100, 0.03)
    assert c(1, 100) == pytest.approx(0.03, rel=1e-2)
    assert c(4, 100) >= c(1, 100)  # kept nondecreasing in rows


def test_a_slow_stretch_of_one_row_steps_moves_the_whole_curve():
    # another process slows every forward: a stretch of slow draft-free steps lifts the whole curve and keeps its
    # shape (lifting the one-row cost alone flattened the small trees' costs into it, and auto grew large trees)
    c = CostCurve([1, 2, 4, 8], [256], [[0.020, 0.022, 0.026, 0.034]])
    for _ in range(200):
        c.observe(1, 256, 0.030)
    assert c(1, 256) == pytest.approx(0.030, rel=1e-2)
    assert c(1, 256) < c(2, 256) < c(4, 256) < c(8, 256)
    assert c(8, 256) / c(1, 256) == pytest.approx(0.034 / 0.020, rel=0.15)


def test_calibration_is_cached_per_model(target, tmp_path, monkeypatch):
    # a tiny model's forwards take ~1 ms, so a busy CI core can make a real curve look disturbed (then it is measured
    # again by design: test_a_disturbed_calibration_is_measured_again); here every curve counts as quiet
    import hf_treespec.cost.curve as curve_module

    calls = []
    measure = curve_module.calibrate_target
    monkeypatch.setattr(curve_module, "calibrate_target", lambda *a, **k: calls.append(1) or measure(*a, **k))
    monkeypatch.setattr(curve_module, "disturbed", lambda curve: False)
    first = load_or_calibrate(target, tmp_path, sizes=(1, 4), contexts=(8,), repeats=1)
    files = list((tmp_path / "latency").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["dtype"] == "float32"
    second = load_or_calibrate(target, tmp_path, sizes=(1, 4), contexts=(8,), repeats=1)
    assert calls == [1] and second.seconds == first.seconds  # read back, not measured again
    assert all(s > 0 for s in first.seconds[0])


def test_a_disturbed_calibration_is_measured_again(target, tmp_path, monkeypatch):
    # a cached curve of a real machine had 1.66 s for one row beside 62 ms for two (the cores were busy while it was
    # measured), and sized every eager auto tree at 19 nodes; read back, such a curve is measured again
    import hf_treespec.cost.curve as curve_module

    first = load_or_calibrate(target, tmp_path, sizes=(1, 2, 4), contexts=(8,), repeats=1)
    path = next((tmp_path / "latency").glob("*.json"))
    data = json.loads(path.read_text())
    data["seconds"][0][0] = 100 * data["seconds"][0][1]
    path.write_text(json.dumps(data))
    calls = []
    clean = CostCurve([1, 2, 4], [8], [[0.010, 0.011, 0.013]], first.key)  # timings of a quiet machine
    monkeypatch.setattr(curve_module, "calibrate_target", lambda *a, **k: calls.append(1) or clean)
    assert curve_module.disturbed(CostCurve.from_json(data)) and not curve_module.disturbed(clean)
    again = load_or_calibrate(target, tmp_path, sizes=(1, 2, 4), contexts=(8,), repeats=1)
    assert calls == [1] and again.seconds == clean.seconds
    assert json.loads(path.read_text())["seconds"] == clean.seconds
    assert load_or_calibrate(target, tmp_path, sizes=(1, 2, 4), contexts=(8,), repeats=1).seconds == clean.seconds
    assert calls == [1]  # read back now


def test_calibrate_target_shape(target):
    c = calibrate_target(target, sizes=(1, 2), contexts=(4, 8), repeats=1)
    assert len(c.seconds) == 2 and len(c.seconds[0]) == 2 and "|" in c.table()


def test_calibrate_batches_prices_each_point(target):
    """One check per (batch, rows), each priced at batch x rows rows of the curve."""
    curve = CostCurve([1, 2, 4, 8], [16], [[0.001, 0.002, 0.004, 0.008]])
    checks = calibrate_batches(target, curve, batches=(1, 3), rows=(1, 2), context=16, repeats=1)
    assert [(c.batch, c.rows) for c in checks] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    assert [c.predicted for c in checks] == pytest.approx([0.001, 0.002, 0.003, 0.006])
    assert all(c.measured > 0 and c.ratio == c.measured / c.predicted for c in checks)


@pytest.mark.auto_budget
@pytest.mark.parametrize("policy", ["salf", "eagle2"])
@pytest.mark.parametrize("curve_kind", ["steep", "flat", "measured"])
def test_greedy_auto_identical_to_plain(target, drafters, prompt, policy, curve_kind, tmp_path, monkeypatch):
    """Greedy with auto (draft-free steps included) equals plain generate token for token in fp32."""
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    model = hf_treespec.enable(type(target)(target.config).eval())
    model.load_state_dict(target.state_dict())
    if curve_kind != "measured":  # pin the curve so both step kinds are exercised deterministically
        pinned = steep_curve if curve_kind == "steep" else flat_curve
        # and no control: its measured draft-free rate (this tiny model's real one) would judge the pinned trees
        monkeypatch.setattr(SpeedModel, "_controlling", lambda self: False)
        monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate",
                            lambda m, cache_dir=None, compiled=None, batch=1: pinned())
    plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
    masks = []  # the attention_mask of every target forward: None for a draft-free step, like plain generate's
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: masks.append(kwargs.get("attention_mask")),
                                           with_kwargs=True)
    try:
        # the truncated self-drafter reads half the target's layers: priced below a target step before it is timed
        out = model.generate(prompt, assistant_model=drafters["truncated"], tree_policy=policy, tree_budget="auto",
                             do_sample=False, max_new_tokens=40, return_dict_in_generate=True)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, plain)
    assert out.drafted_steps == sum(s > 0 for s in out.tree_sizes)
    step_masks = masks[-len(out.tree_sizes):]  # one forward per step, after calibration (measured) and prefill
    assert [m is None for m in step_masks] == [s == 0 for s in out.tree_sizes]
    if curve_kind == "steep":
        # no tree pays: all steps but the periodic probes run without drafts
        assert out.drafted_steps <= len(out.tree_sizes) // 8 + 1
        assert len(out.tree_sizes) >= 30
    if curve_kind == "flat":
        assert_drafted(out)  # the identity is one of trees here
        assert out.drafted_steps == len(out.tree_sizes)


@pytest.mark.auto_budget
def test_sampling_with_auto_runs_and_reports(target, drafters, prompt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    torch.manual_seed(0)
    out = target.generate(prompt, assistant_model=drafters["perturbed"], tree_policy="salf", tree_budget="auto",
                          do_sample=True, temperature=1.0, max_new_tokens=20, return_dict_in_generate=True)
    assert out.sequences.shape[1] == prompt.shape[1] + 20
    assert sum(out.accepted_lengths) + 1 == 20 and len(out.accepted_lengths) == len(out.tree_sizes)
    assert out.drafted_steps == sum(size > 0 for size in out.tree_sizes)


def test_num_beams_refused(target, drafters, prompt):
    with pytest.raises(ValueError, match="num_beams"):
        target.generate(prompt, assistant_model=drafters["copy"], tree_policy="salf", tree_budget=8, num_beams=2,
                        max_new_tokens=4)


def test_hardware_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma\n")
    name, flags = cpu_info(info)
    assert name == "AMD EPYC 7B13" and flags == ("avx2", "fma")
    assert Hardware("cpu", name, flags).fast_dtype == torch.float32
    assert Hardware("cpu", "Xeon", ("avx2", "avx512_bf16")).fast_dtype == torch.bfloat16
    assert Hardware("cpu", "Xeon", ("amx_bf16",)).fast_dtype == torch.bfloat16
    assert Hardware("cuda", "H100").fast_dtype == torch.bfloat16
    assert "AMD EPYC 7B13" in Hardware("cpu", name, flags, 2).describe()
    assert detect("cpu").device_type == "cpu"


def test_data_commands_default_to_the_fast_dtype(monkeypatch):
    """`train prepare / regenerate / nde-data` run the target in the machine's fast dtype unless told otherwise: an
    avx2-only CPU must not silently take emulated bf16 (several times slower than fp32 there)."""
    from hf_treespec.cost import hardware
    from hf_treespec.cli import build_parser

    parser = build_parser()
    for argv in (["train", "prepare"], ["train", "regenerate"], ["train", "nde-data", "--drafter", "truncated:2"]):
        assert parser.parse_args(argv).dtype == "auto"
    monkeypatch.setattr(hardware, "fast_dtype", lambda device=None: torch.float32)
    assert hardware.resolve_dtype_name("auto") == "fp32"
    monkeypatch.setattr(hardware, "fast_dtype", lambda device=None: torch.bfloat16)
    assert hardware.resolve_dtype_name("auto", "cuda") == "bf16"
    assert hardware.resolve_dtype_name("fp16") == "fp16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        hardware.resolve_dtype_name("float32")


@pytest.mark.auto_budget
def test_draft_free_steps_then_drafting_with_a_feature_drafter(target, prompt, tmp_path, monkeypatch):
    """A feature drafter that sat through many draft-free steps (its pending chain of target features kept as
    chunks) drafts again at the periodic probe, and greedy output stays identical to plain generate (the drafter's
    logits after draft-free commits are checked exactly in test_feature_drafter)."""
    from test_feature_drafter import make_drafter, permuted_vocab

    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate",
                        lambda m, cache_dir=None, compiled=None, batch=1: steep_curve())
    monkeypatch.setattr("hf_treespec.cost.speed_model.PROBE_BUDGET", 1e9)  # re-probe on the step count alone
    monkeypatch.delitem(target.__dict__, "_treespec_speed_models", raising=False)  # no curve an earlier test set
    drafter = make_drafter(target, seed=2, target_layers=[0, 2, 3], draft_vocab_size=40)
    drafter.set_draft_vocab(permuted_vocab(40))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=48)
    out = target.generate(prompt, assistant_model=drafter, tree_policy="salf", tree_budget="auto",
                          do_sample=False, max_new_tokens=48, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    sizes = out.tree_sizes
    assert 1 <= out.drafted_steps < len(sizes)  # a probe: a drafted step after a run of draft-free ones
    assert any(sizes[i] > 0 and sizes[i - 1] == 0 for i in range(1, len(sizes)))


def test_drafting_is_judged_against_the_measured_draft_free_rate():
    """The curve's one-row forward leaves out the loop's own per-step costs, so before any draft-free step the
    draft-free rate looks better than it is. Drafted steps that lose only against that prior are not switched off:
    a control's draft-free steps measure the rate, all the evidence is judged against it, and drafting goes on."""
    speed = SpeedModel(curve(lambda n: 0.030 + 0.0005 * n))  # the curve says 30 ms a plain step ...
    modes = []
    for _ in range(60):
        mode = speed.step_mode(256)
        modes.append(mode)
        if mode in ("skip", "control"):  # ... a real draft-free step takes 40 ms
            speed.observe_step(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1,
                               context=256, draft_seconds=0.0, draft_forwards=0, verify_seconds=0.040, tokens=1)
        else:  # 1.6 tokens in 55 ms: a loss against 30 ms a token, a gain against the real 40
            speed.observe_step(tree_scores=torch.full((4,), -0.7), on_path=torch.arange(4) < 1, rows=5, context=256,
                               draft_seconds=0.01, draft_forwards=1, verify_seconds=0.045,
                               tokens=2 if len(modes) % 5 < 3 else 1)
    # (the curve follows the measured forwards, which lifts the prior too; the control measures the real rate)
    assert modes.count("skip") <= 1 and set(modes[-40:]) == {"size"}
    assert speed.plain.rate in (None, pytest.approx(25.0)) and speed.gain.mean > 0


@pytest.mark.auto_budget
def test_each_policy_learns_its_own_speed_model(target, drafters, prompt, tmp_path, monkeypatch):
    """What a draft score predicts, and what a draft round costs, depend on how a policy grows its trees (EAGLE-2
    expands a fixed top-k frontier, SALF pops its best nodes): two auto-sized policies with the same drafter and
    settings keep separate speed models, so one policy's trees never size the other's."""
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_treespec.cost.speed_model.load_or_calibrate",
                        lambda m, cache_dir=None, compiled=None, batch=1: flat_curve())
    monkeypatch.delitem(target.__dict__, "_treespec_speed_models", raising=False)
    drafter = drafters["truncated"]  # half the target: priced to pay on a flat curve
    for policy in ("salf", "eagle2"):
        torch.manual_seed(0)
        out = target.generate(prompt, assistant_model=drafter, tree_policy=policy, tree_budget="auto", do_sample=True,
                              temperature=1.0, max_new_tokens=8, return_dict_in_generate=True)
        assert out.drafted_steps > 0, (policy, out.tree_sizes)
    models = next(iter(target.__dict__["_treespec_speed_models"]["drafters"].values()))
    assert len(models) == 2 and {key[2] for key in models} == {"salf", "eagle2"}


def test_held_size_grows_like_a_fixed_budget():
    held = HeldSize(max_nodes=2, shape=(3, 4))
    tree = hand_tree([0.6, 0.25, 0.5, 0.1], [0, 0, 1, 1])
    assert bool(held.in_best_prefix(tree, torch.arange(1, 5)).all())
    assert held.expand_again(tree, torch.tensor([0]))  # the root: always
    assert not held.expand_again(tree, torch.tensor([2]))  # 0.25 of draft probability: below HELD_EXPAND_MASS
    assert held.expand_again(tree, torch.tensor([1, 2]))  # 0.85
    assert not held.expand_again(tree, torch.tensor([1]))  # two expansions for two nodes: enough
    kept = held.prune(tree)
    assert kept.num_nodes == 3 and sorted(kept.tokens.tolist()) == [0, 1, 3]  # root, 0.6, 0.6 * 0.5
    assert held.choose_shape(lambda k, depth: k * depth, 2, 8) == (2, 4)
    assert HeldSize(0).choose_shape(lambda k, depth: k * depth, 2, 8) is None


def _priced_outcome(sizes: list[int], rounds: int) -> StepOutcome:
    trees = [hand_tree([0.5] * n, list(range(n))) for n in sizes]  # chains of n draft nodes
    accepted = [torch.arange(min(n + 1, 3)) for n in sizes]  # chains: root and up to two drafts accepted
    return StepOutcome(trees=trees, accepted=accepted, contexts=[],
                       width=max(sizes) + 1, context_length=256, draft_seconds=0.01, verify_seconds=0.04,
                       draft_rounds=rounds, shapes=[None] * len(trees))


def test_steps_after_the_first_priced_ones_hold_a_size_from_the_ladder():
    # the cost rule prices every expansion of the first PRICED_START drafting steps; then the ladder starts at the
    # size nearest their median and held steps grow its sizes without pricing
    speed = SpeedModel(flat_curve())
    for _ in range(CONTROL_STEPS):  # the draft-free rate measured: no control interrupts the drafting steps
        speed.observe_step(tree_scores=torch.zeros(0), on_path=torch.zeros(0, dtype=torch.bool), rows=1,
                           context=256, draft_seconds=0.0, draft_forwards=0, verify_seconds=0.02, tokens=1)
    sizing = TreeSizing(speed)
    context = StepContext(root_token=3, context_length=256)
    budgets = []
    for step in range(PRICED_START + 3):
        assert sizing.may_draft(256)
        budgets.append(sizing.budget(context).budget)
        sizing.observe(_priced_outcome([3], rounds=2))
        sizing.step_ended(0.001)
    assert [type(b) for b in budgets] == [TreeSizer] * PRICED_START + [HeldSize] * 3
    assert speed.held.ladder.best == 4 and budgets[-1].max_nodes == 4  # 4 is the ladder size nearest 3


def test_the_ladder_follows_the_measured_rate_and_explores_neighbours():
    def step(n: int) -> tuple[float, float]:  # n nodes: 1 + 0.9 * (1 - 0.5 ** n) tokens in 40 ms + 3 ms per node
        return 1 + 0.9 * (1 - 0.5**n), 0.040 + 0.003 * n

    ladder = SizeLadder.near(16)
    assert ladder.best == 16
    sizes = []
    for _ in range(800):
        size = ladder.next()
        sizes.append(size)
        ladder.observe(size, *step(size))
    best = max(LADDER, key=lambda n: step(n)[0] / step(n)[1])
    assert best == 2 and ladder.best == best  # from 16, down the ladder one neighbour at a time
    tail = sizes[-EXPLORE_EVERY * 4:]
    assert tail.count(2) == len(tail) - 4 and set(tail) == {1, 2, 4}  # one step in EXPLORE_EVERY: half or double




def test_draft_free_steps_are_the_ladders_size_0():
    # sampling with a drafter that accepts little: drafted steps commit 1.4 tokens in 30-40 ms, draft-free ones 1 in
    # 20 ms; the ladder moves down to size 0 and holds draft-free steps, trying one node now and then, and a probe
    # (which must draft) gets the best tree size measured
    def step(n: int) -> tuple[float, float]:
        return (1.0, 0.020) if n == 0 else (1.4, 0.030 + 0.002 * n)

    ladder = SizeLadder.near(4)
    sizes = []
    for _ in range(400):
        size = ladder.next()
        sizes.append(size)
        ladder.observe(size, *step(size))
    tail = sizes[-EXPLORE_EVERY * 4:]
    assert ladder.best == 0 and 1 in tail and set(tail) <= {0, 1, 2} and tail.count(0) >= len(tail) - 4
    held = HeldSizes(ladder=ladder)
    held.shapes[None] += 1
    while ladder.steps % EXPLORE_EVERY != 1:  # to the first of the held steps between two tries
        held.next()
    assert {held.next().max_nodes for _ in range(EXPLORE_EVERY - 3)} == {0}
    assert held.next(draft=True).max_nodes == ladder.best_tree() == 1
    assert SizeLadder.near(0.1).best == 1  # a ladder starts at a tree size


def test_from_size_0_the_ladder_still_climbs_to_a_tree_size_that_pays():
    # greedy: one node loses to draft-free steps, but 2 and 4 nodes beat them (4 best): from 0 the ladder tries the
    # best tree size measured and double it, so it does not stay draft-free
    rates = {0: 50.0, 1: 45.0, 2: 52.0, 4: 60.0, 8: 55.0, 16: 40.0, 32: 30.0}
    ladder = SizeLadder.near(1)
    for _ in range(400):
        size = ladder.next()
        ladder.observe(size, rates[size] / 100, 0.01)
    assert ladder.best == 4


def test_the_ladder_tries_a_clearly_worse_neighbour_rarely_and_still_finds_it_when_it_gets_better():
    # the OpenVINO step at batch 1: 8-node steps ran at 0.65x the 4-node ones, 2-node ones at 0.75x; tried one step
    # in 16 each they cost ~3% of the run
    rates = {2: 0.75, 4: 1.0, 8: 0.65}
    ladder = SizeLadder.near(4)
    sizes = []
    for _ in range(EXPLORE_EVERY * RARE_EXPLORE * 20):
        size = ladder.next()
        sizes.append(size)
        ladder.observe(size, rates.get(size, 0.5), 1.0)
    tried = len(sizes) - sizes.count(4)
    assert ladder.best == 4 and 0 < tried <= 2 + len(sizes) // (EXPLORE_EVERY * RARE_EXPLORE)
    assert {2, 8} <= set(sizes)
    rates[8] = 1.3  # the text changed: 8 nodes pay now; found within a few hundred steps (its rare tries count more)
    for _ in range(EXPLORE_EVERY * RARE_EXPLORE * 12):
        size = ladder.next()
        ladder.observe(size, rates.get(size, 0.5), 1.0)
    assert ladder.best == 8
