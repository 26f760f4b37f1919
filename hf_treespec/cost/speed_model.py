"""Measured costs and acceptance: what ``tree_budget="auto"`` sizes every tree by.

- `CostCurve` (`hf_treespec.cost.curve`): seconds of one target verification per rows and context, calibrated once
  per machine and refined online.
- `AcceptanceTable`: draft score (log of the path's draft probability) -> probability that the target accepts the
  node, binned on a log2 scale, learned online from the verified trees (EMA of hits, isotonic across bins).
- `SpeedModel`: both, plus the drafter's cost per forward and the realised speed of drafted vs. draft-free steps, so
  the loop can stop drafting where no tree pays (with periodic re-probing).

Nothing here is global: a `SpeedModel` lives on the target model instance that uses it, per drafter (held by a weak
reference) and settings (see `speed_model_for`).
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .curve import CostCurve, load_or_calibrate
from .held_size import HeldSizes

#: after this many draft-free steps a probe of PROBE_STEPS drafted steps runs, so a drafter that became useful is
#: noticed; the interval doubles after every probe that did not pay (up to MAX_REPROBE_EVERY), so a
#: drafter that never pays costs next to nothing
REPROBE_EVERY = 16
MAX_REPROBE_EVERY = 1024
PROBE_STEPS = 4
#: while drafting loses, a re-probe also waits until the draft-free time since the last probe is at least the time
#: that probe lost over this fraction, so re-probing costs at most ~this share of the run however costly a probe
#: is (a probe of a large batch drafts every row: many times a one-row probe's cost)
PROBE_BUDGET = 0.02
#: weight kept per new observation by the draft-free rate (a window of ~20 steps: it follows the context's growth)
STEP_DECAY = 0.95
#: weight kept per drafted step by their gain statistics (a window of ~100 steps: a drafted step's tokens vary by ~1,
#: so a window of 20 could not tell a drafter that loses 5% from one that breaks even)
GAIN_DECAY = 0.99
#: the drafter is switched off once the mean gain of at least MIN_EVIDENCE drafted steps (decayed count) is below
#: zero by SKIP_CONFIDENCE standard errors, one step's gain variance taken as at least GAIN_VARIANCE_FLOOR (tokens^2).
#: A paying drafter's steps commit 1, 2, 3 ... tokens (variance ~1), so an unlucky start does not switch it off; a
#: losing one commits ~1 token a step and only timing noise varies, so a loss of 0.1 token per step is still caught
MIN_EVIDENCE = 8
SKIP_CONFIDENCE = 2.0
GAIN_VARIANCE_FLOOR = 0.05
#: a control: draft-free steps while drafting is on, so drafted steps are judged against a measured draft-free rate
#: of the same stretch of decoding. One runs once MIN_EVIDENCE drafted steps were seen and fewer than CONTROL_STEPS
#: draft-free steps were ever rated, and again after every CONTROL_EVERY drafted steps. Without them the only
#: draft-free steps of a drafting run were the first of each call (23 ms against 19 later at batch 4 on the OpenVINO
#: step), and 1-node trees that lost 20-30% stayed within noise of that rate. A control's first step is a transition
#: and not rated (on the OpenVINO step the first draft-free step after drafted ones took 22-30 ms, the next 17-24),
#: then CONTROL_STEPS rated ones: it costs what drafting gains on 3 of every ~130 steps (~2% of the gain)
CONTROL_STEPS = 2
CONTROL_EVERY = 128
#: log draft probability of a node's best child before any tree was seen (learned per drafter from its trees)
CHILD_LOGPROB_PRIOR = math.log(0.5)


class AcceptanceTable:
    """Calibrated P(target accepts node) from its draft score (log path probability under q).

    Bins on log2 of the draft probability (``[2^-bins, ..]``, last bin up to 1); each bin keeps decayed hit / count
    sums plus a prior of ``prior_weight`` pseudo-observations at the bin's own probability (an uncalibrated drafter
    is taken at its word). Estimates are made monotone in the score with pool-adjacent-violators.
    """

    def __init__(self, bins: int = 16, prior_weight: float = 4.0, decay: float = 0.995):
        self.edges = torch.tensor([-float(b) for b in range(bins - 1, 0, -1)]) * math.log(2.0)  # ascending log edges
        centers = torch.tensor([-(b + 0.5) for b in range(bins - 1, -1, -1)]) * math.log(2.0)
        self.prior = centers.exp().clamp(max=1.0)
        self.prior_weight = prior_weight
        self.decay = decay
        self.hits = torch.zeros(bins, dtype=torch.float64)
        self.counts = torch.zeros(bins, dtype=torch.float64)
        self._edges = self.edges.double().numpy()
        self._rates = self._fit()

    def _fit(self) -> torch.Tensor:
        raw = (self.hits + self.prior_weight * self.prior) / (self.counts + self.prior_weight)
        rates = _isotonic(raw, self.counts + self.prior_weight).float()
        self._rates_np = rates.double().numpy()
        return rates

    def bin_of(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(scores.detach().float().cpu(), self.edges)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """Acceptance probabilities ``[n]`` for draft log-scores ``[n]`` (on the CPU)."""
        return self._rates[self.bin_of(scores)]

    def probabilities(self, scores: np.ndarray) -> np.ndarray:
        """`__call__` on a float64 numpy array (the cost rule's per-step arithmetic runs in numpy: a few microseconds
        per call where torch's per-op overhead would add up to a noticeable share of a compiled step)."""
        return self._rates_np[np.searchsorted(self._edges, scores, side="left")]

    def observe(self, scores: torch.Tensor, accepted: torch.Tensor) -> None:
        """One verified tree: ``scores`` of its draft nodes, ``accepted`` (bool): whether each was accepted."""
        self.hits.mul_(self.decay)
        self.counts.mul_(self.decay)
        bins = self.bin_of(scores)
        self.counts.index_add_(0, bins, torch.ones(bins.numel(), dtype=torch.float64))
        self.hits.index_add_(0, bins, accepted.detach().cpu().to(torch.float64))
        self._rates = self._fit()

    def rates(self) -> torch.Tensor:
        return self._rates.clone()


def _isotonic(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted pool-adjacent-violators: the nondecreasing sequence nearest ``values`` (a handful of bins)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return torch.tensor([v for v, _, n in blocks for _ in range(n)], dtype=values.dtype)


@dataclass
class EMA:
    value: float | None = None
    rate: float = 0.2

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.rate * (x - self.value)


#: samples a cost estimate keeps (`RecentMedian`)
COST_WINDOW = 9


@dataclass
class RecentMedian:
    """The median of the latest `COST_WINDOW` samples: the per-step costs (a draft forward, a step's host work). A
    few slow samples (a shape's first run, a short stall) cannot move it far, where an average's first sample set it
    outright: the drafter's first forwards on the OpenVINO step measured 10-14 ms against 5 ms later, and at twice its
    cost no tree paid, so the drafter was switched off before its cost was measured again."""

    window: int = COST_WINDOW
    value: float | None = None
    samples: deque = field(default_factory=deque)

    def add(self, x: float) -> None:
        self.samples.append(x)
        if len(self.samples) > self.window:
            self.samples.popleft()
        self.value = statistics.median(self.samples)


@dataclass(frozen=True)
class GainEstimate:
    """The gain of drafted steps over draft-free decoding (tokens per step), at one draft-free rate."""

    count: float
    mean: float
    variance: float


@dataclass
class DraftedSteps:
    """Decayed sums over drafted steps of their tokens ``t`` and seconds ``s`` (and ``t^2``, ``s^2``, ``t s``). A
    step's gain against draft-free decoding at rate ``r`` is ``t - r s``, so its mean and variance follow for any
    ``r``: every decision judges all the evidence against the best current estimate of the draft-free rate, not
    against whatever rate was assumed when each step ran (before the first draft-free step is measured, the cost
    curve's one-row forward, which leaves out the loop's own per-step costs and so makes early drafted steps look
    worse than they are)."""

    decay: float = GAIN_DECAY
    count: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens2: float = 0.0
    seconds2: float = 0.0
    cross: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.count = d * self.count + 1.0
        self.tokens, self.seconds = d * self.tokens + tokens, d * self.seconds + seconds
        self.tokens2, self.seconds2 = d * self.tokens2 + tokens * tokens, d * self.seconds2 + seconds * seconds
        self.cross = d * self.cross + tokens * seconds

    def gain(self, rate: float) -> GainEstimate:
        if not self.count:
            return GainEstimate(0.0, 0.0, 0.0)
        n = self.count
        mean = (self.tokens - rate * self.seconds) / n
        square = (self.tokens2 - 2 * rate * self.cross + rate * rate * self.seconds2) / n
        return GainEstimate(n, mean, max(square - mean * mean, 0.0))


@dataclass
class RateWindow:
    """Tokens per second over recent steps of one kind, as a ratio of decayed sums (a mean of per-step rates would
    be skewed by single lucky or slow steps)."""

    decay: float = STEP_DECAY
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0  # steps observed (not decayed)

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds
        self.steps += 1

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class DepthAcceptance:
    """Per-depth acceptance of sampled trees with ``k`` paths / siblings, for choosing their shape (k, l).

    Model: at every depth the target continues with probability ``alpha_k = 1 - (1 - alpha)^k`` (k independent
    tries of one per-token acceptance ``alpha``). A step with shape (k, l) that accepted ``a`` drafts gives ``a``
    successes and, when ``a < l``, one failure at depth a + 1 (a truncated geometric). ``alpha`` is the maximum-
    likelihood value on a grid over the decayed success / failure counts per k; before any step it is ``prior``.
    """

    def __init__(self, prior: float = 0.5, decay: float = 0.98, prior_weight: float = 2.0):
        self.grid = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
        self.prior, self.decay, self.prior_weight = prior, decay, prior_weight
        self.counts: dict[int, list[float]] = {}  # k -> [successes, failures]

    def observe(self, k: int, depth: int, accepted: int) -> None:
        for value in self.counts.values():
            value[0] *= self.decay
            value[1] *= self.decay
        entry = self.counts.setdefault(int(k), [0.0, 0.0])
        entry[0] += accepted
        entry[1] += 1.0 if accepted < depth else 0.0

    @property
    def alpha(self) -> float:
        # the prior as pseudo-counts of a single chain
        loglik = self.prior_weight * (self.prior * self.grid.log() + (1 - self.prior) * (1 - self.grid).log())
        for k, (wins, losses) in self.counts.items():
            alpha_k = 1 - (1 - self.grid) ** k
            loglik = loglik + wins * alpha_k.log() + losses * (1 - alpha_k).clamp(min=1e-12).log()
        return float(self.grid[int(loglik.argmax())])

    def expected_tokens(self, k: int, depth: int) -> float:
        """1 + expected accepted drafts of a (k, depth) sampled tree under the model."""
        a = 1 - (1 - self.alpha) ** k
        return 1 + sum(a**j for j in range(1, depth + 1))


class SpeedModel:
    """Everything ``tree_budget="auto"`` decides with: target cost curve, drafter cost per forward, acceptance.

    ``curve`` is the cost of the batch's own ``[batch, rows]`` verification forwards (calibrated at that batch size).
    ``draft_seconds`` starts at ``draft_prior`` times a target step over the same rows (the drafter's share of the
    weights a forward reads: `forward_bytes`, so a drafter as large as the target is priced as one target step per
    draft forward and declined from the first step) and follows the measured drafting time per forward. Every step that ran the drafter also records its *gain*: tokens committed minus what
    draft-free steps commit in the same time (their measured rate, or the cost curve's one-row step before any). The
    drafter is switched off ("skip") only once the mean gain is below zero by `SKIP_CONFIDENCE` standard errors over
    enough drafted steps, so a single unlucky step never switches it off; then every ``reprobe_every`` draft-free
    steps a probe of `PROBE_STEPS` drafted steps adds fresh evidence, and drafting comes back on only when the mean
    gain is then above zero; the interval doubles after every probe that leaves the mean gain below zero and returns
    to ``reprobe_every`` once it is above, and it never ends before the draft-free time since the last probe is
    1 / `PROBE_BUDGET` times what that probe lost (before any probe: what one is predicted to lose, so at a large
    batch, where a probe drafts every row, probes stay rare from the start).
    While drafting is on, controls (a transition and `CONTROL_STEPS` draft-free steps, once drafting is first judged
    and then every `CONTROL_EVERY` drafted steps) keep the draft-free rate it is judged against measured.
    """

    def __init__(self, curve: CostCurve, acceptance: AcceptanceTable | None = None, draft_prior: float = 0.3,
                 reprobe_every: int = REPROBE_EVERY, batch: int = 1, batched_drafting: bool = False):
        self.curve = curve
        #: rows decoded together: a step verifies ``batch`` trees in one ``[batch, n]`` forward (``curve`` prices it)
        #: and drafts them in rounds, one round per expansion: ONE forward for all rows when the drafter batches them
        #: (``batched_drafting``), else one forward per row
        self.batch = batch
        self.batched_drafting = batched_drafting
        self.acceptance = acceptance if acceptance is not None else AcceptanceTable()
        self._draft = RecentMedian()
        self._draft_prior = draft_prior
        #: host seconds a step spends outside drafting and its forward (building inputs, verification, commits,
        #: emission), for steps without and with draft nodes: what the curve (forwards only) leaves out
        self._host = {False: RecentMedian(), True: RecentMedian()}
        self._child = EMA()
        self.drafted = RateWindow()  # steps that ran the drafter (for inspection; the decision reads `gain`)
        self.plain = RateWindow()  # draft-free steps
        self.steps = DraftedSteps()  # drafted steps' tokens and seconds: their gain at any draft-free rate
        self._context = 1  # the context of the latest step (the draft-free rate's prior reads the curve there)
        self._off = False  # drafting switched off: only a probe switches it on again
        self.reprobe_every = reprobe_every
        self._base_reprobe = reprobe_every
        self._since_draft = 0
        self._probe_left = 0
        self._probe_loss: float | None = None  # seconds the last probe lost against draft-free steps
        self._free_seconds = 0.0  # draft-free seconds since the last drafted step
        self._since_free = 0  # drafted steps since the last rated draft-free step
        self._control_left = 0  # draft-free steps left in the current control
        self.depth_acceptance = DepthAcceptance()
        self.held = HeldSizes()  # the tree size held between priced steps, chosen by measured rate

    def target_seconds(self, rows: int, context: int) -> float:
        """Predicted seconds of a step verifying ``rows`` rows (root included) in each of the batch's trees."""
        return self.curve(rows, context)

    def step_costs(self, max_rows: int, context: int) -> torch.Tensor:
        """``[max_rows]`` predicted seconds of a step verifying 1..max_rows rows per tree (one vectorised call): the
        curve's forward plus the measured host work of a step without drafts (one row) or with them (more rows)."""
        costs = self.curve.costs(max_rows, context) + self.host_seconds(True)
        costs[0] += self.host_seconds(False) - self.host_seconds(True)
        return costs

    def host_seconds(self, drafts: bool) -> float:
        """Measured host seconds of a step's work outside drafting and the target forward (`observe_step`), for a
        step whose trees had draft nodes or not; before any such step, the other kind's (0 before any step)."""
        own, other = self._host[drafts].value, self._host[not drafts].value
        return own if own is not None else (other if other is not None else 0.0)

    def draft_seconds(self, context: int) -> float:
        """Seconds per draft round (one expansion of every row of the batch): the median of the latest measured, or
        before any the prior: ``draft_prior`` times the target's one-row step of the batch (batched drafting: one
        forward for every row), or times it once per row (a drafter that expands row by row)."""
        if self._draft.value is not None:
            return self._draft.value
        one_row = self.curve(1, context)
        return self._draft_prior * one_row * (1 if self.batched_drafting else self.batch)

    @property
    def child_logprob(self) -> float:
        """Log of the mean draft probability of an expanded node's best child (how far below its parent the best
        child scores on average): what the cost rule's lookahead expects of an expansion it has not drafted yet. The
        mean is taken over probabilities, not logs: acceptance grows with the probability, and a mean of logs would
        let a few near-zero children drag the estimate far down."""
        return math.log(self._child.value) if self._child.value is not None else CHILD_LOGPROB_PRIOR

    def observe_children(self, scores: torch.Tensor, parents: torch.Tensor) -> None:
        """One drafted tree (``scores``: draft log path probabilities, ``parents``: -1 at the root): the mean
        conditional draft probability of every expanded node's best child."""
        if parents.numel() < 2:
            return
        best = torch.full_like(scores, -math.inf).scatter_reduce(0, parents[1:], scores[1:], "amax")
        expanded = torch.isfinite(best)
        self._child.add(max(float((best[expanded] - scores[expanded]).exp().mean()), 1e-6))

    def plain_rate(self, context: int) -> float:
        """Tokens per second of a draft-free step: measured (steps of the full batch), or before any one per row of
        the batch per predicted one-row step (the curve's forward plus a draft-free step's host work)."""
        rate = self.plain.rate
        return rate if rate is not None else self.batch / (self.curve(1, context) + self.host_seconds(False))

    @property
    def gain(self) -> GainEstimate:
        """The drafted steps' gain over draft-free decoding at today's estimate of its rate (`plain_rate`)."""
        return self.steps.gain(self.plain_rate(self._context))

    def drafting_loses(self) -> bool:
        """Whether drafted steps have been slower than draft-free ones beyond noise: at least `MIN_EVIDENCE` of them
        and a mean gain below zero by more than `SKIP_CONFIDENCE` standard errors."""
        gain = self.gain
        if gain.count < MIN_EVIDENCE:
            return False
        spread = math.sqrt(max(gain.variance, GAIN_VARIANCE_FLOOR) / gain.count)
        return gain.mean + SKIP_CONFIDENCE * spread < 0

    def predicted_probe_loss(self, context: int) -> float:
        """Seconds a probe is expected to lose when drafting does not pay: `PROBE_STEPS` steps that each draft one
        node per row and verify two rows per row instead of one (what the budget waits for before the first probe)."""
        extra = self.draft_seconds(context) + self.target_seconds(2, context) - self.target_seconds(1, context)
        return PROBE_STEPS * max(extra, 0.0)

    def _probing(self, context: int) -> bool:
        if self._probe_left > 0:
            return True
        if self._since_draft + 1 < self.reprobe_every:
            return False
        loss = self.predicted_probe_loss(context) if self._probe_loss is None else self._probe_loss
        return self._free_seconds * PROBE_BUDGET >= loss

    def _controlling(self) -> bool:
        if self._control_left > 0:
            return True
        unmeasured = self.plain.steps < CONTROL_STEPS and self.steps.count >= MIN_EVIDENCE
        if unmeasured or self._since_free >= CONTROL_EVERY:
            self._control_left = CONTROL_STEPS + 1  # its first step is a transition
            return True
        return False

    def step_mode(self, context: int) -> str:
        """``"probe"`` within a probe (draft at least one node, to refresh the acceptance, drafter-cost and gain
        estimates); ``"skip"`` (no drafter at all) while `drafting_loses`; ``"control"`` (no drafter, drafting stays
        on) within a control (`CONTROL_STEPS`: the draft-free rate measured while drafting is on); else ``"size"``:
        the per-step cost rule decides from the first step, at every batch size (the curve prices the batch's own
        forwards; it may still draft nothing)."""
        self._context = context
        if self._probing(context):
            return "probe"
        if self._off:
            return "skip"
        if self._controlling():
            return "control"
        if self.drafting_loses():
            # judged against a measured draft-free rate: a control ran before the evidence sufficed to judge
            self._off = True
            return "skip"
        return "size"

    def observe_step(self, *, tree_scores: torch.Tensor, on_path: torch.Tensor, rows: int, context: int,
                     draft_seconds: float, draft_forwards: int, verify_seconds: float, tokens: int,
                     trees: int | None = None, other_seconds: float = 0.0, forward_seconds: float | None = None,
                     held_size: int | None = None, warm_up: bool = False) -> None:
        """One verified step: ``tree_scores``/``on_path`` of its draft nodes (root excluded), ``rows`` verified per
        tree (root included), measured draft / verify time, tokens committed. A step whose drafter ran counts as
        drafted even when the cost rule then kept no node: it paid for the drafter. A batch step is observed once,
        as a whole: every row's nodes concatenated, ``rows`` the packed tree width, ``trees`` the rows verified in
        the forward (the batch when None), ``draft_forwards`` the draft rounds (one forward per round, or one per
        row when the drafter does not batch rows), draft seconds and tokens summed over rows, so drafted and
        draft-free steps are compared at the batch's own throughput. ``other_seconds``: the step's host work after
        verification (commits, emission); ``forward_seconds``: the target forward alone, within ``verify_seconds``
        (the curve learns from it; the rest of ``verify_seconds`` and ``other_seconds`` are the step's host work);
        ``held_size``: the size the step held (`HeldSizes`), whose measured rate it updates. A step costs its whole
        wall time: every decision compares draft + verify + other seconds. ``warm_up``: the step's times hold one-time
        work of its generate call (the drafter's first forward over the whole prompt, a new shape's first run), so
        they bound its costs from above: they may lower an estimate, never raise it, and the step's rate is not
        counted (on the OpenVINO step the first drafted step of a process measured 18 ms a draft forward instead of
        5, and that one sample priced every later tree out)."""
        self._context = context
        probing = bool(draft_forwards) and self._probing(context)  # the mode this step ran in, before any update
        # a batch whose rows finished runs narrower, cheaper steps that commit fewer tokens: neither its curve nor
        # its rates (one draft-free step of a lone last row, priced as the batch's, made every drafted step of the
        # next call look like a gain)
        full = trees is None or trees == self.batch
        forward = verify_seconds if forward_seconds is None else forward_seconds
        if full and (verify_seconds > 0 or other_seconds > 0):
            # host work: the step's verification past the forward, its tail and, without a drafter, its sizing check
            check = 0.0 if draft_forwards else draft_seconds
            host = max(verify_seconds - forward, 0.0) + other_seconds + check
            # a drafted warm-up's host work holds the drafter's one-time work; a draft-free one's is the loop's own
            if not (warm_up and draft_forwards) or host < self.host_seconds(rows > 1):
                self._host[rows > 1].add(host)
        if full and (not warm_up or forward < self.target_seconds(rows, context)):
            self.curve.observe(rows, context, forward)
        if draft_forwards and full and (not warm_up or draft_seconds / draft_forwards < self.draft_seconds(context)):
            self._draft.add(draft_seconds / draft_forwards)
        rated = full and not warm_up  # a warm-up step's tokens per second are not its kind's
        if rows > 1:
            self.acceptance.observe(tree_scores, on_path)
        total = draft_seconds + verify_seconds + other_seconds
        if held_size is not None and rated and total > 0:
            self.held.observe(held_size, tokens, total)
        if not draft_forwards:
            self._since_draft += 1
            transition = self._control_left == CONTROL_STEPS + 1  # a control's first step: not the steady rate
            if total > 0:
                self._free_seconds += total
                if rated and not transition:
                    self.plain.add(tokens, total)
                    self._since_free = 0
                    if held_size is None:  # a control's or a switched-off step: the ladder's draft-free rung too
                        self.held.observe(0, tokens, total)
                self._control_left = max(self._control_left - 1, 0)
            return
        self._since_draft, self._free_seconds = 0, 0.0
        self._since_free += 1
        if total > 0 and rated:
            plain_rate = self.plain_rate(context)
            gain = tokens - plain_rate * total
            self.steps.add(tokens, total)
            self.drafted.add(tokens, total)
            if probing:
                lost = max(-gain / plain_rate, 0.0)
                self._probe_loss = lost if self._probe_left == 0 else (self._probe_loss or 0.0) + lost
        if probing:
            self._probe_left = (PROBE_STEPS if self._probe_left == 0 else self._probe_left) - 1
            if self._probe_left:
                return
            # the probe's verdict, on all the evidence at the measured rate: drafting that is on stays on unless it
            # loses beyond noise; drafting that was switched off comes back only on a gain (a probe's few lucky
            # steps lift a loser's mean within noise of zero, and a batch-4 call then drafted four calls at a loss)
            self._off = self.gain.mean <= 0 if self._off else self.drafting_loses()
        if self.gain.mean > 0:  # drafting pays on the evidence so far: probe soon again whenever it is switched off
            self.reprobe_every, self._probe_loss = self._base_reprobe, None
        elif probing:  # a probe that did not pay: wait twice as long for the next one
            self.reprobe_every = min(2 * self.reprobe_every, MAX_REPROBE_EVERY)


def forward_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights one forward of ``module`` reads: every parameter and buffer once, except embedding tables
    that no other layer shares (a lookup reads one row of them). On a memory-bound step this is what the forward
    costs, which prices a drafter against its target before either was timed."""
    if module is None or not isinstance(module, torch.nn.Module):
        return 0
    lookups = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    shared = {id(p) for m in module.modules() if not isinstance(m, torch.nn.Embedding)
              for p in m.parameters(recurse=False)}
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen or (id(tensor) in lookups and id(tensor) not in shared):
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def draft_cost_ratio(target: torch.nn.Module, drafter_model) -> float:
    """Prior seconds of one draft forward as a fraction of one target step: the drafter's `forward_bytes` over the
    target's, floored at 5% (a drafter with no weights, prompt lookup, still runs host code every round)."""
    target_bytes = max(forward_bytes(target), 1)
    return max(forward_bytes(drafter_model) / target_bytes, 0.05)


def _store(model: torch.nn.Module) -> dict:
    """What one target keeps across generate calls: its cost curves, and per drafter (weakly: a drafter that is
    deleted takes its speed models with it) the speed models of each setting."""
    store = model.__dict__.setdefault("_treespec_speed_models", {})
    store.setdefault("drafters", weakref.WeakKeyDictionary())
    return store


def forget_speed_models(model: torch.nn.Module) -> None:
    """Drops what ``model`` learnt about step costs and acceptance (its cost curves in memory and every drafter's
    speed model); the next auto-sized generate starts from the cached calibration again."""
    model.__dict__.pop("_treespec_speed_models", None)


def speed_model_for(model: torch.nn.Module, drafter, key: tuple = (), cache_dir: str | Path | None = None,
                    batch: int = 1, batched_drafting: bool = False, compiled=None,
                    draft_prior: float | None = None) -> SpeedModel:
    """The `SpeedModel` of target ``model`` for ``drafter`` (any weakly referenceable object: the assistant model)
    and ``key`` (sampling settings ...), kept on the target so it keeps learning across ``generate`` calls. The cost
    curve is per (dtype, device, threads, eager or compiled, batch size): a batch's ``[batch, n]`` forwards cost more
    than ``batch x n`` rows of one sequence (every sequence reads its own KV cache), so each batch size is calibrated
    on its own. ``draft_prior``: the drafter's cost per forward as a fraction of a target step before any was timed
    (default: `draft_cost_ratio`)."""
    store = _store(model)
    curve_key = ("curve", str(model.dtype), str(next(model.parameters()).device), torch.get_num_threads(),
                 None if compiled is None else compiled.settings, batch)
    if curve_key not in store:
        store[curve_key] = load_or_calibrate(model, cache_dir, compiled=compiled, batch=batch)
    per_drafter = store["drafters"].setdefault(drafter, {})
    full_key = (curve_key, *key)
    if full_key not in per_drafter:
        prior = draft_cost_ratio(model, drafter) if draft_prior is None else draft_prior
        per_drafter[full_key] = SpeedModel(store[curve_key], batch=batch, batched_drafting=batched_drafting,
                                           draft_prior=prior)
    return per_drafter[full_key]
