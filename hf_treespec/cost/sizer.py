"""`TreeSizer`: the `StepBudget` of ``tree_budget="auto"``, sizing every tree by expected tokens per second under
measured costs (`SpeedModel`). The decoding loop's sizing component builds one per row and step.

A step that verifies the root plus ``n`` draft nodes, after ``e`` draft forwards, is expected to commit
``1 + sum_i a_i`` tokens (``a_i``: calibrated probability that node i is accepted; a node's tokens count once its
whole path is accepted, and accepted paths are disjoint events per depth, so expected accepted length is the sum of
node acceptance probabilities) in ``e * t_draft + c(n + 1)`` seconds. The policy

- keeps expanding while some lookahead of ``h`` more expansions is expected to beat the best rate already reachable
  (an expansion is expected to add the acceptance of the expanded nodes' best children, each scoring the drafter's
  learned mean best-child log probability below its parent, and so on ``h`` levels down), and
- finally keeps the best-ranked prefix of nodes that maximises the rate, which may be the root alone: a step
  without drafts, exactly one plain ``generate`` step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from ..tree import DraftTree, top_by_score

if TYPE_CHECKING:
    from .speed_model import SpeedModel

#: most draft nodes an auto-sized tree may hold (the cost rule usually stops far earlier on a CPU)
AUTO_MAX_NODES = 96
#: expansions looked ahead when deciding whether to expand again
LOOKAHEAD = 4
#: shapes (k paths or siblings, l levels) the sampled policies choose from under "auto" (bounded by their kwargs)
SHAPE_KS = (1, 2, 3, 4, 6, 8)
SHAPE_LS = (1, 2, 3, 4, 5, 6, 8)


@dataclass
class TreeSizer:
    """The cost rule for one step: built from the loop's `SpeedModel` and the step's context length."""

    speed: "SpeedModel"
    context: int
    max_nodes: int = AUTO_MAX_NODES
    expansions: int = 0

    def __post_init__(self) -> None:
        self.mode = self.speed.step_mode(self.context)

    # read lazily: a step the speed model skips (no tree pays) never interpolates the cost curve
    @cached_property
    def _costs(self) -> torch.Tensor:
        return self.speed.step_costs(self.max_nodes + LOOKAHEAD + 2, self.context)

    @cached_property
    def t_draft(self) -> float:
        return float(self.speed.draft_seconds(self.context))

    def cost(self, rows: int) -> float:
        return float(self._costs[min(rows, self._costs.numel()) - 1])

    def could_pay(self, max_depth: int = AUTO_MAX_NODES) -> bool:
        """Whether any tree could beat a draft-free step this step: an upper bound over every policy's trees. A tree
        of depth d takes at least d draft forwards, verifies at least d + 1 rows and commits at most d + 1 tokens,
        so it is never faster than ``(1 + d) / (d * t_draft + c(1 + d))``. False in "skip" mode, True in "probe"
        mode (a probe drafts regardless). Lets a batch skip every row's policy when no row could draft."""
        if self.mode != "size":
            return self.mode == "probe"
        depths = torch.arange(1, min(max_depth, self._costs.numel() - 1) + 1, dtype=torch.float64)
        best = ((1 + depths) / (depths * self.t_draft + self._costs[depths.long()])).max()
        return bool(best > 1.0 / self.cost(1))

    def rates(self, ranked_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For candidate draft nodes ranked best first (every prefix closed under parents): expected tokens and
        expected tokens/s of keeping the first n of them, n = 0..len, with the draft time spent so far."""
        accept = self.speed.acceptance(ranked_scores.float().cpu()).double()
        tokens = torch.cat([torch.ones(1, dtype=torch.float64), 1 + accept.cumsum(0)])
        rows = min(tokens.numel(), self._costs.numel())
        seconds = self.expansions * self.t_draft + self._costs[:rows]
        return tokens[:rows], tokens[:rows] / seconds

    def best(self, tree: DraftTree, members: torch.Tensor | None = None) -> tuple[int, float, float]:
        """(n, expected tokens, rate) of the best prefix of ``members`` (bool over nodes, root excluded; all when
        None) ranked by draft score."""
        scores = tree.scores[1:] if members is None else tree.scores[1:][members[1:]]
        ranked = torch.sort(scores, descending=True, stable=True).values[: self.max_nodes]
        tokens, rates = self.rates(ranked)
        n = int(rates.argmax())
        return n, float(tokens[n]), float(rates[n])

    def expected_gain(self, scores: torch.Tensor, levels: int) -> torch.Tensor:
        """``[levels]`` expected accepted tokens added by expanding the nodes of draft log-scores ``scores`` and then
        the best descendants below them, 1..levels levels deep: a best child scores `SpeedModel.child_logprob` below
        its parent on average, and the acceptance table turns every score into a probability. An estimate, not a
        bound: bounding each level by the expanded nodes' own acceptance ran 2.7 draft forwards a step on a CPU where
        a fixed 4-node tree (1.4 forwards) was faster."""
        depths = torch.arange(1, levels + 1, dtype=torch.float32)[:, None]
        below = scores.float().cpu()[None, :] + depths * self.speed.child_logprob
        return self.speed.acceptance(below.flatten()).view_as(below).sum(-1).double().cumsum(0)

    def expand_again(self, tree: DraftTree, expand: torch.Tensor, members: torch.Tensor | None = None) -> bool:
        """`StepBudget.expand_again`: `worth_expanding`, counting the expansion (its draft forward) when True."""
        if self.worth_expanding(tree, expand, members):
            self.expansions += 1
            return True
        return False

    def worth_expanding(self, tree: DraftTree, expand: torch.Tensor, members: torch.Tensor | None = None) -> bool:
        """Whether expanding ``expand`` (and up to LOOKAHEAD - 1 further levels below) is expected to raise the best
        rate."""
        if self.mode == "probe" and self.expansions == 0:
            return True
        n, tokens, rate = self.best(tree, members)
        if n >= self.max_nodes:
            return False
        is_root = (tree.parents[expand] < 0).cpu()
        gains = self.expected_gain(tree.scores[expand][~is_root], LOOKAHEAD)
        if bool(is_root.any()):  # the root's own children: the bound (one token per level), so the drafter runs
            gains = gains + torch.arange(1, LOOKAHEAD + 1)  # wherever a tree could pay and its acceptance is measured
        for h in range(1, LOOKAHEAD + 1):
            seconds = (self.expansions + h) * self.t_draft + self.cost(n + 1 + h)
            if (tokens + float(gains[h - 1])) / seconds > rate:
                return True
        return False

    def choose_shape(self, nodes_of, max_k: int, max_l: int) -> tuple[int, int] | None:
        """The (k, l) of a sampled tree that maximises expected tokens per second, ``(1 + sum_j alpha_k^j) /
        (l * t_draft + c(nodes_of(k, l) + 1))`` with the per-depth acceptance learned online; None when no shape
        beats a draft-free step (a probe step then drafts the smallest shape). The policy returns its choice with
        the tree (`Draft.shape`), so the loop's observation of this step updates the acceptance of that k."""
        if self.mode == "skip":
            return None
        acceptance = self.speed.depth_acceptance
        best, best_rate = None, 1.0 / self.cost(1)
        for k in (k for k in SHAPE_KS if k <= max_k):
            for depth in (d for d in SHAPE_LS if d <= max_l):
                nodes = nodes_of(k, depth)
                if nodes > self.max_nodes:
                    continue
                rate = acceptance.expected_tokens(k, depth) / (depth * self.t_draft + self.cost(nodes + 1))
                if rate > best_rate:
                    best, best_rate = (k, depth), rate
        if best is None and self.mode == "probe":
            best = (1, 1)
        return best

    def prune(self, tree: DraftTree) -> DraftTree:
        """Keeps the best prefix of nodes by draft score (the root alone when no draft pays)."""
        self.speed.observe_children(tree.scores, tree.parents)
        n, _, _ = self.best(tree)
        if self.mode == "probe":
            n = max(n, 1)  # a probe verifies at least the best node, so acceptance is measured again
        return top_by_score(tree, n)

