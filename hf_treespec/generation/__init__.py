"""Generation glue: generate kwargs, per-node logits processing, the tree-speculative decoding loop and its entry."""

from .config import TREE_GENERATION_KWARGS, TreeSpecSettings
from .components import TreeSpecGenerateOutput
from .loop import tree_speculative_decoding
from .enable import enable, is_enabled
from .entry import tree_generate
from .plain import plain_generate

__all__ = [
    "TREE_GENERATION_KWARGS",
    "TreeSpecGenerateOutput",
    "TreeSpecSettings",
    "enable",
    "is_enabled",
    "plain_generate",
    "tree_generate",
    "tree_speculative_decoding",
]
