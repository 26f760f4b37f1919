"""`TreeSpecGenerationMixin`: routes ``generate`` to tree speculation when ``tree_policy`` is set, stock otherwise."""

from __future__ import annotations

import copy
import functools

import torch
from transformers import GenerationMixin

from .config import TREE_GENERATION_KWARGS, add_tree_kwargs
from .decoding import check_drafter, resolve, tree_speculative_decoding


class TreeSpecGenerationMixin:
    """Mixed in front of a model class by :func:`enable`. Without ``tree_policy`` nothing changes."""

    def generate(self, inputs=None, generation_config=None, *args, **kwargs):
        policy = kwargs.get("tree_policy", getattr(generation_config or self.generation_config, "tree_policy", None))
        if policy is not None:
            self._check_tree_request(inputs if inputs is not None else kwargs.get("input_ids"), generation_config,
                                     kwargs)
        return super().generate(inputs, generation_config, *args, **kwargs)

    def _check_tree_request(self, inputs, generation_config, kwargs) -> None:
        """Fails early, with advice, on requests that stock generate would reject obscurely or accept wrongly."""
        if inputs is not None and inputs.ndim == 2:
            if inputs.shape[0] != 1:
                raise ValueError(
                    f"tree speculation supports batch size 1 (got {inputs.shape[0]}); call generate per prompt."
                )
            if inputs.shape[1] == 0:
                raise ValueError("tree speculation needs a non-empty prompt (input_ids has length 0).")
        config = copy.deepcopy(generation_config or self.generation_config)
        for key in (*TREE_GENERATION_KWARGS, "do_sample", "num_beams"):
            if key in kwargs:
                setattr(config, key, kwargs[key])
        drafter = check_drafter(self, kwargs.get("assistant_model"))
        resolve(config, drafter)  # unknown names, bad budgets, verifier/regime mismatches

    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs):
        if getattr(generation_config, "tree_policy", None) is None:
            return super()._assisted_decoding(input_ids, logits_processor, stopping_criteria, generation_config,
                                              *args, **kwargs)
        for unused in ("synced_gpus", "inputs_tensor", "assistant_tokenizer", "tokenizer"):
            kwargs.pop(unused, None)
        return tree_speculative_decoding(
            self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs
        )


@functools.cache
def treespec_class(cls: type) -> type:
    """``TreeSpecGenerationMixin`` + ``cls``, keeping the name so ``save_pretrained`` writes the original architecture."""
    return type(cls.__name__, (TreeSpecGenerationMixin, cls), {"__module__": cls.__module__,
                                                                "_treespec_base_class": cls})


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Adds tree-speculative decoding to ``model.generate`` in place (idempotent) and returns the model."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"hf_treespec.enable expects a transformers generative model, got {type(model).__name__}.")
    if not isinstance(model, TreeSpecGenerationMixin):
        model.__class__ = treespec_class(type(model))
    add_tree_kwargs(model.generation_config)
    return model
