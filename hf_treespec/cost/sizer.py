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

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..budget import AUTO_MAX_CHILDREN
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
    max_children: int = AUTO_MAX_CHILDREN
    #: the step's predicted costs per rows, when another row's sizer of this step already read them (`for_row`)
    costs: np.ndarray | None = None
    mode: str | None = None
    #: the latest `_best` answer: (tree, members, (expansions, members counted)), result
    _memo: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = self.speed.step_mode(self.context)

    def for_row(self, context: int) -> "TreeSizer":
        """A fresh budget (its own expansion count) for a row of this step at ``context``: this step's mode and
        predicted costs when the context is this one's, else read anew."""
        if context != self.context:
            return TreeSizer(self.speed, context, self.max_nodes)
        return TreeSizer(self.speed, context, self.max_nodes, costs=self._costs, mode=self.mode)

    # read lazily: a step the speed model skips (no tree pays) never interpolates the cost curve. The per-step
    # arithmetic runs on numpy arrays of ~100 floats: torch's per-op overhead, ~40 ops a step, was ~1 ms of a 10-20
    # ms compiled step
    @cached_property
    def _costs(self) -> np.ndarray:
        if self.costs is not None:
            return self.costs
        return self.speed.step_costs(self.max_nodes + LOOKAHEAD + 2, self.context).numpy()

    @cached_property
    def t_draft(self) -> float:
        return float(self.speed.draft_seconds(self.context))

    def cost(self, rows: int) -> float:
        return float(self._costs[min(rows, self._costs.size) - 1])

    def _accept(self, scores: np.ndarray) -> np.ndarray:
        """Acceptance probabilities of draft log-scores (the speed model's table; any callable on tensors too)."""
        table = self.speed.acceptance
        fast = getattr(table, "probabilities", None)
        if fast is not None:
            return fast(scores)
        return table(torch.from_numpy(scores).float()).double().numpy()

    def could_pay(self, max_depth: int = AUTO_MAX_NODES) -> bool:
        """Whether any tree could beat a draft-free step this step: an upper bound over every policy's trees. A tree
        of depth d takes at least d draft forwards, verifies at least d + 1 rows and commits at most d + 1 tokens,
        so it is never faster than ``(1 + d) / (d * t_draft + c(1 + d))``. False in "skip" and "control" modes, True
        in "probe" mode (a probe drafts regardless). Lets a batch skip every row's policy when no row could draft."""
        if self.mode != "size":
            return self.mode == "probe"
        costs = self._costs
        depths = np.arange(1, min(max_depth, costs.size - 1) + 1, dtype=np.float64)
        best = ((1 + depths) / (depths * self.t_draft + costs[1 : depths.size + 1])).max()
        return bool(best > 1.0 / costs[0])

    def rates(self, ranked_scores) -> tuple[np.ndarray, np.ndarray]:
        """For candidate draft nodes ranked best first (every prefix closed under parents): expected tokens and
        expected tokens/s of keeping the first n of them, n = 0..len, with the draft time spent so far."""
        accept = self._accept(np.asarray(ranked_scores, dtype=np.float64))
        tokens = np.concatenate([[1.0], 1 + np.cumsum(accept)])
        rows = min(tokens.size, self._costs.size)
        seconds = self.expansions * self.t_draft + self._costs[:rows]
        return tokens[:rows], tokens[:rows] / seconds

    def best(self, tree: DraftTree, members: torch.Tensor | None = None) -> tuple[int, float, float]:
        """(n, expected tokens, rate) of the best prefix of ``members`` (bool over nodes, root excluded; all when
        None) ranked by draft score."""
        return self._best(tree, members)[1:]

    def _best(self, tree: DraftTree, members: torch.Tensor | None) -> tuple[np.ndarray, int, float, float]:
        """`best` with the ranked scores, remembered for the latest (tree, members, expansions): a policy asks
        `in_best_prefix` and then `expand_again` of the same tree."""
        # a mask the policy updates in place is told apart by its count
        state = (self.expansions, None if members is None else int(members.sum()))
        if self._memo is not None and self._memo[0] is tree and self._memo[1] is members and self._memo[2] == state:
            return self._memo[3]
        scores = tree.scores[1:] if members is None else tree.scores[1:][members[1:]]
        ranked = -np.sort(-scores.detach().cpu().double().numpy())[: self.max_nodes]
        tokens, rates = self.rates(ranked)
        n = int(rates.argmax())
        result = (ranked, n, float(tokens[n]), float(rates[n]))
        self._memo = (tree, members, state, result)
        return result

    def in_best_prefix(self, tree: DraftTree, nodes: torch.Tensor, members: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Bool over ``nodes``: those the best prefix of ``members`` keeps (the root always). Only they are worth
        expanding: a node left out had an acceptance below what its row would cost at the prefix's rate, and its
        descendants score lower still (a block of such nodes never pays either), while the rate only rises as
        better nodes join."""
        if self.mode == "probe" and self.expansions == 0:
            return torch.ones(nodes.numel(), dtype=torch.bool)
        ranked, n, _, _ = self._best(tree, members)
        is_root = tree.parents[nodes] < 0
        if n == 0:
            return is_root
        return (tree.scores[nodes] >= float(ranked[n - 1])) | is_root

    def expected_gain(self, scores, levels: int) -> np.ndarray:
        """``[levels]`` expected accepted tokens added by expanding the nodes of draft log-scores ``scores`` and then
        the best descendants below them, 1..levels levels deep: a best child scores `SpeedModel.child_logprob` below
        its parent on average, and the acceptance table turns every score into a probability. An estimate, not a
        bound: bounding each level by the expanded nodes' own acceptance ran 2.7 draft forwards a step on a CPU where
        a fixed 4-node tree (1.4 forwards) was faster."""
        scores = np.asarray(scores.detach().cpu().double() if isinstance(scores, torch.Tensor) else scores,
                            dtype=np.float64)
        depths = np.arange(1, levels + 1, dtype=np.float64)[:, None]
        below = scores[None, :] + depths * self.speed.child_logprob
        return np.cumsum(self._accept(below.ravel()).reshape(below.shape).sum(-1))

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
            gains = gains + np.arange(1, LOOKAHEAD + 1)  # wherever a tree could pay and its acceptance is measured
        steps = np.arange(1, LOOKAHEAD + 1)
        rows = np.minimum(n + 1 + steps, self._costs.size) - 1
        seconds = (self.expansions + steps) * self.t_draft + self._costs[rows]
        return bool(((tokens + gains) / seconds > rate).any())

    def choose_shape(self, nodes_of, max_k: int, max_l: int) -> tuple[int, int] | None:
        """The (k, l) of a sampled tree that maximises expected tokens per second, ``(1 + sum_j alpha_k^j) /
        (l * t_draft + c(nodes_of(k, l) + 1))`` with the per-depth acceptance learned online; None when no shape
        beats a draft-free step (a probe step then drafts the smallest shape). The policy returns its choice with
        the tree (`Draft.shape`), so the loop's observation of this step updates the acceptance of that k."""
        if self.mode in ("skip", "control"):
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
