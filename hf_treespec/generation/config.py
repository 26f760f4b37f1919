"""The tree-speculation generate kwargs. They live on the generation config, so they save and load with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from ..policies import POLICIES

#: what each tree kwarg means. Which kwargs exist is not listed here: it is ``tree_policy``, ``verifier`` and every
#: key a registered policy declares in its ``defaults`` (`declared_kwargs`); all default to None (= the chosen
#: policy's paper default).
KWARG_DOCS: dict[str, str] = {
    "tree_policy": "how the draft tree is grown: " + "see hf_treespec.list_policies()",
    "verifier": "how the target verifies it; default 'greedy' (do_sample=False) or the policy's sampling verifier",
    "tree_budget": "N, number of draft nodes per step (root excluded), or 'auto': sized per step by measured cost "
    "(the default of 'salf', 'optimal' and 'eagle2'; the only value 'iid' and 'swor' take)",
    "tree_depth": "maximum tree depth (chain length for 'chain')",
    "tree_topk": "k, children per expanded node (EAGLE-2 beam width)",
    "salf_batch": "B, nodes expanded per SALF / optimal iteration",
    "salf_threshold": "th, SALF stops when the popped batch's probability sum falls below it (0 = optimal search)",
    "tree_paths": "k, number of i.i.d. draft paths ('iid', 'delayed')",
    "delay_trunk": "l1, length of the single sampled trunk before branching ('delayed')",
    "delay_branch": "l2, length of each i.i.d. path after the trunk ('delayed')",
    "tree_selector": "trained delay selector choosing (k, l1, l2) per step ('nde'): a folder written by "
    "`hf-treespec train nde` / DelaySelector.save_pretrained (what save_pretrained keeps), or a DelaySelector; "
    "unset: the delay_selector/ folder that ships with the assistant model, if any",
    "dyspec_threshold": "t in [0, 1): 'dyspec' draws only while the estimated acceptance is >= t (paper: ~1/N); "
    "0 = the pure budget-N greedy heap",
    "tree_shape": "'static' tree: list of child-rank paths, e.g. [[0], [1], [0, 0]] (rank 0 = the draft's best child)",
    "c2t_classifier": "'c2t' confidence classifier: a folder written by `hf-treespec train c2t` / "
    "C2TClassifier.save_pretrained, or a C2TClassifier; unset: the c2t/ folder that ships with the assistant model",
    "c2t_threshold": "beta in (0, 1): 'c2t' keeps and expands a candidate whose classifier confidence exceeds it",
    "c2t_topk": "second top-k of 'c2t': at most this many candidates kept per layer (by confidence); 0 = no cap",
    "c2t_entropy_top": "N of the top-N entropy feature of 'c2t' (>= the vocabulary: the full entropy); unset: the "
    "classifier's own (1000, as trained)",
    "chain_min_prob": "'chain' early exit: stop drafting once the draft's top probability at the next position is "
    "below it (0 = off; the C2T paper's DyMax)",
    "chain_min_joint": "'chain' early exit: stop drafting once the chain's joint draft probability times the next "
    "position's top probability is below it (0 = off; the C2T paper's DyJoint)",
}


def declared_kwargs() -> dict[str, str]:
    """``tree_policy``, ``verifier`` and every kwarg the registered policies declare (their ``defaults``), with its
    description; a policy kwarg without one in `KWARG_DOCS` is a bug of that policy's registration."""
    names = ["tree_policy", "verifier"] + sorted({key for name in POLICIES for key in POLICIES.get(name).defaults})
    missing = [name for name in names if name not in KWARG_DOCS]
    if missing:
        raise RuntimeError(f"tree kwargs {missing} are declared by a policy but not described in KWARG_DOCS.")
    return {name: KWARG_DOCS[name] for name in names}


#: generate kwarg -> meaning, for every tree kwarg of the built-in policies (read at import: ``tree_generate``'s
#: signature declares them, as ``custom_generate`` requires)
TREE_GENERATION_KWARGS: dict[str, str] = declared_kwargs()

#: what generate's preparation passes on to a ``custom_generate`` callable that no decoding loop here uses
GENERATE_ONLY_KWARGS = ("synced_gpus", "inputs_tensor", "assistant_tokenizer", "tokenizer")


def add_tree_kwargs(generation_config: GenerationConfig) -> None:
    """Declares the tree kwargs on ``generation_config`` (None unless already set) so ``generate`` accepts them."""
    for key in TREE_GENERATION_KWARGS:
        if not hasattr(generation_config, key):
            setattr(generation_config, key, None)


@dataclass
class TreeSpecSettings:
    """Tree kwargs resolved from one ``generate`` call's generation config."""

    policy: str
    verifier: str | None
    policy_params: dict[str, Any]
    do_sample: bool

    @classmethod
    def from_generation_config(cls, generation_config: GenerationConfig) -> "TreeSpecSettings":
        params = {
            key: getattr(generation_config, key, None)
            for key in TREE_GENERATION_KWARGS
            if key not in ("tree_policy", "verifier")
        }
        return cls(
            policy=getattr(generation_config, "tree_policy", None),
            verifier=getattr(generation_config, "verifier", None),
            policy_params=params,
            do_sample=bool(generation_config.do_sample),
        )
