"""Tree policies, registered by name in `POLICIES` (docs/algorithms.md section 7)."""

from .base import POLICIES, DraftSource, TreePolicy
from .context import StepContext
from . import best_first, chain, eagle2, iid, nde, swor  # noqa: F401  (registration)
from .nde import Action, DelaySelector, DelaySelectorConfig

__all__ = ["POLICIES", "Action", "DelaySelector", "DelaySelectorConfig", "DraftSource", "StepContext", "TreePolicy"]
