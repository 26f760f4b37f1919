"""Measured costs and acceptance: what ``tree_budget="auto"`` sizes every tree by.

- `CostCurve`: seconds of one target verification with ``n`` rows (root included) over ``context`` cached tokens,
  measured once per (model, dtype, device, threads) by `calibrate_target` (a few seconds), cached as JSON under
  ``$HF_TREESPEC_CACHE/latency/`` and refined online from the real steps (EMA).
- `AcceptanceTable`: draft score (log of the path's draft probability) -> probability that the target accepts the
  node, binned on a log2 scale, learned online from the verified trees (EMA of hits, isotonic across bins).
- `SpeedModel`: both, plus the drafter's cost per forward and the realised speed of drafted vs. draft-free steps, so
  the loop can stop drafting where no tree pays (with periodic re-probing).

Nothing here is global: a `SpeedModel` lives on the model instance that uses it (see `speed_model_for`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

#: rows of one calibration forward (root included) and cached-context lengths measured
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)
CALIBRATION_CONTEXTS = (128, 512)
#: timed forwards per point when a curve is measured at first use (the fastest is kept)
FIRST_USE_REPEATS = 3
#: EMA weight of one online observation
COST_RATE = 0.1
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
#: weight kept per new observation by the drafted / draft-free step statistics (a window of ~20 steps of each kind)
STEP_DECAY = 0.95
#: the drafter is switched off once the mean gain of at least MIN_EVIDENCE drafted steps (decayed count) is below
#: zero by SKIP_CONFIDENCE standard errors, one step's gain variance taken as at least GAIN_VARIANCE_FLOOR (tokens^2).
#: A paying drafter's steps commit 1, 2, 3 ... tokens (variance ~1), so an unlucky start does not switch it off; a
#: losing one commits ~1 token a step and only timing noise varies, so a loss of 0.1 token per step is still caught
MIN_EVIDENCE = 8
SKIP_CONFIDENCE = 2.0
GAIN_VARIANCE_FLOOR = 0.05
#: log draft probability of a node's best child before any tree was seen (learned per drafter from its trees)
CHILD_LOGPROB_PRIOR = math.log(0.5)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear interpolation, linear extrapolation past both ends (costs keep growing past the grid)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interp_tensor(x: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """`_interp` over a tensor of points."""
    if xs.numel() == 1:
        return ys.expand_as(x).clone()
    i = torch.searchsorted(xs, x).clamp(1, xs.numel() - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostCurve:
    """``seconds[j][i]``: one target forward with ``sizes[i]`` rows over ``contexts[j]`` cached tokens."""

    sizes: list[int]
    contexts: list[int]
    seconds: list[list[float]]
    key: dict = field(default_factory=dict)  # what it was measured for (model, dtype, device, threads)

    def __post_init__(self) -> None:
        if not self.sizes or len(self.seconds) != len(self.contexts) or any(
            len(row) != len(self.sizes) for row in self.seconds
        ):
            raise ValueError("CostCurve: seconds must be [len(contexts)][len(sizes)] with at least one size.")

    def __call__(self, rows: int, context: int) -> float:
        """Predicted seconds; never below the one-row cost's floor of 0 and nondecreasing in ``rows``."""
        per_context = [max(_interp(rows, self.sizes, row), 1e-9) for row in self.seconds]
        if len(self.contexts) == 1:
            return per_context[0]
        return max(_interp(context, self.contexts, per_context), 1e-9)

    def costs(self, max_rows: int, context: int) -> torch.Tensor:
        """``[max_rows]`` predicted seconds for 1..max_rows rows (one vectorised call per decoding step)."""
        rows = torch.arange(1, max_rows + 1, dtype=torch.float64)
        sizes = torch.tensor(self.sizes, dtype=torch.float64)
        per_context = [_interp_tensor(rows, sizes, torch.tensor(r, dtype=torch.float64)) for r in self.seconds]
        if len(self.contexts) == 1:
            out = per_context[0]
        else:
            contexts = [float(c) for c in self.contexts]
            i = 1
            while i < len(contexts) - 1 and context > contexts[i]:
                i += 1
            w = (context - contexts[i - 1]) / (contexts[i] - contexts[i - 1])
            out = per_context[i - 1] + w * (per_context[i] - per_context[i - 1])
        return out.clamp(min=1e-9).cummax(0).values

    def observe(self, rows: int, context: int, seconds: float, rate: float = COST_RATE) -> None:
        """Moves the grid points around (rows, context) towards a measured step, weighted by closeness, then keeps the
        curve nondecreasing in ``rows``."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        ratio = seconds / self(rows, context)
        j = min(range(len(self.contexts)), key=lambda c: abs(self.contexts[c] - context))
        hi = next((i for i, s in enumerate(self.sizes) if s >= rows), len(self.sizes) - 1)
        lo = max(hi - 1, 0) if self.sizes[hi] != rows else hi
        span = max(self.sizes[hi] - self.sizes[lo], 1)
        weights = {hi: 1.0} if lo == hi else {lo: (self.sizes[hi] - rows) / span, hi: (rows - self.sizes[lo]) / span}
        row = self.seconds[j]
        for i, w in weights.items():
            row[i] *= 1 + rate * max(w, 0.0) * (ratio - 1)
        for i in range(1, len(row)):
            row[i] = max(row[i], row[i - 1])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        return cls(list(data["sizes"]), list(data["contexts"]), [list(r) for r in data["seconds"]], data.get("key", {}))

    def table(self) -> str:
        """Markdown table: ms per forward, one column per row count, one row per context length."""
        head = "| context \\ rows | " + " | ".join(str(s) for s in self.sizes) + " |"
        sep = "|---|" + "---:|" * len(self.sizes)
        body = [f"| {c} | " + " | ".join(f"{1000 * s:.1f}" for s in row) + " |"
                for c, row in zip(self.contexts, self.seconds)]
        return "\n".join([head, sep, *body])


def model_key(model: torch.nn.Module, threads: int | None = None) -> dict:
    """What a calibration is valid for: model identity (name + config hash), dtype, device/hardware, threads."""
    from .hardware import detect

    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if config is not None else type(model).__name__
    param = next(model.parameters())
    return {
        "model": getattr(model, "name_or_path", "") or type(model).__name__,
        "config_sha": hashlib.sha256(text.encode()).hexdigest()[:16],
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "hardware": detect(param.device).name,
        "threads": int(threads if threads is not None else torch.get_num_threads()),
    }


def cache_path(key: dict, cache_dir: str | Path | None = None) -> Path:
    from .assets import default_cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir or default_cache_dir()) / "latency" / f"{digest}.json"


def _float_causal_mask(past: int, rows: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The 4D float mask a tree forward uses (0 / finfo.min), here for a chain: same kernel path as verification."""
    allowed = torch.ones(rows, past + rows, dtype=torch.bool, device=device).tril(past)
    mask = torch.zeros(rows, past + rows, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


@torch.no_grad()
def calibrate_target(
    model: torch.nn.Module,
    sizes: tuple[int, ...] = CALIBRATION_SIZES,
    contexts: tuple[int, ...] = CALIBRATION_CONTEXTS,
    repeats: int = 1,
) -> CostCurve:
    """Times one target forward per (rows, context) exactly as a tree verification runs (4D float mask, explicit
    positions, a DynamicCache of ``context`` tokens), keeping the fastest of ``repeats``. One untimed forward per
    context warms up. At first use `load_or_calibrate` keeps the fastest of `FIRST_USE_REPEATS` per point (42 timed
    forwards, ~8 s for SmolLM2-135M on 2 CPU cores): the cost rule sizes trees by the curve's differences between
    neighbouring row counts, which single measurements on a noisy machine get wrong (a 4-row forward measured slower
    than an 8-row one); the online refinement from real steps corrects what remains."""
    from transformers import DynamicCache

    from .compat import CACHE_KWARG
    from .window import prepare

    device, dtype = next(model.parameters()).device, model.dtype
    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for context in contexts:
        cache = DynamicCache(config=model.config)
        prepare(model, cache)  # sliding layers full-length, as the tree loop runs them (the window costs no time here)
        prefix = torch.randint(0, vocab, (1, context), generator=gen).to(device)
        model(input_ids=prefix, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
        row = []
        for rows in sizes:
            ids = torch.randint(0, vocab, (1, rows), generator=gen).to(device)
            positions = torch.arange(context, context + rows, device=device)[None]
            mask = _float_causal_mask(context, rows, dtype, device)
            best = float("inf")
            warm_up = rows == sizes[0]
            for attempt in range(repeats + warm_up):
                _sync(device)
                t0 = time.perf_counter()
                model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                      **{CACHE_KWARG: cache})
                _sync(device)
                if attempt or not warm_up:
                    best = min(best, time.perf_counter() - t0)
                cache.crop(-rows)  # drop the rows just added (transformers 5.23: a negative count)
            row.append(best)
        seconds.append(row)
    return CostCurve(list(sizes), list(contexts), seconds, model_key(model))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_or_calibrate(model: torch.nn.Module, cache_dir: str | Path | None = None, **kwargs) -> CostCurve:
    """The cached curve for this (model, dtype, device, threads), measuring and caching it at first use."""
    key = model_key(model)
    path = cache_path(key, cache_dir)
    if path.exists():
        try:
            curve = CostCurve.from_json(json.loads(path.read_text()))
            if curve.key == key:
                return curve
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or stale: measure again and overwrite
    kwargs.setdefault("repeats", FIRST_USE_REPEATS)
    curve = calibrate_target(model, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve.to_json(), indent=1))
    return curve


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
        self._rates = self._fit()

    def _fit(self) -> torch.Tensor:
        raw = (self.hits + self.prior_weight * self.prior) / (self.counts + self.prior_weight)
        return _isotonic(raw, self.counts + self.prior_weight).float()

    def bin_of(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(scores.detach().float().cpu(), self.edges)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """Acceptance probabilities ``[n]`` for draft log-scores ``[n]`` (on the CPU)."""
        return self._rates[self.bin_of(scores)]

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


@dataclass
class DecayedStats:
    """Decayed count, sum and sum of squares of one per-step quantity: recent steps weigh most."""

    decay: float = STEP_DECAY
    count: float = 0.0
    total: float = 0.0
    squares: float = 0.0

    def add(self, x: float) -> None:
        self.count = self.decay * self.count + 1.0
        self.total = self.decay * self.total + x
        self.squares = self.decay * self.squares + x * x

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def variance(self) -> float:
        return max(self.squares / self.count - self.mean**2, 0.0) if self.count else 0.0


@dataclass
class RateWindow:
    """Tokens per second over recent steps of one kind, as a ratio of decayed sums (a mean of per-step rates would
    be skewed by single lucky or slow steps)."""

    decay: float = STEP_DECAY
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds

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

    ``draft_seconds`` starts at ``draft_prior`` (a fraction of a one-row target step) and follows the measured
    drafting time per forward. Every step that ran the drafter also records its *gain*: tokens committed minus what
    draft-free steps commit in the same time (their measured rate, or the cost curve's one-row step before any). The
    drafter is switched off ("skip") only once the mean gain is below zero by `SKIP_CONFIDENCE` standard errors over
    enough drafted steps, so a single unlucky step never switches it off; then every ``reprobe_every`` draft-free
    steps a probe of `PROBE_STEPS` drafted steps adds fresh evidence; the interval doubles after every probe that leaves
    the mean gain below zero and returns to ``reprobe_every`` once it is above, and it never ends before the
    draft-free time since the last probe is 1 / `PROBE_BUDGET` times what that probe lost (before any probe: what
    one is predicted to lose, so at a large batch, where a probe drafts every row, probes stay rare from the start).
    """

    def __init__(self, curve: CostCurve, acceptance: AcceptanceTable | None = None, draft_prior: float = 0.3,
                 reprobe_every: int = REPROBE_EVERY, batch: int = 1):
        self.curve = curve
        #: rows decoded together: a step verifies ``batch`` trees in one forward and drafts them one after another,
        #: so it is priced at ``batch x nodes`` target rows and ``batch`` draft forwards per expansion
        self.batch = batch
        self.acceptance = acceptance if acceptance is not None else AcceptanceTable()
        self._draft = EMA()
        self._draft_prior = draft_prior
        self._child = EMA()
        self.drafted = RateWindow()  # steps that ran the drafter (for inspection; the decision reads `gain`)
        self.plain = RateWindow()  # draft-free steps
        self.gain = DecayedStats()
        self.reprobe_every = reprobe_every
        self._base_reprobe = reprobe_every
        self._since_draft = 0
        self._probe_left = 0
        self._probe_loss: float | None = None  # seconds the last probe lost against draft-free steps
        self._free_seconds = 0.0  # draft-free seconds since the last drafted step
        self.depth_acceptance = DepthAcceptance()
        #: (k, l) a sampled policy chose for the step being verified (set by the policy, read by observe_step)
        self.pending_shape: tuple[int, int] | None = None

    def target_seconds(self, rows: int, context: int) -> float:
        """Predicted seconds of a step verifying ``rows`` rows (root included) in each of the batch's trees."""
        return self.curve(rows * self.batch, context)

    def step_costs(self, max_rows: int, context: int) -> torch.Tensor:
        """``[max_rows]`` predicted seconds of a step verifying 1..max_rows rows per tree, the batch's total rows
        priced on the cost curve (a ``[B, n]`` forward read as ``B x n`` rows of one sequence: equal matmul work)."""
        return self.curve.costs(max_rows * self.batch, context)[self.batch - 1 :: self.batch]

    def draft_seconds(self, context: int) -> float:
        """Seconds per draft expansion of the whole batch (measured mean per forward, or the prior before any)."""
        if self._draft.value is not None:
            return self._draft.value * self.batch
        return self._draft_prior * self.curve(1, context) * self.batch

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
        """Tokens per second of a draft-free step: measured, or one per row of the batch per predicted forward of
        ``batch`` rows before any."""
        rate = self.plain.rate
        return rate if rate is not None else self.batch / self.curve(self.batch, context)

    def drafting_loses(self) -> bool:
        """Whether drafted steps have been slower than draft-free ones beyond noise: at least `MIN_EVIDENCE` of them
        and a mean gain below zero by more than `SKIP_CONFIDENCE` standard errors."""
        if self.gain.count < MIN_EVIDENCE:
            return False
        spread = math.sqrt(max(self.gain.variance, GAIN_VARIANCE_FLOOR) / self.gain.count)
        return self.gain.mean + SKIP_CONFIDENCE * spread < 0

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

    def step_mode(self, context: int) -> str:
        """``"probe"`` within a probe (draft at least one node, to refresh the acceptance, drafter-cost and gain
        estimates); ``"skip"`` (no drafter at all) while `drafting_loses`; else ``"size"``: the per-step cost rule
        decides (it may still draft nothing)."""
        if self._probing(context):
            return "probe"
        return "skip" if self.drafting_loses() else "size"

    def observe_step(self, *, tree_scores: torch.Tensor, on_path: torch.Tensor, rows: int, context: int,
                     draft_seconds: float, draft_forwards: int, verify_seconds: float, tokens: int,
                     trees: int | None = None) -> None:
        """One verified step: ``tree_scores``/``on_path`` of its draft nodes (root excluded), ``rows`` verified per
        tree (root included), measured draft / verify time, tokens committed. A step whose drafter ran counts as
        drafted even when the cost rule then kept no node: it paid for the drafter. A batch step is observed once,
        as a whole: every row's nodes concatenated, ``rows`` the packed tree width, ``trees`` the rows verified in
        the forward (the batch when None), draft forwards / seconds and tokens summed over rows, so drafted and
        draft-free steps are compared at the batch's own throughput."""
        probing = bool(draft_forwards) and self._probing(context)  # the mode this step ran in, before any update
        self.curve.observe(rows * (self.batch if trees is None else trees), context, verify_seconds)
        if draft_forwards:
            self._draft.add(draft_seconds / draft_forwards)
        if self.pending_shape is not None:
            k, depth = self.pending_shape
            self.depth_acceptance.observe(k, depth, tokens - 1)
            self.pending_shape = None
        if rows > 1:
            self.acceptance.observe(tree_scores, on_path)
        total = draft_seconds + verify_seconds
        if not draft_forwards:
            self._since_draft += 1
            if total > 0:
                self.plain.add(tokens, total)
                self._free_seconds += total
            return
        self._since_draft, self._free_seconds = 0, 0.0
        if total > 0:
            plain_rate = self.plain_rate(context)
            gain = tokens - plain_rate * total
            self.gain.add(gain)
            self.drafted.add(tokens, total)
            if probing:
                lost = max(-gain / plain_rate, 0.0)
                self._probe_loss = lost if self._probe_left == 0 else (self._probe_loss or 0.0) + lost
        if probing:
            self._probe_left = (PROBE_STEPS if self._probe_left == 0 else self._probe_left) - 1
            if self._probe_left:
                return
        if self.gain.mean > 0:  # drafting pays on the evidence so far: probe soon again whenever it is switched off
            self.reprobe_every, self._probe_loss = self._base_reprobe, None
        elif probing:  # a probe that did not pay: wait twice as long for the next one
            self.reprobe_every = min(2 * self.reprobe_every, MAX_REPROBE_EVERY)


def speed_model_for(model: torch.nn.Module, key: tuple, cache_dir: str | Path | None = None,
                    batch: int = 1) -> SpeedModel:
    """The `SpeedModel` of ``model`` for ``key`` (drafter, sampling settings ...), kept on the model instance so it
    keeps learning across ``generate`` calls; the cost curve is shared per (dtype, device, threads)."""
    store = model.__dict__.setdefault("_treespec_speed_models", {})
    curve_key = ("curve", str(model.dtype), str(next(model.parameters()).device), torch.get_num_threads())
    if curve_key not in store:
        store[curve_key] = load_or_calibrate(model, cache_dir)
    full_key = (curve_key, *key, batch)
    if full_key not in store:
        store[full_key] = SpeedModel(store[curve_key], batch=batch)
    return store[full_key]
