"""`MetricsMixin`: per-mode running sums of training metrics, averaged into the Trainer's logs at each log step.

Both the drafter trainers and the NDE trainer report item-weighted means (a metric is a ``(sum, count)`` pair per
micro-batch, so batches of different sizes weigh by their items, and gradient accumulation does not skew them).
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
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        store = self._metric_store()[mode]
        for key, values in store.items():
            count = sum(c for _, c in values)
            if count:
                logs[prefix + key] = round(sum(t for t, _ in values) / count, 4)
        store.clear()
        super().log(logs, start_time)
