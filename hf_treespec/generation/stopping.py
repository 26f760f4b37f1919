"""Stopping criteria over a chunk of tokens committed at once, as if they had come one by one."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


def _max_length_stops(criterion: MaxLengthCriteria, extended: torch.Tensor, start: int) -> torch.Tensor | None:
    """An empty tensor when no prefix reaches the length (the usual case: no tensor op at all)."""
    end = extended.shape[1]
    if criterion.max_position_embeddings is not None and end > criterion.max_position_embeddings:
        return None  # transformers' own call, for its warning: `tokens_before_stop` falls back
    first = criterion.max_length - start - 1  # the first new token whose prefix is max_length long
    if first >= end - start:
        return torch.zeros(0, dtype=torch.bool)
    stops = torch.zeros(end - start, dtype=torch.bool)
    stops[max(first, 0) :] = True
    return stops


def _eos_stops(criterion: EosTokenCriteria, extended: torch.Tensor, start: int) -> torch.Tensor:
    return torch.isin(extended[0, start:], criterion.eos_token_id.to(extended.device)).cpu()


#: generate's criteria decided for every prefix of a chunk in one call (exact class -> function(criterion, extended
#: ids, start) returning a host bool per new token, an empty tensor for "none stops", or None to fall back)
FAST_CRITERIA: dict[type, Callable] = {MaxLengthCriteria: _max_length_stops, EosTokenCriteria: _eos_stops}


def _fast_stops(stopping_criteria: StoppingCriteriaList, extended: torch.Tensor, start: int) -> torch.Tensor | None:
    """Host bools per new token from `FAST_CRITERIA`, None when a criterion has no fast form."""
    if not all(type(criterion) in FAST_CRITERIA for criterion in stopping_criteria):
        return None
    stops = torch.zeros(extended.shape[1] - start, dtype=torch.bool)
    for criterion in stopping_criteria:
        verdict = FAST_CRITERIA[type(criterion)](criterion, extended, start)
        if verdict is None:
            return None
        if verdict.numel():
            stops |= verdict
    return stops


def tokens_before_stop(
    stopping_criteria: StoppingCriteriaList, extended: torch.Tensor, start: int, scores: tuple | None = None,
) -> tuple[bool, int]:
    """``extended`` ``[1, start + n]`` is a row's ids with ``n`` new tokens appended at ``start``. Every criterion
    sees every prefix ``extended[:, :start + i + 1]`` (with the scores up to that token when given), as in plain
    ``generate``; all verdicts are read back to the host in one copy. generate's length and EOS criteria are
    decided for the whole chunk at once (`FAST_CRITERIA`: ~20 tensor ops a row and step fewer). Returns (stopped,
    tokens to keep)."""
    count = extended.shape[1] - start
    stops = _fast_stops(stopping_criteria, extended, start)
    if stops is None:
        stops = torch.cat([
            stopping_criteria(extended[:, : start + i + 1],
                              None if scores is None else scores[: len(scores) - count + i + 1]).any().reshape(1)
            for i in range(count)
        ]).cpu()
    flags = stops.tolist()
    return (True, flags.index(True) + 1) if True in flags else (False, count)
