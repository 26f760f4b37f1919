"""`HostThreads`: torch's intra-op threads on the steps an engine with its own thread pool runs alone.

The OpenVINO step runs the target's forward on OpenVINO's threads. Between two forwards a draft-free step's host
work is a few small torch ops (the logits' argmax or draw, the next step's mask), and after each of them torch's
OpenMP workers spin for a while before they sleep, on the cores the engine's next forward needs. Run on one thread,
those ops leave the cores to the engine: plain decoding through the OpenVINO step ran 1.04x faster at batch 1 and
at batch 4 (2-core AMD EPYC, bf16; ``docs/results/compiled/host-threads``). A step that drafts keeps the caller's
threads: its drafter forwards and the verification of a tree's rows ran slower on one.
"""

from __future__ import annotations

import torch

#: torch threads while an engine runs draft-free steps
ENGINE_HOST_THREADS = 1


class HostThreads:
    """Narrows torch's intra-op threads to `ENGINE_HOST_THREADS` for draft-free steps when ``engine`` runs its
    forwards on its own threads (``engine.own_threads``), and gives the caller's count back (`widen`, or on leaving
    the ``with`` block, errors included). With no such engine it changes nothing."""

    def __init__(self, engine) -> None:
        self.active = bool(getattr(engine, "own_threads", False))
        self._caller = torch.get_num_threads()
        self.narrowed = False

    def narrow(self) -> None:
        """Draft-free steps from now on: one torch thread."""
        if self.active and not self.narrowed and self._caller > ENGINE_HOST_THREADS:
            torch.set_num_threads(ENGINE_HOST_THREADS)
            self.narrowed = True

    def widen(self) -> None:
        """A drafting step (or the end of the call): the caller's threads again."""
        if self.narrowed:
            torch.set_num_threads(self._caller)
            self.narrowed = False

    def __enter__(self) -> "HostThreads":
        return self

    def __exit__(self, *exc) -> None:
        self.widen()
