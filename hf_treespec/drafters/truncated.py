"""Training-free self-drafter: the target's first k layers, final norm and LM head, sharing the weight tensors."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel


def truncated(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM of the same class that runs only the first ``num_layers`` decoder layers of ``model``.

    No weight is copied: embeddings, the kept layers, the final norm and the LM head are the target's own modules,
    so the drafter costs no memory and stays in sync if the target is modified.
    """
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(
            f"truncated() needs a decoder-only model with `model.layers` (Llama, Mistral, Qwen, ...); "
            f"got {type(model).__name__}."
        )
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be between 1 and {len(layers)}, got {num_layers}.")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        drafter = type(model)(config)
    drafter.model.embed_tokens = base.embed_tokens
    drafter.model.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    drafter.model.norm = base.norm
    drafter.model.rotary_emb = base.rotary_emb
    drafter.lm_head = model.lm_head
    drafter.generation_config = copy.deepcopy(model.generation_config)
    drafter.eval()
    return drafter
