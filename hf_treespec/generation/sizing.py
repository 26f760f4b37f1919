"""`TreeSizing`: the decoding loop's fourth component (beside drafter, policy and verifier) for
``tree_budget="auto"``.

It owns what sizing needs and the policy does not: the `SpeedModel` (measured step costs, the drafter's cost,
acceptance by draft score, the held sizes' measured throughput), the draft-or-not decision before each step, the
`StepBudget` each drafting row grows by (``StepContext.budget``: priced per expansion by `TreeSizer` until the
first drafting steps chose where `SizeLadder` starts, then a `HeldSize`), and the observation of every verified step.
A policy only reads its step's budget, so a policy written for numeric budgets is sized by the same rule, and the
trainers, which grow fixed-size trees, never build one.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..budget import is_auto
from ..cost.held_size import HeldSize
from ..cost.sizer import TreeSizer
from ..cost.speed_model import SpeedModel, speed_model_for
from ..policies.base import TreePolicy
from ..step_context import DecodingSetup, StepContext, StepOutcome
from ..tree import on_path


#: the draft scores and on-path flags of a step without draft nodes (never written to)
_NO_NODES = (torch.zeros(0), torch.zeros(0, dtype=torch.bool))


class TreeSizing:
    """Sizes every step of one generate call from a `SpeedModel` (kept on the target across calls)."""

    #: sizing learns from measured time: the loop's clock must run
    wants_timing = True

    def __init__(self, speed: SpeedModel):
        self.speed = speed
        self._step: TreeSizer | None = None  # the sizer `may_draft` built for the current step
        self._pending: StepOutcome | None = None  # the verified step whose host tail is still running
        self._held: HeldSize | None = None  # the size held this step (None: the step is priced or draft-free)
        self._drafted = False  # whether a drafted step of this call was observed (the first one is a warm-up)
        self._stepped = False  # whether any step of this call was observed (the first one is a warm-up)

    @classmethod
    def for_generation(cls, policy: TreePolicy, setup: DecodingSetup) -> "TreeSizing | None":
        """The sizing of a generate call whose policy was given ``tree_budget="auto"``; None for a numeric budget
        (the policy sizes its own trees). The speed model is the target's for this drafter object, this policy and
        these sampling settings; its cost curve is calibrated at first use for this batch size and forward (eager or
        compiled) and cached on disk per machine."""
        if not is_auto(policy.params.get("tree_budget")):
            return None
        assistant = getattr(setup.drafter, "model", setup.drafter)
        # per policy too: what a draft score predicts, and what a draft round costs, depend on how the policy grows
        # its trees (a sampled DySpec tree's scores are not SALF's); a shared model let one policy's trees size another's
        key = (type(setup.drafter).__name__, policy.name, setup.temperature, setup.top_p)
        speed = speed_model_for(setup.target, assistant, key, batch=setup.batch,
                                batched_drafting=setup.drafter.batches_rows, compiled=setup.compiled)
        return cls(speed)

    def may_draft(self, context_length: int) -> bool:
        """Whether a step at ``context_length`` drafts. Once the first priced steps chose where the ladder of
        measured sizes starts (`HeldSizes`), "size" and "probe" steps hold its size (size 0: a draft-free step; a
        probe always drafts); before that, whether some tree could beat a draft-free step (`TreeSizer.could_pay`,
        then priced per expansion). False: the step is a plain one and no policy runs."""
        mode = self.speed.step_mode(context_length)
        # a probe asks whether drafting pays again: at the best measured size, once the ladder has one
        self._held = self.speed.held.next(draft=mode == "probe") if mode in ("size", "probe") else None
        if self._held is not None:
            return self._held.max_nodes > 0  # the ladder's size 0: a draft-free step
        if mode in ("skip", "control"):  # no tree runs: pricing one (a TreeSizer) cost a tenth of a tiny step
            self._step = None
            return False
        sizer = TreeSizer(self.speed, context_length, mode=mode)
        self._step = sizer  # its mode and predicted costs serve the step's budgets (read once a step)
        return sizer.could_pay()

    def budget(self, context: StepContext) -> StepContext:
        """``context`` with this step's `StepBudget` for its row (one per row: it counts that row's expansions)."""
        length = int(context.context_length)
        if self._held is not None:
            context.budget = HeldSize(self._held.max_nodes, self._held.shape)
        else:
            context.budget = TreeSizer(self.speed, length) if self._step is None else self._step.for_row(length)
        return context

    def observe(self, outcome: StepOutcome) -> None:
        """One verified step, learnt from at `step_ended` (its host work after verification is part of its cost)."""
        self._pending = outcome

    def step_ended(self, other_seconds: float) -> None:
        """The pending step ended after ``other_seconds`` of host work past its verification (commits, emission):
        its costs, the acceptance of its draft scores, for a sampled shape the acceptance per depth of that shape,
        and the step's tokens and wall time for its held size (or, priced, the sizes it kept). A drafted step's tail
        (every row's path through the drafter, several tokens emitted) is longer than a draft-free one's: leaving it
        out made drafting look cheaper than it is, at batch 4 by enough to keep drafting where every tree lost."""
        outcome, self._pending = self._pending, None
        if outcome is None:
            return
        speed = self.speed
        # the call's first drafted step pays once for the drafter's forward over the whole prompt; its first step,
        # drafted or not, for whatever ran first in the call (a draft-free first step measured 23.8 ms at batch 4
        # on the OpenVINO step against 19 later, and as the one measured draft-free rate it let losing trees look
        # within noise of it)
        first_drafted = bool(outcome.draft_rounds) and not self._drafted
        warm_up = first_drafted or not self._stepped
        self._drafted, self._stepped = self._drafted or first_drafted, True
        if self._held is None and outcome.draft_rounds and self._step is not None and self._step.mode == "size":
            speed.held.record_priced([tree.num_nodes - 1 for tree in outcome.trees],
                                     Counter(outcome.shapes).most_common(1)[0][0])
        for shape, path in zip(outcome.shapes, outcome.accepted):
            if shape is not None:
                speed.depth_acceptance.observe(*shape, int(path.numel()) - 1)
        if outcome.width > 1:
            scores = torch.cat([tree.scores[1:] for tree in outcome.trees])
            paths = torch.cat([on_path(tree, path) for tree, path in zip(outcome.trees, outcome.accepted)])
        else:  # root-only trees: no draft node to learn from
            scores, paths = _NO_NODES
        speed.observe_step(
            tree_scores=scores, on_path=paths,
            rows=outcome.width, context=outcome.context_length, draft_seconds=outcome.draft_seconds,
            draft_forwards=outcome.draft_rounds, verify_seconds=outcome.verify_seconds, tokens=outcome.tokens,
            trees=len(outcome.trees), other_seconds=other_seconds,
            forward_seconds=outcome.forward_seconds if outcome.forward_seconds > 0 else None,
            held_size=None if self._held is None else self._held.max_nodes, warm_up=warm_up,
        )
