"""`StepContext`: what the decoding loop knows at a step's root, for policies that adapt the tree to it (``nde``).

Most policies need nothing but a draft source. A policy that picks its tree shape per step (the neural delay-and-
branch selector of the delayed-expansion paper) also reads the target's view of the last verified position and the
measured cost of draft and target forwards. A policy sized by measured cost (``tree_budget="auto"``) reads the
loop's `~hf_treespec.latency.SpeedModel`. The loop fills a fresh context per step and passes it to policies that set
``needs_step_context`` or ``auto_sized``; there is no global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig


@dataclass
class StepContext:
    """Root-level facts for one decoding step.

    Attributes:
        target_probs: ``[V]`` warped target distribution at the root's parent (the last verified position), i.e. the
            distribution the root token was drawn from before any residual correction.
        root_token: the step's root (the last committed token).
        context_length: committed tokens, the root included.
        temperature: sampling temperature (0 for greedy decoding).
        top_p: nucleus threshold (1 when off or greedy).
        target_hidden: ``[H]`` pre-norm last-layer target hidden state at the root's parent, None when not captured.
        draft_seconds: running mean of one draft forward measured so far in this generation (None before any).
        target_seconds: running mean of one target tree forward (None before the first step's verification).
        speed: the generation's `SpeedModel` (cost curve, drafter cost, calibrated acceptance) for policies sized
            by measured cost; None otherwise.

    ``target_probs`` is None when no policy of this generation reads it (auto-sized policies need only ``speed``).
    """

    target_probs: torch.Tensor | None
    root_token: int
    context_length: int
    temperature: float
    top_p: float
    target_hidden: torch.Tensor | None = None
    draft_seconds: float | None = None
    target_seconds: float | None = None
    speed: object | None = None


def sampling_params(generation_config: GenerationConfig) -> tuple[float, float]:
    """(temperature, top_p) as the selector sees them: (0, 1) for greedy decoding."""
    if not generation_config.do_sample:
        return 0.0, 1.0
    temperature = generation_config.temperature
    top_p = generation_config.top_p
    return float(1.0 if temperature is None else temperature), float(1.0 if top_p is None else top_p)


@dataclass
class RunningMean:
    """Mean of the timings seen so far (``None`` before the first)."""

    total: float = 0.0
    count: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        if count > 0:
            self.total += seconds
            self.count += count

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None
