"""`StepContext`: what the decoding loop knows at a step's root, handed to every policy's ``build``.

It lives beside `DraftTree` (not inside ``policies/`` or ``generation/``) because both sides use it: the loop in
``generation/`` fills one per step, policies read from it, and neither has to import the other's internals.

Most policies read only ``device``; a policy that picks its tree shape per step (the neural delay-and-branch
selector of the delayed-expansion paper) also reads the target's view of the last verified position and the
measured cost of draft and target forwards. Facts that cost something to gather are filled only when the policy
lists them in ``TreePolicy.context_needs`` (see `CONTEXT_NEEDS`); there is no global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

#: optional facts a policy may ask the loop to gather (``TreePolicy.context_needs``):
#: ``"target_hidden"``: capture the target's pre-norm last hidden state (a forward hook on the last layer);
#: ``"latencies"``: time draft and target forwards (a device sync per timing point on a GPU);
#: ``"target_probs"``: the softmax of the target's processed row at the root's parent (a vocabulary-wide op per step).
CONTEXT_NEEDS = frozenset({"target_hidden", "latencies", "target_probs"})


@dataclass
class StepContext:
    """Root-level facts for one decoding step.

    Attributes:
        root_token: the step's root (the last committed token).
        device: where the drafter and target run (the tree itself is host bookkeeping; see `DraftTree`).
        context_length: committed tokens, the root included.
        temperature: sampling temperature (0 for greedy decoding).
        top_p: nucleus threshold (1 when off or greedy).
        target_probs: ``[V]`` warped target distribution at the root's parent (the last verified position), i.e. the
            distribution the root token was drawn from before any residual correction; filled only when the policy's
            ``context_needs`` has ``"target_probs"``.
        target_hidden: ``[H]`` pre-norm last-layer target hidden state at the root's parent; filled only when the
            policy's ``context_needs`` has ``"target_hidden"``.
        draft_seconds: running mean of one draft forward measured so far in this generation (None before any, and
            None unless the policy's ``context_needs`` has ``"latencies"`` or the caller asked for timings).
        target_seconds: running mean of one target tree forward (same conditions).
        speed: the generation's `SpeedModel` (cost curve, drafter cost, calibrated acceptance) when the policy sizes
            its tree by measured cost (``tree_budget="auto"``); None otherwise.
        shape: the (k, l) an auto-sized sampled policy chose for this step (set by the policy, read by the loop when
            it observes the step, so the acceptance of that k is learned); None otherwise.
    """

    root_token: int
    device: torch.device = torch.device("cpu")
    context_length: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    target_probs: torch.Tensor | None = None
    target_hidden: torch.Tensor | None = None
    draft_seconds: float | None = None
    target_seconds: float | None = None
    speed: object | None = None
    shape: tuple[int, int] | None = None


def sampling_params(generation_config: GenerationConfig) -> tuple[float, float]:
    """(temperature, top_p) as the selector sees them: (0, 1) for greedy decoding."""
    if not generation_config.do_sample:
        return 0.0, 1.0
    temperature = generation_config.temperature
    top_p = generation_config.top_p
    return float(1.0 if temperature is None else temperature), float(1.0 if top_p is None else top_p)
