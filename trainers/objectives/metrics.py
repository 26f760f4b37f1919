"""`MetricsMixin`: per-mode running sums of training metrics, averaged into the Trainer's logs at each log step.

Both the drafter trainers and the NDE trainer report item-weighted means (a metric is a ``(sum, count)`` pair per
micro-batch, so batches of different sizes weigh by their items, and gradient accumulation does not skew them).
Under several processes the pairs are summed over all of them before the means are taken.

The sums and counts may be device tensors: they are added up where they live and read to the host once per log step
(one transfer for all metrics), so recording a micro-batch's metrics never makes the host wait for a GPU.
"""

from __future__ import annotations

from collections import defaultdict
from numbers import Number

import torch


class MetricsMixin:
    """Mix in before ``transformers.Trainer``; call :meth:`record` from ``compute_loss``."""

    def _metric_store(self) -> dict[str, dict[str, list]]:
        if not hasattr(self, "_metrics"):
            self._metrics = {"train": defaultdict(lambda: [0.0, 0]), "eval": defaultdict(lambda: [0.0, 0])}
        return self._metrics

    def record(self, model: torch.nn.Module, metrics: dict[str, tuple[Number, Number]]) -> None:
        """Adds one micro-batch's ``{name: (sum, count)}`` (numbers or 0-dim tensors) to the current mode's (train /
        eval) running sums, without reading device tensors."""
        store = self._metric_store()["train" if model.training else "eval"]
        for key, (total, count) in metrics.items():
            entry = store[key]
            entry[0], entry[1] = entry[0] + total, entry[1] + count

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the current mode's metrics since the last log. With several processes (``accelerate launch``,
        ``torchrun``) the sums and counts of every process are added up first, so the logged means are over the
        global batch, as in a single-process run; the Trainer calls ``log`` on every process at the same steps."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        store = self._metric_store()[mode]
        totals = to_host({key: tuple(value) for key, value in store.items()})
        store.clear()
        if self.args.world_size > 1:
            totals = reduce_totals(totals)
        for key, (total, count) in totals.items():
            if count:
                logs[prefix + key] = round(total / count, 4)
        super().log(logs, start_time)


class BatchMetrics(dict):
    """One micro-batch's metrics ``{name: [sum, count]}``, accumulated where the values live (nothing is read to the
    host). ``deepest`` is the deepest token depth the batch can hold: per-depth metrics get one slot per depth up to
    it, so the depths present need not be read."""

    def __init__(self, deepest: int = 1):
        super().__init__()
        self.deepest = deepest

    def add(self, name: str, values: torch.Tensor, count: torch.Tensor | int | None = None) -> None:
        """Adds ``values``' sum and count (its size, or ``count`` when ``values`` is already a sum)."""
        total, seen = self.get(name, (0.0, 0))
        self[name] = [total + values.detach().sum(), seen + (values.numel() if count is None else count)]

    def add_by_depth(self, name: str, values: torch.Tensor, depth: torch.Tensor) -> None:
        """Adds ``values`` per token depth (1 = the first drafted token) as ``<name>_d<depth>``; depths the batch did
        not reach get a zero count and are not logged."""
        sums = values.new_zeros(self.deepest + 1, dtype=torch.float32).index_add_(0, depth, values.detach().float())
        counts = depth.new_zeros(self.deepest + 1).index_add_(0, depth, torch.ones_like(depth))
        for d in range(1, self.deepest + 1):
            self.add(f"{name}_d{d}", sums[d], counts[d])


def to_host(totals: dict[str, tuple[Number, Number]]) -> dict[str, tuple[float, float]]:
    """``{name: (sum, count)}`` as Python numbers, the device tensors among them read in one transfer."""
    tensors = [value for pair in totals.values() for value in pair if isinstance(value, torch.Tensor)]
    read = iter(torch.stack([t.detach().double() for t in tensors]).tolist() if tensors else [])
    return {key: tuple(next(read) if isinstance(value, torch.Tensor) else float(value) for value in pair)
            for key, pair in totals.items()}


def reduce_totals(totals: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """``{name: (sum, count)}`` added up over all processes (a process may lack some names, e.g. a tree depth its
    batches did not reach); a collective: every process must call it."""
    from accelerate.utils import gather_object

    merged: dict[str, tuple[float, int]] = {}
    for part in gather_object([totals]):
        for key, (total, count) in part.items():
            old_total, old_count = merged.get(key, (0.0, 0))
            merged[key] = (old_total + total, old_count + count)
    return {key: merged[key] for key in sorted(merged)}
