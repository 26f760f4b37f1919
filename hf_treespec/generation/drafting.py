"""`draft_trees`: every row of a batch grows its own tree, and the rows' draft forwards run as ONE drafter forward per
round (`Drafter.expand_rows`).

A policy's growth (`TreePolicy.grow`) is a generator: it yields each draft request and receives the answer, so the
rows advance in rounds with no threads. A round advances every row still growing, in row order, to its next
`LogprobsRequest` (a fast-path request, or any other kind, is answered at once from that row's own source), then one
``expand_rows`` call answers every row's pending request, each answer warped by that row's logits processors exactly
as `WarpedDraftSource.logprobs` warps it. A row whose growth returns leaves the later rounds. Rows advance in row
order, so Python state changes and random draws happen in the same order on every run (a seeded run reproduces).
Only the draft forward is batched: the policies' own bookkeeping stays per row, as their rules are per tree. A batch
of one is a batch: the same rounds, one row each.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policies.base import LogprobsRequest, TreePolicy, grow_in_rounds
from ..randomness import Randomness
from ..step_context import StepContext
from ..tree import DraftTree
from .draft_source import WarpedDraftSource


@dataclass
class DraftRound:
    """One step's drafting for every row of a batch.

    Attributes:
        trees: each row's tree (the root alone where its policy drafted nothing).
        shapes: the ``(k, l)`` each row's policy chose (`Draft.shape`; None where it chose none), for `StepOutcome`.
        rounds: drafter forwards run: the rounds of the batch, counting the fast-path calls a row answered on its
            own (for one row, every draft call it made).
    """

    trees: list[DraftTree]
    shapes: list[tuple[int, int] | None]
    rounds: int

    @classmethod
    def draft_free(cls, contexts: list[StepContext]) -> "DraftRound":
        """Every row's root alone, no drafter forward (a step where no tree could pay)."""
        return cls([DraftTree.root(context.root_token) for context in contexts], [None] * len(contexts), 0)


def draft_trees(policy: TreePolicy, sources: list[WarpedDraftSource], contexts: list[StepContext],
                generator: Randomness = None) -> DraftRound:
    """Every row's tree from ``policy`` (one growth per row, rooted at ``contexts[i]``), the rows' draft forwards
    joined into one ``expand_rows`` call per round. The rows' drafters wrap the same model (one adapter type)."""
    if len(sources) != len(contexts):
        raise ValueError(f"draft_trees needs one source per context, got {len(sources)} and {len(contexts)}.")
    before = [source.num_forwards for source in sources]

    def answer_alone(row: int, request):
        """Fast paths and other requests from the row's own source; a `LogprobsRequest` waits for the round."""
        return None if type(request) is LogprobsRequest else request.answer(sources[row])

    def answer_round(rows: list[int], requests: list[LogprobsRequest]) -> list:
        logits = type(sources[rows[0]].drafter).expand_rows(
            [(sources[row].drafter, request.tree, request.nodes) for row, request in zip(rows, requests)])
        return [sources[row].warp(request.tree, request.nodes, raw)
                for row, request, raw in zip(rows, requests, logits)]

    growths = [policy.grow(context.root_token, context=context, capabilities=source.capabilities,
                           generator=generator) for source, context in zip(sources, contexts)]
    drafts = grow_in_rounds(growths, answer_round, answer_alone)
    return DraftRound(
        trees=[draft.tree for draft in drafts],
        shapes=[draft.shape for draft in drafts],
        rounds=max((source.num_forwards - count for source, count in zip(sources, before)), default=0),
    )
