"""Drafters: adapters that let any assistant model grow a draft tree."""

from .base import DRAFTER_ADAPTERS, Drafter, TargetFeatures, as_drafter
from .causal_lm import CausalLMDrafter
from .truncated import truncated
from .lookup import PromptLookupDrafter, prompt_lookup
from .feature import TreeSpecDrafterConfig, TreeSpecDrafterModel, TreeSpecDrafterOutput, build_draft_vocab
from .feature_adapter import FeatureDrafter
from .eagle_io import from_eagle, to_eagle3

__all__ = ["DRAFTER_ADAPTERS", "CausalLMDrafter", "Drafter", "TargetFeatures", "as_drafter", "truncated"]
__all__ += ["FeatureDrafter", "TreeSpecDrafterConfig", "TreeSpecDrafterModel", "TreeSpecDrafterOutput",
            "build_draft_vocab", "from_eagle", "to_eagle3", "PromptLookupDrafter", "prompt_lookup"]
