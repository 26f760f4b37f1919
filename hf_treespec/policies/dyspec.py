"""DySpec: greedy expansion of a sampled tree by estimated acceptance (the DySpec paper, Algorithms 1 and 2).

DySpec keeps a max-heap of *slots*. A slot is "the next draw at node u": its value is the estimated probability
that verification ever tries it, exp(score(u)) times the draft mass not yet drawn at u. Popping a slot draws a
child y from the residual draft distribution at u (earlier children masked out, renormalised) and pushes two slots:
u's next draw (value lowered by q(y | u)) and y's first draw (value exp(score(y))). Popped values never increase, so
the tree of budget N is the N draws of highest slot value; the threshold variant keeps every draw of value >= t.

The heap needs one draft forward per node. Here the same tree is grown with one forward per *layer*: every expanded
node draws its whole sibling sequence at once (Gumbel-top-N, the order of sampling without replacement), which fixes
the slot values of all its children; the current N best draws give a cut-off tau, and the only nodes whose
subtrees can still enter the tree are the unexpanded ones whose value exceeds tau. They are expanded together in the
next forward, tau rises, and the loop ends when no such node is left. The result is exactly the heap's (ties go to
the earlier draw), so the SWOR verifier stays lossless: each node's children are a prefix of a sampling-without-
replacement sequence, kept in sampling order, and whether a draw is made depends only on earlier draws.

With do_sample=False the sibling sequence is the draft's ranking (top-N by q) instead of a sample.
"""

from __future__ import annotations

import torch

from ..randomness import Randomness
from ..step_context import StepContext
from ..tree import DraftTree, Regime, to_host
from .base import POLICIES, Draft, Growth, TreePolicy, sibling_sequence


@POLICIES.register("dyspec")
class DySpecPolicy(TreePolicy):
    """The greedy heap tree of ``tree_budget`` drafts; with ``dyspec_threshold`` t > 0 only draws whose estimated
    acceptance is >= t (the paper's layer-by-layer threshold variant, t ~ 1/N). The budget still caps the size, as
    in the paper's own threshold runs ("a maximum tree size set to 768 and a threshold of 0.001"): uncapped, a flat
    draft distribution would keep slot values >= t for thousands of siblings. ``tree_depth`` optionally bounds the
    depth (the paper has none)."""

    defaults = {"tree_budget": 60, "tree_depth": None, "dyspec_threshold": 0.0}
    regime = Regime.SWOR
    default_verifier = "swor"

    def validate(self) -> None:
        super().validate()
        t = float(self.params["dyspec_threshold"])
        if not 0 <= t < 1:
            raise ValueError(f"dyspec_threshold must be in [0, 1) (an estimated acceptance probability; the paper "
                             f"uses about 1/tree_budget), got {t}.")

    @property
    def is_chain(self) -> bool:
        return int(self.params["tree_budget"]) == 1

    def grow(
        self, root_token: int, *, context: StepContext, capabilities: frozenset[str] = frozenset(),
        generator: Randomness = None,
    ) -> Growth:
        """``generator``: where the draws come from (torch's global RNG when None; a RandomSource in exact tests)."""
        device = torch.device("cpu")  # trees are host bookkeeping (see DraftTree)
        budget, threshold = int(self.params["tree_budget"]), float(self.params["dyspec_threshold"])
        max_depth = self.params["tree_depth"]
        tree = DraftTree.root(root_token, device=device, regime=self.regime)
        keys = torch.full((1,), float("inf"), device=device)  # slot value of the draw that made each node
        expanded = torch.zeros(1, dtype=torch.bool, device=device)
        frontier = torch.zeros(1, dtype=torch.long, device=device)
        while frontier.numel():
            tokens, logq, probs, support = yield from sibling_sequence(tree, frontier, budget, self.do_sample,
                                                                       capabilities, generator)
            tokens, logq = to_host(tokens, logq)  # [F, <= budget] draws to the host tree (q stays on the device)
            if probs is not None:  # the verifier tests the draws against the q they were sampled from
                tree = tree.record_draft_probs(frontier, probs, support)
            expanded[frontier] = True
            # slot value of the j-th draw at u: exp(score(u)) * (1 - draft mass of draws 1..j-1)
            mass = logq.exp()
            before = (mass.cumsum(-1) - mass).clamp(max=1)
            # (capped by the node's own key: when a draw takes all remaining mass, exp(score) and the key agree up
            # to rounding, and a child must never outrank its parent)
            slot = torch.minimum(tree.scores[frontier].exp(), keys[frontier])[:, None] * (1 - before)
            draw = torch.isfinite(logq) & (slot > 0) & (slot >= threshold)
            draw = self._among_best(draw, slot, keys, budget)
            rows = torch.arange(frontier.numel(), device=device)[:, None].expand_as(tokens)[draw]
            start = tree.num_nodes
            tree = tree.add_children(frontier[rows], tokens[draw], logq[draw])
            keys = torch.cat([keys, slot[draw].float()])
            expanded = torch.cat([expanded, expanded.new_zeros(tree.num_nodes - start)])
            # keep the N best draws (and the root); ties go to the earlier index, so the kept set is closed under
            # parents and earlier siblings (both have higher-or-equal keys and lower indices)
            if tree.num_nodes - 1 > budget:
                order = torch.sort(-keys[1:], stable=True).indices[:budget] + 1
                keep = torch.cat([order.new_zeros(1), order]).sort().values
                tree, keys, expanded = tree.select(keep), keys[keep], expanded[keep]
            cutoff = keys[1:].min() if tree.num_nodes - 1 >= budget else keys.new_zeros(())
            value = torch.minimum(tree.scores.exp(), keys)  # slot value of each node's first draw
            grow = ~expanded & (value > cutoff) & (value >= threshold) & (value > 0)
            if max_depth is not None:
                grow &= tree.depth < int(max_depth)
            frontier = grow.nonzero().squeeze(-1)
        return Draft(tree)

    @staticmethod
    def _among_best(draw: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
        """The draws that can survive the cut to the ``budget`` best (the tree's draws first, then these in
        row-major order: the cut's own tie order). Dropping the others before they enter the tree gives the same
        tree and keeps a wide layer of a large budget (hundreds of nodes x hundreds of draws) from materialising."""
        count = int(draw.sum())  # host tensors: no device sync
        if count + keys.numel() - 1 <= budget:
            return draw
        values = torch.cat([keys[1:].float(), slot[draw].float()])
        best = torch.sort(-values, stable=True).indices[:budget]
        kept = torch.zeros(values.numel(), dtype=torch.bool)
        kept[best] = True
        among = draw.clone()
        among[draw] = kept[keys.numel() - 1:]
        return among
