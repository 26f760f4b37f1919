"""Delayed expansion (the delayed-expansion paper's fixed shape): a sampled trunk, then i.i.d. paths from its tip."""

from __future__ import annotations

from .base import POLICIES
from .iid import SampledPathsPolicy


@POLICIES.register("delayed")
class DelayedPolicy(SampledPathsPolicy):
    """Delayed expansion: one sampled trunk of l1 = ``delay_trunk`` tokens, then k = ``tree_paths`` i.i.d. paths of
    l2 = ``delay_branch`` tokens from its tip, so the branching happens where draft and target diverge more."""

    defaults = {"delay_trunk": 2, "tree_paths": 4, "delay_branch": 3}

    def shape(self) -> tuple[int, int, int]:
        return int(self.params["delay_trunk"]), int(self.params["tree_paths"]), int(self.params["delay_branch"])
