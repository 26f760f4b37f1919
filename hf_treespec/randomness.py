"""Where sampled policies and verifiers get their randomness: a ``torch.Generator`` (or None), or a `RandomSource`.

Every random choice they make is one of four kinds: a vector of Bernoulli trials, one categorical draw, a vector of
multinomial counts, or an ordered sample without replacement. Routing each through the helpers below lets another
source decide the choice itself. `enumerate_outcomes` uses that to list every outcome of a drafting or verification
step with its exact probability, which is how the losslessness tests integrate out all randomness instead of
estimating it (practical for toy vocabularies and small trees only: the number of branches grows exponentially).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Callable, Hashable, Protocol, Union, runtime_checkable

import torch


@runtime_checkable
class RandomSource(Protocol):
    """Makes the random choices itself (instead of a ``torch.Generator``)."""

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        """Independent trials, one per entry of ``probs``: a bool tensor of the same shape."""

    def categorical(self, probs: torch.Tensor) -> int:
        """One draw from the (not necessarily normalised) 1-D weights ``probs``."""

    def multinomial(self, probs: torch.Tensor, num: int) -> torch.Tensor:
        """``[V]`` counts of ``num`` i.i.d. draws from the 1-D weights ``probs``."""

    def without_replacement(self, probs: torch.Tensor, num: int) -> torch.Tensor:
        """``min(num, support)`` distinct tokens in sampling order, each drawn from ``probs`` minus earlier ones."""


Randomness = Union[torch.Generator, RandomSource, None]


def _is_source(generator: Randomness) -> bool:
    return generator is not None and not isinstance(generator, torch.Generator)


def bernoulli(probs: torch.Tensor, generator: Randomness = None) -> torch.Tensor:
    """``True`` with probability ``probs`` (entry-wise, clamped to [0, 1])."""
    if _is_source(generator):
        return generator.bernoulli(probs)
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    return uniform < probs


def categorical(probs: torch.Tensor, generator: Randomness = None) -> int:
    """One draw from the 1-D weights ``probs``."""
    if _is_source(generator):
        return generator.categorical(probs)
    return int(categorical_rows(probs[None], generator)[0])


def categorical_rows(probs: torch.Tensor, generator: Randomness = None) -> torch.Tensor:
    """One draw per row of the weights ``probs`` ``[R, V]`` (not necessarily normalised): ``[R]`` indices, each the
    inverse of its row's cumulative weights (float64) at a uniform draw. The law of ``torch.multinomial(probs, 1)``,
    which draws one exponential per vocabulary entry instead: over SmolLM2's 49152 tokens on a 2-core EPYC, 1.05 ms
    for one row and 4.16 ms for four, against 0.09 and 0.14 ms here (docs/results/compiled/batch-drafting/draws.txt).
    A zero weight is never drawn (its cumulative sum equals its predecessor's)."""
    if _is_source(generator):
        return torch.tensor([generator.categorical(row) for row in probs], dtype=torch.long, device=probs.device)
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:].contiguous()
    uniform = cdf.new_empty(total.shape).uniform_(generator=generator)  # on the rows' device, no copy
    index = torch.searchsorted(cdf, uniform * total, right=True)
    # the draw is below the total, but rounding may land on it: the row's last positive weight then (the first
    # entry whose cumulative sum reaches the total: zeros after it add nothing)
    last = torch.searchsorted(cdf, total)
    return torch.minimum(index, last)[..., 0]


def multinomial_counts(probs: torch.Tensor, num: torch.Tensor, generator: Randomness = None) -> torch.Tensor:
    """``[F, V]`` counts: row i holds ``num[i]`` i.i.d. draws from ``probs[i]`` (one batched draw for all rows)."""
    num = num.long()
    if _is_source(generator):
        return torch.stack([generator.multinomial(row, int(n)) for row, n in zip(probs, num.tolist())]).to(probs.device)
    most = int(num.max()) if num.numel() else 0
    counts = probs.new_zeros(probs.shape, dtype=torch.long)
    if most == 0:
        return counts
    num = num.to(probs.device)
    # a row drawing nothing may hold no distribution (all zeros): it draws from a stand-in, masked out below
    probs = torch.where((num > 0)[:, None], probs, torch.ones((), dtype=probs.dtype, device=probs.device))
    draws = torch.multinomial(probs, most, replacement=True, generator=generator)
    valid = torch.arange(most, device=probs.device)[None] < num[:, None]
    return counts.scatter_add_(1, draws, valid.long())


def without_replacement(
    probs: torch.Tensor, num: int, generator: Randomness = None, support: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential sampling without replacement, ``num`` per row of ``probs`` ``[F, V]``, by Gumbel-top-k.

    ``support``: sorted columns outside which every row is zero (None: every column; the caller finds them once with
    `support_columns`, for the draws and the verification): the keys are drawn for those columns only, the others'
    being -inf anyway. Returns ``tokens`` ``[F, num]`` in sampling
    order and ``valid`` ``[F, num]`` (False past a row's support)."""
    num = min(num, probs.shape[-1])
    if _is_source(generator):
        tokens = torch.zeros(probs.shape[0], num, dtype=torch.long, device=probs.device)
        valid = torch.zeros(probs.shape[0], num, dtype=torch.bool, device=probs.device)
        for i, row in enumerate(probs):
            drawn = generator.without_replacement(row, num)
            tokens[i, : drawn.numel()] = drawn
            valid[i, : drawn.numel()] = True
        return tokens, valid
    if support is not None:  # the keys of the columns some row can draw; the others' are -inf anyway
        tokens, valid = _gumbel_top(probs.index_select(1, support), num, generator)
        missing = num - tokens.shape[-1]  # past every row's support: still ``num`` columns, marked invalid
        return (torch.nn.functional.pad(support[tokens], (0, missing)),
                torch.nn.functional.pad(valid, (0, missing), value=False))
    return _gumbel_top(probs, num, generator)


def support_columns(probs: torch.Tensor, within: torch.Tensor | None = None) -> torch.Tensor | None:
    """The sorted columns where some row of the CPU weights ``probs`` ``[R, V]`` is positive, searched among the
    sorted columns ``within`` (a superset of them, e.g. a reduced draft vocabulary) or the whole row: a drafter with a
    reduced vocabulary scores 8192 of SmolLM2's 49152 tokens, and top-k leaves 50 of them, so the vocabulary-wide
    passes of a draw and of its verification are most of their cost on a CPU. ``within`` (None: every column) when
    every column searched is positive, and on a device, whose ``nonzero`` would wait for it."""
    if probs.device.type != "cpu" or probs.shape[0] == 0:
        return within
    searched = probs if within is None else probs.index_select(-1, within)
    used = (searched > 0).any(0) if probs.shape[0] > 1 else searched[0] > 0
    if int(used.count_nonzero()) == used.numel():
        return within
    found = used.nonzero().squeeze(-1)
    return found if within is None else within[found]


def _gumbel_top(probs: torch.Tensor, num: int, generator: Randomness) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-top-k over the columns of ``probs``: ``(tokens, valid)`` as `without_replacement` returns them."""
    num = min(num, probs.shape[-1])
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float32)
    # the Gumbel keys log p - log(-log u), ranked as p / (-log u) (one log per entry instead of three: 0.06 ms
    # against 0.10 for 8192 columns, 2-core EPYC); the same uniforms, so the same order
    races = uniform.clamp_(min=1e-20).log_().neg_()
    keys = torch.div(probs.float(), races, out=races)
    _, tokens = keys.topk(num, dim=-1)
    return tokens, probs.gather(-1, tokens) > 0


# ------------------------------------------------------------------------------------------------- exact enumeration
class _Replay:
    """A `RandomSource` that follows a script of option indices (0 past its end) and logs every choice it made."""

    def __init__(self, script: list[int]):
        self.script = script
        self.taken: list[int] = []
        self.widths: list[int] = []
        self.prob = 1.0

    def _choose(self, options: list[tuple[object, float]]):
        pos = len(self.taken)
        index = self.script[pos] if pos < len(self.script) else 0
        self.taken.append(index)
        self.widths.append(len(options))
        value, prob = options[index]
        self.prob *= prob
        return value

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        flat = probs.detach().double().flatten().clamp(0, 1).tolist()
        open_ = [i for i, v in enumerate(flat) if 0 < v < 1]
        options = []
        for bits in itertools.product((True, False), repeat=len(open_)):
            out = [v >= 1 for v in flat]
            prob = 1.0
            for i, bit in zip(open_, bits):
                out[i] = bit
                prob *= flat[i] if bit else 1 - flat[i]
            options.append((out, prob))
        chosen = self._choose(options)
        return torch.tensor(chosen, dtype=torch.bool, device=probs.device).reshape(probs.shape)

    def categorical(self, probs: torch.Tensor) -> int:
        weights = probs.detach().double()
        total = float(weights.sum())
        return self._choose([(i, float(weights[i]) / total) for i in weights.nonzero().flatten().tolist()])

    def multinomial(self, probs: torch.Tensor, num: int) -> torch.Tensor:
        weights = probs.detach().double()
        weights = weights / weights.sum()
        support = weights.nonzero().flatten().tolist()
        options = []
        for split in _compositions(num, len(support)):
            counts = torch.zeros(probs.shape[-1], dtype=torch.long)
            prob = float(math.factorial(num))
            for token, c in zip(support, split):
                counts[token] = c
                prob *= float(weights[token]) ** c / math.factorial(c)
            options.append((counts, prob))
        return self._choose(options)

    def without_replacement(self, probs: torch.Tensor, num: int) -> torch.Tensor:
        weights = probs.detach().double().clone()
        drawn = []
        for _ in range(min(num, int((weights > 0).sum()))):
            token = self.categorical(weights)
            drawn.append(token)
            weights[token] = 0
        return torch.tensor(drawn, dtype=torch.long)


def _compositions(total: int, parts: int):
    """Every way to write ``total`` as an ordered sum of ``parts`` non-negative integers."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def enumerate_outcomes(run: Callable[[RandomSource], Hashable], max_runs: int = 1_000_000) -> dict[Hashable, float]:
    """Exact distribution of ``run(source)`` over every sequence of random choices it can make.

    ``run`` must be deterministic given its choices and take all randomness from ``source`` (pass it as the
    ``generator`` of sampled policies and verifiers). Each leaf of the choice tree is run exactly once, so the cost is
    the number of distinct choice sequences; ``max_runs`` guards against accidental explosions.
    """
    results: dict[Hashable, float] = defaultdict(float)
    stack: list[list[int]] = [[]]
    runs = 0
    while stack:
        script = stack.pop()
        source = _Replay(script)
        outcome = run(source)
        results[outcome] += source.prob
        runs += 1
        if runs > max_runs:
            raise RuntimeError(f"enumerate_outcomes: more than {max_runs} choice sequences; use a smaller problem")
        for pos in range(len(script), len(source.taken)):
            for alt in range(1, source.widths[pos]):
                stack.append(source.taken[:pos] + [alt])
    return dict(results)
