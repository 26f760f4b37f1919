"""Stopping criteria over a chunk of tokens committed at once, as if they had come one by one."""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList


def tokens_before_stop(
    stopping_criteria: StoppingCriteriaList, extended: torch.Tensor, start: int, scores: tuple | None = None,
) -> tuple[bool, int]:
    """``extended`` ``[1, start + n]`` is a row's ids with ``n`` new tokens appended at ``start``. Every criterion
    sees every prefix ``extended[:, :start + i + 1]`` (with the scores up to that token when given), as in plain
    ``generate``; all verdicts are read back to the host in one copy. Returns (stopped, tokens to keep)."""
    count = extended.shape[1] - start
    verdicts = [
        stopping_criteria(extended[:, : start + i + 1], None if scores is None else scores[: len(scores) - count + i + 1])
        .any().reshape(1)
        for i in range(count)
    ]
    stops = torch.cat(verdicts).cpu()
    done = bool(stops.any())
    return done, (int(stops.int().argmax()) + 1 if done else count)
