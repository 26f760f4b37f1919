"""`MetricsMixin`: per-mode running sums of training metrics, averaged into the Trainer's logs at each log step.

Both the drafter trainers and the NDE trainer report item-weighted means (a metric is a ``(sum, count)`` pair per
micro-batch, so batches of different sizes weigh by their items, and gradient accumulation does not skew them).
Under several processes the pairs are summed over all of them before the means are taken.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class MetricsMixin:
    """Mix in before ``transformers.Trainer``; call :meth:`record` from ``compute_loss``."""

    def _metric_store(self) -> dict[str, dict[str, list[tuple[float, int]]]]:
        if not hasattr(self, "_metrics"):
            self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        return self._metrics

    def record(self, model: torch.nn.Module, metrics: dict[str, tuple[float, int]]) -> None:
        """Adds one micro-batch's ``{name: (sum, count)}`` to the current mode's (train / eval) running sums."""
        store = self._metric_store()["train" if model.training else "eval"]
        for key, value in metrics.items():
            store[key].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the current mode's metrics since the last log. With several processes (``accelerate launch``,
        ``torchrun``) the sums and counts of every process are added up first, so the logged means are over the
        global batch, as in a single-process run; the Trainer calls ``log`` on every process at the same steps."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        store = self._metric_store()[mode]
        totals = {key: (sum(t for t, _ in values), sum(c for _, c in values)) for key, values in store.items()}
        store.clear()
        if self.args.world_size > 1:
            totals = reduce_totals(totals)
        for key, (total, count) in totals.items():
            if count:
                logs[prefix + key] = round(total / count, 4)
        super().log(logs, start_time)


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
