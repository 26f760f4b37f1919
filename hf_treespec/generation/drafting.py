"""`draft_trees`: every active row's draft tree for one step, the rows' draft forwards batched into rounds.

The loop's one call for drafting, whatever the batch size: one row runs its policy's ``build`` directly; several rows
run in lockstep (`lockstep.build_in_lockstep`: one `Drafter.expand_rows` forward answers every row's request of a
round).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..policies import TreePolicy
from ..step_context import StepContext
from ..tree import DraftTree
from .draft_source import WarpedDraftSource
from .lockstep import LockstepDraftSource, build_in_lockstep


@dataclass
class DraftRound:
    """What drafting handed to verification.

    Attributes:
        trees: one tree per row, root first.
        shapes: per row, the shape an auto-sized sampled policy chose for its tree (None where none was chosen).
        rounds: drafter forwards run (one forward drafts every row of a round).
    """

    trees: list[DraftTree]
    shapes: list[tuple[int, int] | None]
    rounds: int


def draft_trees(policy: TreePolicy, sources: list[WarpedDraftSource], contexts: list[StepContext],
                generator: torch.Generator | None = None) -> DraftRound:
    """Row ``i``'s tree from ``policy.build(sources[i], contexts[i].root_token, context=contexts[i])``, its draws
    from ``generator`` (None: torch's global generator), rows in order so a seeded run reproduces."""
    if len(sources) == 1:  # nothing to batch with: the row's policy runs directly, no thread
        tree = policy.build(sources[0], contexts[0].root_token, context=contexts[0], generator=generator)
        return DraftRound([tree], [None], sources[0].num_forwards)
    lockstep = [LockstepDraftSource(s.drafter, s.processors, s.prefix_ids) for s in sources]
    builds = [partial(policy.build, root_token=c.root_token, context=c, generator=generator) for c in contexts]
    trees, rounds = build_in_lockstep(builds, lockstep)
    return DraftRound(trees, [None] * len(trees), rounds)
