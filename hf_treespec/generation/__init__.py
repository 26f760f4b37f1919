"""Generation glue: generate kwargs, per-node logits processing and the tree-speculative decoding loop."""

from .config import TREE_GENERATION_KWARGS, TreeSpecSettings
from .decoding import TreeSpecGenerateOutput, tree_speculative_decoding
from .mixin import TreeSpecGenerationMixin, enable

__all__ = [
    "TREE_GENERATION_KWARGS",
    "TreeSpecGenerateOutput",
    "TreeSpecGenerationMixin",
    "TreeSpecSettings",
    "enable",
    "tree_speculative_decoding",
]
