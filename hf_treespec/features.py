"""Capture of target hidden states for feature drafters (EAGLE-style), with forward hooks instead of model edits.

The decoder layers are found through transformers' public API, not module names: ``model.get_decoder()`` holds one
``ModuleList`` of ``num_hidden_layers`` blocks (``model.layers`` in Llama, ``h`` in GPT-2 / Falcon, ``decoder.layers``
in OPT). Layer index ``i`` is the output of block ``i``; ``-1`` is the last block's output, i.e. the input of the final
norm (the pre-norm last state EAGLE-1 reads; ``hidden_states[-1]`` of ``output_hidden_states`` is *after* that norm).
The hooks live only inside a ``with`` block: no state is left on the model.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a decoder-only transformers model: the one ``ModuleList`` child of ``get_decoder()``
    with ``num_hidden_layers`` entries."""
    get_decoder = getattr(model, "get_decoder", None)
    config = getattr(model, "config", None)
    if get_decoder is None or config is None:
        raise ValueError(f"feature capture needs a transformers decoder model; got {type(model).__name__}.")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model: tree speculation and feature drafters need a "
            "decoder-only causal LM."
        )
    decoder = get_decoder()
    count = int(config.get_text_config(decoder=True).num_hidden_layers)
    lists = [child for child in decoder.children() if isinstance(child, nn.ModuleList) and len(child) == count]
    if len(lists) != 1:
        raise ValueError(
            f"cannot tell the decoder layers of {type(model).__name__} for feature capture: its decoder "
            f"({type(decoder).__name__}) has {len(lists)} module lists of num_hidden_layers={count} blocks, not one."
        )
    return lists[0]


@torch.no_grad()
def final_norm(model: nn.Module) -> nn.Module:
    """The module that turns the last block's output into the LM head's input (the final norm), found by one
    one-token probe forward rather than by name: the decoder's child fed exactly that tensor. ``nn.Identity()`` when
    the LM head reads the last block's output itself (no final norm)."""
    blocks = decoder_layers(model)
    head = model.get_output_embeddings()
    children = [c for c in model.get_decoder().children() if c is not blocks and not isinstance(c, nn.ModuleList)]
    seen: dict[str, object] = {}

    def last_output(module, args, output):
        seen["last"] = output[0] if isinstance(output, tuple) else output

    def fed(module, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        if x is not None and x is seen.get("last"):
            seen.setdefault("reader", module)

    handles = [blocks[-1].register_forward_hook(last_output)]
    handles += [m.register_forward_pre_hook(fed, with_kwargs=True) for m in (*children, head) if m is not None]
    try:
        device = next(model.parameters()).device
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    reader = seen.get("reader")
    if reader is None:
        raise ValueError(
            f"cannot find the final norm of {type(model).__name__}: no module of its decoder, nor its LM head, reads "
            "the last decoder layer's output directly."
        )
    return nn.Identity() if reader is head else reader


class CapturedStates:
    """Holds the tensors captured during one forward; ``hidden_states`` concatenates them on the last dim."""

    def __init__(self, num: int):
        self.parts: list[torch.Tensor | None] = [None] * num

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.joined()

    def joined(self, count: int | None = None) -> torch.Tensor:
        """The first ``count`` captured tensors (all with None) concatenated on the last dim: callers that capture
        extra layers after a drafter's (e.g. the pre-norm last state for a policy) take the drafter's part this way."""
        parts = self.parts[:count]
        if any(p is None for p in parts):
            raise RuntimeError("no forward ran inside capture_hidden_states")
        return torch.cat(parts, dim=-1)


@contextmanager
def capture_hidden_states(model: nn.Module, layers: Sequence[int]) -> Iterator[CapturedStates]:
    """Within the block, every forward of ``model`` stores the requested hidden states ``[B, T, H * len(layers)]``."""
    blocks = decoder_layers(model)
    holder = CapturedStates(len(layers))
    handles = []
    for slot, layer in enumerate(layers):
        def hook(module, args, output, slot=slot):
            holder.parts[slot] = output[0] if isinstance(output, tuple) else output
        handles.append(blocks[layer].register_forward_hook(hook))
    try:
        yield holder
    finally:
        for handle in handles:
            handle.remove()
