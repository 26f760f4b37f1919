"""Tree policies, registered by name in `POLICIES` (docs/algorithms.md section 7)."""

from .base import POLICIES, Draft, DraftSource, GreedyChainRequest, LogprobsRequest, TopkRequest, TreePolicy
from ..step_context import StepContext
from . import best_first, c2t, chain, delayed, dyspec, eagle2, iid, nde, static, swor  # noqa: F401  (registration)
from .nde import Action, DelaySelector, DelaySelectorConfig

__all__ = ["POLICIES", "Action", "DelaySelector", "DelaySelectorConfig", "Draft", "DraftSource", "GreedyChainRequest",
           "LogprobsRequest", "StepContext", "TopkRequest", "TreePolicy"]
