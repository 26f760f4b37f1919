"""hf_treespec: lossless tree-based speculative decoding behind Hugging Face ``model.generate``."""

from . import drafters
from .cost.hardware import fast_dtype
from .generation import TreeSpecGenerateOutput, enable, plain_generate, tree_generate
from .policies import POLICIES
from .tree import DraftTree, Regime
from .verifiers import VERIFIERS

__version__ = "0.1.0"


def list_policies() -> list[str]:
    """Names accepted by ``generate(tree_policy=...)``."""
    return POLICIES.names()


def list_verifiers() -> list[str]:
    """Names accepted by ``generate(verifier=...)``."""
    return VERIFIERS.names()


__all__ = ["DraftTree", "Regime", "TreeSpecGenerateOutput", "drafters", "enable", "fast_dtype", "list_policies",
           "list_verifiers", "plain_generate", "tree_generate"]
