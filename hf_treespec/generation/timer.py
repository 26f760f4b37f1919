"""`LoopTimer`: the decoding loop's timing, as an observer the loop notifies at its phase boundaries.

It turns the boundaries into what its readers use: the policy's running latencies (`StepContext.draft_seconds` /
``target_seconds``, when the policy asks for ``"latencies"``), each step's draft / verify seconds (`StepOutcome`) and
the totals of ``return_dict_in_generate``. Its clock syncs the device only when enabled (`Clock`): when the caller
wants the numbers or the policy reads them; otherwise every boundary costs nothing and every duration is 0.
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
        self.step_draft = self.step_verify = 0.0  # the last step's phases
        self._start = self._mark = self.clock.now()

    def drafting(self) -> None:
        """Drafting begins (a step's policies, or the drafters' prefill)."""
        self._mark = self.clock.now()

    def drafted(self, forwards: int) -> None:
        """Drafting ended after ``forwards`` drafter forwards; verification begins (building its inputs counts)."""
        now = self.clock.now()
        self.step_draft = now - self._mark
        self.draft_seconds += self.step_draft
        if self.latencies:
            self.draft_mean.add(self.step_draft, forwards)
        self._mark = now

    def target_ran(self) -> None:
        """The target's forward returned: its latency (from the end of drafting) feeds the policy's running mean."""
        if self.latencies:
            self.target_mean.add(self.clock.now() - self._mark)

    def verified(self) -> None:
        """The step's verification and cache commit ended."""
        self.step_verify = self.clock.now() - self._mark
        self.verify_seconds += self.step_verify

    @property
    def total_seconds(self) -> float:
        return self.clock.now() - self._start
