"""Drafters: adapters that let any assistant model grow a draft tree."""

from .base import DRAFTER_ADAPTERS, Drafter, TargetFeatures, as_drafter
from .causal_lm import CausalLMDrafter
from .truncated import truncated

__all__ = ["DRAFTER_ADAPTERS", "CausalLMDrafter", "Drafter", "TargetFeatures", "as_drafter", "truncated"]
