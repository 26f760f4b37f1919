"""`enable(model)`: ``model.generate(..., tree_policy=...)`` without spelling out ``custom_generate=tree_generate``."""

from __future__ import annotations

import types

import torch
from transformers import GenerationMixin

from .binding import bind_drafter
from .config import add_tree_kwargs
from .entry import tree_generate


def _tree_aware_generate(self, *args, **kwargs):
    """Instance-level ``generate``: stock ``generate`` with ``custom_generate=tree_generate`` and the call's
    arguments bound by `bind_drafter` when a tree policy is set (in the call or on the generation config); exactly
    stock ``generate`` otherwise (transformers' own assisted generation included)."""
    config = kwargs.get("generation_config") or self.generation_config
    policy = kwargs["tree_policy"] if "tree_policy" in kwargs else getattr(config, "tree_policy", None)
    if policy is None or kwargs.get("custom_generate") is not None:
        return type(self).generate(self, *args, **kwargs)
    return type(self).generate(self, *args, custom_generate=tree_generate, **bind_drafter(self, kwargs))


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Lets ``model.generate`` take the tree kwargs directly (in place, idempotent) and returns the model.

    Sugar over the public hook: it gives the instance a ``generate`` that adds ``custom_generate=tree_generate`` when
    ``tree_policy`` is set (``assistant_model`` / ``streamer`` / ``tokenizer`` bound by
    `hf_treespec.generation.binding.bind_drafter`), and declares the tree kwargs on ``model.generation_config`` (None). The model's class is
    untouched, so ``save_pretrained`` / ``type(model)`` are those of the stock model.
    """
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"hf_treespec.enable expects a transformers generative model, got {type(model).__name__}.")
    if not is_enabled(model):
        model.generate = types.MethodType(_tree_aware_generate, model)
    add_tree_kwargs(model.generation_config)
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether :func:`enable` was applied to ``model``."""
    return getattr(model.__dict__.get("generate"), "__func__", None) is _tree_aware_generate
