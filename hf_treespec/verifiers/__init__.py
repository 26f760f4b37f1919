"""Verifiers, registered by name in `VERIFIERS` (docs/algorithms.md sections 1-6)."""

from .base import VERIFIERS, Verifier, VerifyResult
from . import (  # noqa: F401  (registration)
    block, greedy, khisti, khisti_priority, naive, naivetree, nss, specinfer, spectr, swor, traversal,
)

__all__ = ["VERIFIERS", "Verifier", "VerifyResult"]
