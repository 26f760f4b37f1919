"""`enable(model)`: ``model.generate(..., tree_policy=...)`` without spelling out ``custom_generate=tree_generate``."""

from __future__ import annotations

import functools
import types

import torch
from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .config import add_tree_kwargs
from .entry import tree_generate


def _tree_aware_generate(self, *args, **kwargs):
    """Instance-level ``generate``: stock ``generate`` plus ``custom_generate=tree_generate`` when a tree policy is
    set (in the call or on the generation config); exactly stock ``generate`` otherwise."""
    config = kwargs.get("generation_config") or self.generation_config
    policy = kwargs["tree_policy"] if "tree_policy" in kwargs else getattr(config, "tree_policy", None)
    if policy is None or kwargs.get("custom_generate") is not None:
        return type(self).generate(self, *args, **kwargs)
    # generate hands a callable neither the drafter, the streamer nor the tokenizer: bind the first two, and turn
    # stop strings into the stopping criterion generate would have built from the tokenizer
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if stop_strings is not None and tokenizer is not None:
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer, [stop_strings] if isinstance(stop_strings, str) else stop_strings))
        kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None
    # the drafter goes to the loop only: named to generate it would select transformers' assisted mode, which refuses
    # num_return_sequences > 1 before the loop runs (tree speculation decodes the expanded batch row by row)
    kwargs["custom_generate"] = functools.partial(
        tree_generate, assistant_model=kwargs.pop("assistant_model", None), streamer=kwargs.get("streamer")
    )
    return type(self).generate(self, *args, **kwargs)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Lets ``model.generate`` take the tree kwargs directly (in place, idempotent) and returns the model.

    Sugar over the public hook: it gives the instance a ``generate`` that adds ``custom_generate=tree_generate`` when
    ``tree_policy`` is set, and declares the tree kwargs on ``model.generation_config`` (None). The model's class is
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
