"""Capture of target hidden states for feature drafters (EAGLE-style), with forward hooks instead of model edits.

transformers 5.23 returns ``hidden_states[-1]`` *after* the final norm; EAGLE-1 wants the pre-norm state, EAGLE-3
three intermediate layers. Layer index ``-1`` means "input of the final norm" (pre-norm last layer); other indices are
outputs of ``model.model.layers[i]``. The hooks live only inside a ``with`` block: no state is left on the model.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(final norm, decoder layers) of a decoder-only transformers model."""
    base = getattr(model, "model", model)
    norm, layers = getattr(base, "norm", None), getattr(base, "layers", None)
    if norm is None or layers is None:
        raise ValueError(f"cannot find the decoder layers / final norm of {type(model).__name__} for feature capture")
    return norm, layers


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
def capture_hidden_states(model: torch.nn.Module, layers: Sequence[int]) -> Iterator[CapturedStates]:
    """Within the block, every forward of ``model`` stores the requested hidden states ``[B, T, H * len(layers)]``."""
    norm, blocks = decoder_parts(model)
    holder = CapturedStates(len(layers))
    handles = []
    for slot, layer in enumerate(layers):
        if layer == -1:
            def pre_hook(module, args, slot=slot):
                holder.parts[slot] = args[0]
            handles.append(norm.register_forward_pre_hook(pre_hook))
        else:
            def hook(module, args, output, slot=slot):
                holder.parts[slot] = output[0] if isinstance(output, tuple) else output
            handles.append(blocks[layer].register_forward_hook(hook))
    try:
        yield holder
    finally:
        for handle in handles:
            handle.remove()
