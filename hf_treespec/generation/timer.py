"""`LoopTimer`: the decoding loop's timing, as an observer the loop notifies at its phase boundaries.

It turns the boundaries into what its readers use: the policy's running latencies (`StepContext.draft_seconds` /
``target_seconds``, when the policy asks for ``"latencies"``), each step's draft / verify seconds (`StepOutcome`) and
the totals of ``return_dict_in_generate``, and the host time each step spends after its verification (``step_other``:
commits, emission, the next step's context), which the auto sizing adds to what the step cost. Its clock syncs the
device only when enabled (`Clock`): when the caller wants the numbers or the policy reads them; otherwise every
boundary costs nothing and every duration is 0.
"""

from __future__ import annotations

import torch

from ..cost.timing import Clock, RunningMean


class LoopTimer:
    """Phase boundaries in call order per step: `drafting`, `drafted`, `target_ran`, `verified`."""

    def __init__(self, device: torch.device, *, enabled: bool, latencies: bool):
        self.clock = Clock(device, enabled=enabled)
        self.latencies = latencies
        self.draft_mean, self.target_mean = RunningMean(), RunningMean()
        self.draft_seconds = self.verify_seconds = 0.0
        self.step_draft = self.step_forward = self.step_verify = self.step_other = 0.0  # the last step's phases
        self._start = self._mark = self.clock.now()
        self._verified_at: float | None = None

    def drafting(self) -> None:
        """Drafting begins (a step's policies, or the drafters' prefill); the previous step's tail ends."""
        self._mark = self.clock.now()
        self.step_other = self._tail(self._mark)

    def finished(self) -> None:
        """The decoding ended: the last step's tail ends."""
        self.step_other = self._tail(self.clock.now())

    def _tail(self, now: float) -> float:
        """Seconds from the last step's `verified` to ``now`` (0 when no step was verified since the last call)."""
        tail = 0.0 if self._verified_at is None else now - self._verified_at
        self._verified_at = None
        return tail

    def drafted(self, forwards: int) -> None:
        """Drafting ended after ``forwards`` drafter forwards; verification begins (building its inputs counts)."""
        now = self.clock.now()
        self.step_draft = now - self._mark
        self.draft_seconds += self.step_draft
        if self.latencies:
            self.draft_mean.add(self.step_draft, forwards)
        self._mark = now

    def target_ran(self) -> None:
        """The target's forward returned: its latency (from the end of drafting: building its inputs counts) is the
        step's ``step_forward`` and feeds the policy's running mean."""
        self.step_forward = self.clock.now() - self._mark
        if self.latencies:
            self.target_mean.add(self.step_forward)

    def verified(self) -> None:
        """The step's verification and cache commit ended."""
        self._verified_at = self.clock.now()
        self.step_verify = self._verified_at - self._mark
        self.verify_seconds += self.step_verify

    @property
    def total_seconds(self) -> float:
        return self.clock.now() - self._start
