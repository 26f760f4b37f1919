"""Training for TreeSpec feature drafters (installed as ``hf_treespec.trainers``; inference never imports it).

Pipeline: :func:`prepare_dataset` (target hidden states + TALF target trees, chunked and resumable) ->
:class:`EAGLETrainer` warm-up -> :class:`HASSTrainer` or :class:`TALFTrainer` -> :func:`acceptance_by_depth`.
Command line: ``hf-treespec train {prepare,eagle,hass,talf,evaluate}`` (:mod:`.cli`).
"""

from .chat import to_messages, tokenize_conversation
from .collators import DrafterCollator, EAGLECollator, HASSCollator, TALFCollator
from .data import PreparedData, PrepareConfig, load_prepared, prepare_dataset
from .evaluation import acceptance_by_depth
from .losses import TargetHead
from .target_trees import TargetTree, TreeRoot, grow_target_trees
from .trainer import (
    DrafterTrainer,
    DrafterTrainingArguments,
    EAGLEConfig,
    EAGLETrainer,
    HASSConfig,
    HASSTrainer,
    TALFConfig,
    TALFTrainer,
)
from .unroll import TreeLevels, unroll

#: objective name -> trainer class (the CLI and ``train_drafter`` look objectives up here)
TRAINERS: dict[str, type[DrafterTrainer]] = {"eagle": EAGLETrainer, "hass": HASSTrainer, "talf": TALFTrainer}

__all__ = [
    "TRAINERS", "DrafterCollator", "DrafterTrainer", "DrafterTrainingArguments", "EAGLECollator", "EAGLEConfig",
    "EAGLETrainer", "HASSCollator", "HASSConfig", "HASSTrainer", "PrepareConfig", "PreparedData", "TALFCollator",
    "TALFConfig", "TALFTrainer", "TargetHead", "TargetTree", "TreeLevels", "TreeRoot", "acceptance_by_depth",
    "grow_target_trees", "load_prepared", "prepare_dataset", "to_messages", "tokenize_conversation", "unroll",
]
