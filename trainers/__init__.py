"""Training for TreeSpec feature drafters (installed as ``hf_treespec.trainers``; inference never imports it).

Pipeline: :func:`prepare_dataset` (target hidden states + TALF target trees, chunked and resumable) ->
:class:`EAGLETrainer` warm-up -> :class:`HASSTrainer` or :class:`TALFTrainer` -> :func:`acceptance_by_depth`.
The NDE delay selector of ``tree_policy="nde"``: :func:`generate_nde_data` -> :class:`NDETrainer`.
Command line: ``hf-treespec train {prepare,eagle,hass,talf,evaluate,nde-data,nde}`` (:mod:`.cli`).
"""

from .chat import to_messages, tokenize_conversation
from .collators import DrafterCollator, EAGLECollator, HASSCollator, TALFCollator
from .data import PreparedData, PrepareConfig, load_prepared, prepare_dataset
from .evaluation import acceptance_by_depth
from .losses import TargetHead
from .nde import NDECollator, NDEConfig, NDETrainer, build_selector, throughput_objective
from .latency import LatencyModel, measure_latency
from .nde_data import NDEData, NDEDataConfig, generate_nde_data, load_nde_data
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
    "LatencyModel", "NDECollator", "NDEConfig", "NDEData", "NDEDataConfig", "NDETrainer", "build_selector",
    "generate_nde_data", "load_nde_data", "measure_latency", "throughput_objective",
]
