"""`StepContext`: what the decoding loop knows at a step's root, handed to every policy's ``build``; `StepOutcome`:
what a verified step gave back, handed to the policy's ``observe``; `DecodingSetup`: what a generate call decodes
with, handed to the policy's ``setup`` once.

It lives beside `DraftTree` (not inside ``policies/`` or ``generation/``) because both sides use it: the loop in
``generation/`` fills one per step, policies read from it, and neither has to import the other's internals.

Most policies read only ``device``; a policy that picks its tree shape per step (the neural delay-and-branch
selector of the delayed-expansion paper) also reads the target's view of the last verified position and the
measured cost of draft and target forwards. Facts that cost something to gather are filled only when the policy
lists them in ``TreePolicy.context_needs`` (see `CONTEXT_NEEDS`); there is no global state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig

from .tree import DraftTree

if TYPE_CHECKING:
    from .budget import StepBudget
    from .drafters.base import Drafter

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
        budget: this step's size for an auto-sized policy (``tree_budget="auto"``), set by the loop's sizing for
            every step that drafts; None for a numeric budget (the policy's own).
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
    budget: "StepBudget | None" = None


@dataclass
class StepOutcome:
    """One verified step, reported to the policy (``TreePolicy.observe``), as transformers' candidate generators hear
    back through ``update_candidate_strategy``. A batch step is one outcome covering every row.

    Attributes:
        trees: the verified trees, one per row (a single sequence: one).
        accepted: each tree's accepted path (node indices, root first).
        contexts: the `StepContext` each tree was built from.
        width: rows per tree in the verification forward (the packed width; root included).
        context_length: committed tokens (a batch: the mean over rows).
        draft_seconds / verify_seconds: measured time of the step's drafting and of its target forward plus
            verification (0 when the loop was not timing).
        draft_rounds: drafter forwards run (a batch drafts every row in one forward per round).
        shapes: the ``(k, l)`` each row's policy chose for its tree (`Draft.shape`; None where it chose none).
        forward_seconds: the target forward alone (its inputs built), within ``verify_seconds``.
    """

    trees: list[DraftTree]
    accepted: list[torch.Tensor]
    contexts: list[StepContext]
    width: int
    context_length: int
    draft_seconds: float
    verify_seconds: float
    draft_rounds: int
    shapes: list[tuple[int, int] | None]
    forward_seconds: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens the step committed over all rows (accepted drafts + one target token per row)."""
        return sum(int(path.numel()) for path in self.accepted)


@dataclass
class DecodingSetup:
    """What one generate call decodes with, handed to the policy (``TreePolicy.setup``) and to the loop's sizing once
    before the first step.

    Attributes:
        target: the target model (state a policy learns across calls may live on it, per drafter and settings).
        drafter: the drafter adapter of the first row.
        temperature / top_p: as in `sampling_params`.
        batch: rows decoded together.
        compiled: the `hf_treespec.compiled.CompiledForward` the target's steps run through (None: eager); the cost
            curve trees are sized by is the one of that path.
    """

    target: torch.nn.Module
    drafter: "Drafter"
    temperature: float = 0.0
    top_p: float = 1.0
    batch: int = 1
    compiled: object | None = None


def sampling_params(generation_config: GenerationConfig) -> tuple[float, float]:
    """(temperature, top_p) as the selector sees them: (0, 1) for greedy decoding."""
    if not generation_config.do_sample:
        return 0.0, 1.0
    temperature = generation_config.temperature
    top_p = generation_config.top_p
    return float(1.0 if temperature is None else temperature), float(1.0 if top_p is None else top_p)
