"""Training for TreeSpec feature drafters (installed as ``hf_treespec.trainers``; inference never imports it).

Pipeline: :func:`prepare_dataset` (target hidden states + TALF target trees, chunked and resumable) ->
:class:`EAGLETrainer` warm-up -> :class:`HASSTrainer`, :class:`TALFTrainer` or :class:`TTTTrainer` (EAGLE-3's
training-time test + TALF trees) -> :func:`acceptance_by_depth`.
GTO fine-tuning on the drafter's own trees: :class:`GTOTrainer` (needs the target online, see :mod:`.gto`). Self-distilled data: ``train regenerate``.
The NDE delay selector of ``tree_policy="nde"``: :func:`generate_nde_data` -> :class:`NDETrainer`.
The C2T classifier of ``tree_policy="c2t"``: :func:`generate_c2t_data` -> :class:`C2TTrainer`.
Command line: ``hf-treespec train {regenerate,prepare,eagle,hass,talf,ttt,evaluate,nde-data,nde,gto,c2t-data,c2t,static-shape}`` (:mod:`.cli`).
"""

from .objectives.c2t import C2TConfig, C2TDataConfig, C2TTrainer, generate_c2t_data, rank_acceptance
from .data.chat import to_messages, tokenize_conversation
from .data.collators import DrafterCollator, EAGLECollator, HASSCollator, TALFCollator
from .data.prepared import PreparedData, PrepareConfig, load_prepared, prepare_dataset
from .evaluation.acceptance import acceptance_by_depth
from .objectives.gto import GTOCollator, GTOConfig, GTOTrainer
from .objectives.losses import TargetHead
from .objectives.nde import NDECollator, NDEConfig, NDETrainer, build_selector, throughput_objective
from .evaluation.latency import LatencyModel, measure_latency
from .data.nde_data import NDEDataConfig
from .data.nde_dataset import NDEData, generate_nde_data, load_nde_data
from .data.target_trees import TargetTree, TreeRoot, grow_target_trees
from .objectives.trainer import (
    DrafterTrainer,
    DrafterTrainingArguments,
    EAGLEConfig,
    EAGLETrainer,
    HASSConfig,
    HASSTrainer,
    TALFConfig,
    TALFTrainer,
)
from .objectives.ttt import TTTCollator, TTTConfig, TTTTrainer, merge_levels
from .objectives.unroll import TreeLevels, unroll

#: objective name -> trainer class (the CLI and ``train_drafter`` look objectives up here)
TRAINERS: dict[str, type[DrafterTrainer]] = {"eagle": EAGLETrainer, "hass": HASSTrainer, "talf": TALFTrainer,
                                              "ttt": TTTTrainer}

__all__ = [
    "TRAINERS", "DrafterCollator", "DrafterTrainer", "DrafterTrainingArguments", "EAGLECollator", "EAGLEConfig",
    "EAGLETrainer", "HASSCollator", "HASSConfig", "HASSTrainer", "PrepareConfig", "PreparedData", "TALFCollator",
    "TALFConfig", "TALFTrainer", "TargetHead", "TargetTree", "TreeLevels", "TreeRoot", "acceptance_by_depth",
    "grow_target_trees", "load_prepared", "prepare_dataset", "to_messages", "tokenize_conversation", "unroll",
    "LatencyModel", "NDECollator", "NDEConfig", "NDEData", "NDEDataConfig", "NDETrainer", "build_selector",
    "generate_nde_data", "load_nde_data", "measure_latency", "throughput_objective",
    "C2TConfig", "C2TDataConfig", "C2TTrainer", "generate_c2t_data", "rank_acceptance",
    "TTTCollator", "TTTConfig", "TTTTrainer", "merge_levels",
    "GTOCollator", "GTOConfig", "GTOTrainer",
]
