"""`build_in_lockstep`: every row of a batch grows its own tree, and the rows' draft forwards run as ONE batched
forward per round (`Drafter.expand_rows`).

A policy's ``build`` is sequential code that calls ``source.logprobs`` whenever it needs a draft forward and uses the
answer at once; rewriting every policy as a state machine over the batch would duplicate each of them. Instead each
row's ``build`` runs on a thread of its own, used as a coroutine: the threads take turns with the caller, never two
at once, in row order, so Python state and random draws happen in the same order on every run (a seeded run
reproduces). A row runs until its next draft request (it posts the request and hands the turn back) or until its
tree is built; once every row still building has posted, one ``expand_rows`` call answers all of them and the rows
resume. Rows whose policy stops early drop out of later rounds. Only the draft forward is batched: the policies'
own bookkeeping stays per row, as their rules are per tree.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList

from ..drafters.base import Drafter
from ..policies.base import DraftSource
from ..tree import DraftTree
from .draft_source import WarpedDraftSource


class _Cancelled(Exception):
    """Raised inside a row's build when the round it waits for will never come (another row failed)."""


class _Turn:
    """The hand-over between one row's build thread and the caller: each side releases the other's semaphore."""

    def __init__(self) -> None:
        self.resume = threading.Semaphore(0)  # caller -> row
        self.paused = threading.Semaphore(0)  # row -> caller
        self.request: tuple[Drafter, DraftTree, torch.Tensor] | None = None
        self.answer: torch.Tensor | None = None
        self.tree: DraftTree | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.ended = False  # the row's thread returned (or never will build: cancelled)

    @property
    def finished(self) -> bool:
        return self.request is None


class LockstepDraftSource(WarpedDraftSource):
    """A row's draft source whose forwards are answered by the round's batched ``expand_rows``."""

    def __init__(self, drafter: Drafter, processors: LogitsProcessorList, prefix_ids: torch.Tensor):
        super().__init__(drafter, processors, prefix_ids)
        self.turn = _Turn()

    def raw_logits(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        turn = self.turn
        turn.request = (self.drafter, tree, nodes)
        turn.paused.release()
        turn.resume.acquire()
        if turn.cancelled:
            raise _Cancelled
        answer, turn.answer = turn.answer, None
        return answer


def build_in_lockstep(builds: list[Callable[[DraftSource], DraftTree]],
                      sources: list[LockstepDraftSource]) -> tuple[list[DraftTree], int]:
    """Runs ``builds[i](sources[i])`` for every row, batching their draft forwards; returns the trees and the number
    of batched draft rounds. An exception raised by any row's build is re-raised here, after every thread ended."""
    grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(build, source: LockstepDraftSource) -> None:
        turn = source.turn
        turn.resume.acquire()
        try:
            if turn.cancelled:
                return
            with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):  # thread-local modes
                turn.tree = build(source)
        except _Cancelled:
            pass
        except BaseException as error:  # handed to the caller, which re-raises it
            turn.error = error
        finally:
            turn.request, turn.ended = None, True
            turn.paused.release()

    threads = [threading.Thread(target=run, args=pair, daemon=True) for pair in zip(builds, sources)]
    for thread in threads:
        thread.start()
    waiting, rounds, error = list(sources), 0, None
    try:
        while waiting:
            for source in waiting:  # one row at a time, in row order
                source.turn.resume.release()
                source.turn.paused.acquire()
                if source.turn.error is not None:
                    raise source.turn.error
            waiting = [source for source in waiting if not source.turn.finished]
            if not waiting:
                break
            requests = [source.turn.request for source in waiting]
            answers = type(requests[0][0]).expand_rows(requests)
            rounds += 1
            for source, answer in zip(waiting, answers):
                source.turn.answer = answer
    except BaseException as raised:
        error = raised
    finally:
        for source in sources:  # rows parked in a request, or never started, end without building
            if not source.turn.ended:
                source.turn.cancelled = True
                source.turn.resume.release()
        for thread in threads:
            thread.join()
    if error is not None:
        raise error
    return [source.turn.tree for source in sources], rounds
