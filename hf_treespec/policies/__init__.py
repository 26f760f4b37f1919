"""Tree policies, registered by name in `POLICIES` (ALGORITHMS.md section 7)."""

from .base import POLICIES, DraftSource, TreePolicy
from . import best_first, chain, eagle2, iid, swor  # noqa: F401  (registration)

__all__ = ["POLICIES", "DraftSource", "TreePolicy"]
