"""Drafters shipped with the package (``hf_treespec/assets_data/drafters/``), one per known target."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


#: target short name -> folder (under ``hf_treespec/assets_data/drafters``) of the drafter trained for it
SHIPPED_DRAFTERS: dict[str, str] = {"smollm2-135m-instruct": "smollm2-135m-instruct"}


def shipped_drafter_path(target: str = "smollm2-135m-instruct") -> Path:
    """Folder (Hub layout: config.json, model.safetensors, README.md; delay_selector/ for tree_policy="nde") of the
    drafter shipped for ``target``."""
    from importlib import resources

    if target not in SHIPPED_DRAFTERS:
        raise ValueError(f"no drafter ships for {target!r}; shipped: {sorted(SHIPPED_DRAFTERS)}. Train one with "
                         "`hf-treespec train ...` and load it with AutoModel.from_pretrained(folder).")
    folder = Path(str(resources.files("hf_treespec") / "assets_data" / "drafters" / SHIPPED_DRAFTERS[target]))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the shipped drafter folder {folder} is missing its config.json; reinstall "
                                "hf-treespec (the wheel carries it as package data).")
    return folder


def shipped_delay_selector_path(target: str = "smollm2-135m-instruct") -> Path:
    """Folder of the NDE delay selector trained for the drafter shipped for ``target`` (inside that drafter's folder,
    which is where ``tree_policy="nde"`` looks when no ``tree_selector`` is given)."""
    from ..policies.nde_selector import SELECTOR_SUBFOLDER

    folder = shipped_drafter_path(target) / SELECTOR_SUBFOLDER
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the shipped drafter for {target!r} carries no delay selector ({folder} is missing); "
                                "reinstall hf-treespec, or train one with `hf-treespec train nde-data` and "
                                "`hf-treespec train nde`.")
    return folder


def default_drafter(model: PreTrainedModel, target: str = "smollm2-135m-instruct",
                    dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The feature drafter shipped for ``target``, tied to ``model``'s embeddings / LM head, ready for
    ``model.generate(..., assistant_model=drafter, tree_policy="salf")``; its bundled delay selector serves
    ``tree_policy="nde"``. ``dtype`` defaults to the model's."""
    from ..drafters.feature import TreeSpecDrafterModel

    drafter = TreeSpecDrafterModel.from_pretrained(shipped_drafter_path(target), dtype=dtype or model.dtype)
    return drafter.tie_to_target(model).to(model.device).eval()
