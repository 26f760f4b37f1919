"""Held sizes: ``tree_budget="auto"`` between priced steps. After its first priced steps (`TreeSizer`: the cost rule
on every expansion) the sizing holds one tree size for several steps and picks that size from measured throughput:
`SizeLadder` keeps each size's tokens per second over its recent steps, exploits the best, and now and then tries a
neighbour (half or double). Size 0 is a rung too: a draft-free step, so where no tree pays (sampling with a drafter
that accepts little) the measured rates switch drafting off as they choose between sizes. `HeldSize` grows the held
size as a fixed budget grows.

Why: pricing every expansion is ~1 ms of Python a step (3% of a 35 ms compiled step), and its per-step choices lost
to a fixed tree of the size it chose on average (0.92x of the best fixed size in a committed run), because what the
cost model misses (how a policy's nodes accept at each size, the host work of wide trees) the measured rate includes.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..budget import AUTO_MAX_CHILDREN
from ..tree import DraftTree, top_by_score

#: a held step expands again while the nodes it would expand hold at least this much draft probability (SALF's
#: default threshold, the rule its fixed budgets grow by)
HELD_EXPAND_MASS = 0.6


@dataclass
class HeldSize:
    """The `StepBudget` of a held step (`SizeLadder`'s size), grown as a fixed budget grows, without pricing each
    expansion: it expands again while the nodes to expand hold `HELD_EXPAND_MASS` of draft probability, and keeps
    its best ``max_nodes`` nodes.

    Attributes:
        max_nodes: draft nodes the tree keeps (its best by draft score).
        shape: the ``(k, l)`` of a sampled policy's tree (None: a step without drafts).
    """

    max_nodes: int
    shape: tuple[int, int] | None = None
    max_children: int = AUTO_MAX_CHILDREN
    expansions: int = 0

    def in_best_prefix(self, tree: DraftTree, nodes: torch.Tensor, members: torch.Tensor | None = None
                       ) -> torch.Tensor:
        return torch.ones(nodes.numel(), dtype=torch.bool)

    def expand_again(self, tree: DraftTree, expand: torch.Tensor, members: torch.Tensor | None = None) -> bool:
        if self.expansions >= self.max_nodes:
            return False
        if self.expansions and float(tree.scores[expand].exp().sum()) < HELD_EXPAND_MASS:
            return False
        self.expansions += 1
        return True

    def prune(self, tree: DraftTree) -> DraftTree:
        return top_by_score(tree, self.max_nodes)

    def choose_shape(self, nodes_of, max_k: int, max_l: int) -> tuple[int, int] | None:
        if self.shape is None:
            return None
        return min(self.shape[0], max_k), min(self.shape[1], max_l)


#: the tree sizes (draft nodes) the ladder holds; 0: a draft-free step. Without that rung, drafting was switched off
#: only by a test of the drafted steps' mean gain (`SpeedModel.drafting_loses`), which a loss of ~10% a step rarely
#: passes when drafted steps commit 1-3 tokens: at T=1 the default budget drafted on half its steps and ran at 0.89x
#: plain decoding through the same compiled step (docs/results/compiled/rows-attention)
LADDER = (0, 1, 2, 4, 8, 16, 32)
#: one held step in this many tries a neighbour of the best size (alternately half and double)
EXPLORE_EVERY = 8
#: weight kept per observation of a size's rate (a window of ~30 of its steps)
LADDER_DECAY = 0.97
#: a neighbour measured below this fraction of the best size's rate is tried only every RARE_EXPLORE-th time its
#: turn comes, and that step then counts RARE_EXPLORE times (it stands for the turns let pass), so its rate follows
#: as fast as a neighbour's tried every turn: on the OpenVINO step at batch 1, 8-node steps ran at 0.65x the 4-node
#: ones and trying them one step in 16 cost about 3% of the run
CLEARLY_WORSE = 0.85
RARE_EXPLORE = 4


@dataclass
class SizeLadder:
    """The held size, chosen by measured tokens per second among `LADDER` sizes (each step's whole wall time).

    Attributes:
        best: the size exploited (starts at the ladder size nearest what the priced steps chose).
        tokens / seconds: decayed sums per size of the steps that held it.
    """

    best: int
    tokens: dict[int, float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    steps: int = 0
    _down: bool = True
    _turns: dict[int, int] = field(default_factory=dict)  # explore turns a clearly worse size let pass, per size
    _weight: dict[int, int] = field(default_factory=dict)  # how many observations a size's next step counts as

    @classmethod
    def near(cls, nodes: float) -> "SizeLadder":
        """A ladder starting at the tree size nearest ``nodes`` (in ratio)."""
        return cls(min(LADDER[1:], key=lambda size: abs(math.log(size / max(nodes, 0.5)))))

    def best_tree(self) -> int:
        """The size of the highest measured rate that drafts (the best, unless that is draft-free)."""
        return self._fastest(LADDER[1:]) or LADDER[1]

    def _fastest(self, sizes: tuple[int, ...]) -> int | None:
        """The size of ``sizes`` with the highest measured rate (None: none measured)."""
        rated = {size: rate for size in sizes if (rate := self.rate(size)) is not None}
        return max(rated, key=rated.get) if rated else None

    def rate(self, size: int) -> float | None:
        seconds = self.seconds.get(size, 0.0)
        return self.tokens[size] / seconds if seconds > 0 else None

    def next(self) -> int:
        """The size the next held step grows: the best, or every `EXPLORE_EVERY` steps a neighbour of it
        (`_neighbour`; one measured `CLEARLY_WORSE` than the best only every `RARE_EXPLORE`-th time its turn
        comes)."""
        self.steps += 1
        if self.steps % EXPLORE_EVERY:
            return self.best
        self._down = not self._down
        size = self._neighbour()
        if self._clearly_worse(size):
            self._turns[size] = self._turns.get(size, 0) + 1
            if self._turns[size] % RARE_EXPLORE:
                return self.best
            self._weight[size] = RARE_EXPLORE
        return size

    def _neighbour(self) -> int:
        """Half or double the best size (alternately); from size 0 (draft-free), the best tree size measured or
        double it, so a tree size that pays is still found when the smallest ones do not (from 0, trying only one
        node kept the ladder there on greedy prompts where 4 nodes ran 1.12x faster)."""
        if self.best == 0:
            tree = self.best_tree()
            i = LADDER.index(tree)
            return tree if self._down or i == len(LADDER) - 1 else LADDER[i + 1]
        i = LADDER.index(self.best)
        return LADDER[i - 1 if (self._down and i > 0) or i == len(LADDER) - 1 else i + 1]

    def _clearly_worse(self, size: int) -> bool:
        rate, best = self.rate(size), self.rate(self.best)
        return rate is not None and best is not None and rate < CLEARLY_WORSE * best

    def observe(self, size: int, tokens: int, seconds: float) -> None:
        """A held step of ``size`` committed ``tokens`` in ``seconds``; the best size is the one of highest rate."""
        if size not in LADDER or seconds <= 0:
            return
        weight = self._weight.pop(size, 1)  # as ``weight`` observations of the same step
        decay = LADDER_DECAY**weight
        self.tokens[size] = decay * self.tokens.get(size, 0.0) + weight * tokens
        self.seconds[size] = decay * self.seconds.get(size, 0.0) + weight * seconds
        self.best = self._fastest(LADDER)


#: drafting steps priced by the cost rule before the ladder takes over (probes too are priced until then)
PRICED_START = 8


@dataclass
class HeldSizes:
    """What the held steps of one speed model grow (kept across generate calls with it): the sizes and shapes its
    first `PRICED_START` priced steps chose, then the `SizeLadder` started from their median."""

    priced: list[int] = field(default_factory=list)
    shapes: Counter = field(default_factory=Counter)
    ladder: SizeLadder | None = None

    def record_priced(self, sizes: list[int], shape: tuple[int, int] | None) -> None:
        """A priced step that drafted kept ``sizes`` nodes per row (and chose ``shape``, sampled policies)."""
        self.priced.extend(sizes)
        self.shapes[shape] += 1
        if self.ladder is None and sum(self.shapes.values()) >= PRICED_START:
            self.ladder = SizeLadder.near(statistics.median(self.priced))

    def next(self, draft: bool = False) -> HeldSize | None:
        """The next held step's budget (``max_nodes`` 0: a draft-free step, unless ``draft``: a probe must draft),
        or None while the ladder has not started (the step is priced)."""
        if self.ladder is None:
            return None
        size = self.ladder.next()
        return HeldSize(size or (self.ladder.best_tree() if draft else 0), self.shapes.most_common(1)[0][0])

    def observe(self, size: int, tokens: int, seconds: float) -> None:
        """A held step of ``size`` nodes (0: draft-free) committed ``tokens`` in ``seconds`` (its whole wall time);
        nothing before the ladder started."""
        if self.ladder is not None:
            self.ladder.observe(size, tokens, seconds)
