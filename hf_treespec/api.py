"""The runtime's public API for ``hf_treespec.trainers``: every name the trainers use from the inference package.

The trainers import from here and nowhere else in ``hf_treespec`` (``tests/test_trainers_api.py`` fails on any other
import, and on a name listed here that no trainer uses), so a refactoring of the runtime keeps the trainers working by
keeping this module's names. Grouped by what the trainers do with them.
"""

from __future__ import annotations

# models and data: the SmolLM2 target, the shipped drafter, MT-bench / ShareGPT, drafters by name, chat prompts
from .assets import (TARGETS, default_drafter, iter_sharegpt, load_questions, load_target, sharegpt_prompts,
                     shipped_drafter_path)
from .benchmark.loading import build_prompt, load_drafter
# command lines: options generated from config dataclasses, --config files, help formatting
from .cli_options import (ExamplesHelpFormatter, HelpFormatter, add_config_option, add_options, apply_config_file,
                          build_config, comma_list, none_or, option)
# dtypes and timing
from .cost.hardware import AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES, DTYPES, fast_dtype, resolve_dtype_name
from .cost.timing import sync
# the target's forwards: tree masks, the cache's name in this transformers release, hidden states, sliding windows
from .attention import check_tree_attention, float_mask
from .compat import CACHE_KWARG, output_cache
from .features import capture_hidden_states, final_norm
from .kv.tree_kv import TreeKV, keep_rows
from .kv.window import sliding_layers
# drafters
from .drafters import (Drafter, FeatureDrafter, TargetFeatures, TreeSpecDrafterConfig, TreeSpecDrafterModel,
                       as_drafter, build_draft_vocab)
from .drafters.eagle_io import eagle3_default_target_layers, to_eagle3
# trees, policies and their growth (rollouts grow several trees side by side), logits processing
from .tree import DraftTree, Regime
from .step_context import StepContext
from .policies import POLICIES, TreePolicy
from .policies.base import DraftSource, Growth, grow_in_rounds
from .generation.draft_source import WarpedDraftSource
from .generation.processors import process_tree_logits
from .randomness import RandomSource, Randomness, categorical
# the helper networks the trainers fit: the C2T classifier, the NDE delay selector, the static policy's shapes
from .policies.c2t import C2TClassifier, C2TClassifierConfig, node_features, top_entropy
from .policies.nde import (FEATURE_SETS, LATENCY_FEATURES, SCALAR_FEATURES, Action, DelaySelector,
                           DelaySelectorConfig, action_space, capture_draft_hidden, root_features)
from .policies.static import choose_shape, expected_accepted, sequoia_shape
# verification laws (NDE training data)
from .verifiers.branching import NodeTable, branching_law, laws, node_tables

__all__ = [
    "TARGETS", "default_drafter", "iter_sharegpt", "load_questions", "load_target", "sharegpt_prompts",
    "shipped_drafter_path", "build_prompt", "load_drafter",
    "ExamplesHelpFormatter", "HelpFormatter", "add_config_option", "add_options", "apply_config_file", "build_config",
    "comma_list", "none_or", "option",
    "AUTO_DTYPE", "AUTO_DTYPE_HELP", "DTYPE_CHOICES", "DTYPES", "fast_dtype", "resolve_dtype_name", "sync",
    "check_tree_attention", "float_mask", "CACHE_KWARG", "output_cache", "capture_hidden_states", "final_norm",
    "TreeKV", "keep_rows", "sliding_layers",
    "Drafter", "FeatureDrafter", "TargetFeatures", "TreeSpecDrafterConfig", "TreeSpecDrafterModel", "as_drafter",
    "build_draft_vocab", "eagle3_default_target_layers", "to_eagle3",
    "DraftTree", "Regime", "StepContext", "POLICIES", "TreePolicy", "DraftSource", "Growth", "grow_in_rounds",
    "WarpedDraftSource", "process_tree_logits", "RandomSource", "Randomness", "categorical",
    "C2TClassifier", "C2TClassifierConfig", "node_features", "top_entropy",
    "FEATURE_SETS", "LATENCY_FEATURES", "SCALAR_FEATURES", "Action", "DelaySelector", "DelaySelectorConfig",
    "action_space", "capture_draft_hidden", "root_features",
    "choose_shape", "expected_accepted", "sequoia_shape",
    "NodeTable", "branching_law", "laws", "node_tables",
]
