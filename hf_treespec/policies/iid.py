"""Sampled i.i.d. draft trees: k paths drawn with replacement from q (SpecInfer / SpecTr); `SampledPathsPolicy` is
also the base of delayed expansion (`delayed.py`).

Equal draws are merged: a node's children are the distinct tokens its paths drew, each with its multiplicity in
``DraftTree.counts``, so the target forward holds no duplicate rows and the verifiers see "children with
multiplicity" (the delayed-expansion paper's definition). Every level is one batched draft call, and every
expanded node records q(. | node) for the verifier.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Generator
from typing import Any

import torch

from ..budget import step_budget
from ..randomness import Randomness, multinomial_counts
from ..step_context import StepContext
from ..tree import DraftTree, Regime
from .base import POLICIES, Draft, Growth, LogprobsRequest, TreePolicy


def add_iid_children(
    tree: DraftTree, nodes: torch.Tensor, probs: torch.Tensor, draws: torch.Tensor, generator: Randomness = None
) -> tuple[DraftTree, torch.Tensor]:
    """Node ``nodes[i]`` draws ``draws[i]`` tokens i.i.d. from ``probs[i]``; equal draws become one child with their
    count. Returns the tree and the new nodes (ordered by parent, then token)."""
    counts = multinomial_counts(probs, draws, generator).cpu()  # the tree's structure lives on the host
    row, token = counts.nonzero(as_tuple=True)
    start = tree.num_nodes
    tree = tree.add_children(nodes[row], token, probs[row, token].log(), counts=counts[row, token])
    return tree, torch.arange(start, tree.num_nodes, device=tree.device)


def grow_iid(
    tree: DraftTree, frontier: torch.Tensor, draws: torch.Tensor, levels: int, record: bool,
    generator: Randomness = None, first: torch.Tensor | None = None,
) -> Generator[Any, Any, tuple[DraftTree, torch.Tensor]]:
    """Extends ``draws[i]`` i.i.d. paths from each ``frontier[i]`` by ``levels`` tokens, one draft request per level;
    returns ``(tree, frontier)``. ``first``: the first level's log q when it is already known (NDE drafted it)."""
    for level in range(levels):
        logq = first if level == 0 and first is not None else (yield LogprobsRequest(tree, frontier))
        # a drafter may propose nothing at a node (prompt lookup without a match: every log-prob -inf, softmax NaN);
        # such a node gets no children and q = 0 on record, which no verifier reads for a childless node
        probs = torch.nan_to_num(logq.exp(), nan=0.0)
        draws = torch.where(probs.sum(-1) > 0, draws.to(probs.device), 0)
        if record:
            tree = tree.record_draft_probs(frontier, probs)
        tree, frontier = add_iid_children(tree, frontier, probs, draws, generator)
        draws = tree.counts[frontier]
    return tree, frontier


class SampledPathsPolicy(TreePolicy):
    """Shared by ``iid`` and ``delayed``: a trunk of ``trunk`` tokens, then ``paths`` i.i.d. paths of ``branch``."""

    regime = Regime.IID
    default_verifier = "specinfer"


    @abstractmethod
    def shape(self) -> tuple[int, int, int]:
        """(trunk length, number of paths, path length after the trunk)."""

    def validate(self) -> None:
        super().validate()
        for key in ("tree_paths", "delay_branch"):
            if key in self.params and int(self.params[key]) < 1:
                raise ValueError(f"{key} must be >= 1, got {self.params[key]}.")
        if "delay_trunk" in self.params and int(self.params["delay_trunk"]) < 0:
            raise ValueError(f"delay_trunk must be >= 0, got {self.params['delay_trunk']}.")

    @property
    def is_chain(self) -> bool:
        return self.shape()[1] == 1

    def grow(
        self, root_token: int, *, context: StepContext, capabilities: frozenset[str] = frozenset(),
        generator: Randomness = None,
    ) -> Growth:
        """With do_sample=False the tree is still sampled (greedy verification is lossless for any tree)."""
        trunk, paths, branch = self.shape()
        tree = DraftTree.root(root_token, regime=self.regime)
        chosen = None
        sizer = step_budget(context, self.params.get("tree_budget"), self.name)
        if sizer is not None:  # (k, l) per step from the step's budget, the kwargs as upper bounds; None: no drafts
            chosen = sizer.choose_shape(lambda k, depth: k * depth, paths, branch)
            if chosen is None:
                return Draft(tree)
            paths, branch = chosen
        one = torch.ones(1, dtype=torch.long)
        tree, tip = yield from grow_iid(tree, one - 1, one, trunk, self.do_sample, generator)
        tree, _ = yield from grow_iid(tree, tip, one * paths, branch, self.do_sample, generator)
        return Draft(tree, chosen)


@POLICIES.register("iid")
class IIDPolicy(SampledPathsPolicy):
    """k = ``tree_paths`` paths of l = ``tree_depth`` tokens sampled from q with replacement (at most k*l nodes)."""

    defaults = {"tree_paths": 4, "tree_depth": 4, "tree_budget": None}
    supports_auto = True
    auto_only = frozenset({"tree_budget"})


    def shape(self) -> tuple[int, int, int]:
        return 0, int(self.params["tree_paths"]), int(self.params["tree_depth"])
