"""Wall-clock timing that costs a device sync only when someone asked for the numbers.

On a GPU, ``time.perf_counter`` around a kernel launch measures the launch, not the work: a timing point must wait
for the device (``torch.cuda.synchronize``), which stalls the host. The decoding loop therefore times only when the
caller wants timings (``return_dict_in_generate``, the benchmark) or a policy reads latencies
(``context_needs`` contains ``"latencies"``); otherwise its clock never syncs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def sync(device: torch.device | str | None) -> None:
    """Waits for the work queued on ``device`` (a no-op off CUDA)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """``now()``: seconds since an arbitrary origin, after a device sync when ``enabled``; 0.0 when disabled (so a
    disabled clock costs neither a sync nor a system call, and every duration it reports is 0)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled

    def now(self) -> float:
        if not self.enabled:
            return 0.0
        sync(self.device)
        return time.perf_counter()


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
