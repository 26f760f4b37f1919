"""Verifiers, registered by name in `VERIFIERS` (ALGORITHMS.md sections 1-6)."""

from .base import VERIFIERS, Verifier, VerifyResult
from . import chain, greedy, nss  # noqa: F401  (registration)

__all__ = ["VERIFIERS", "Verifier", "VerifyResult"]
