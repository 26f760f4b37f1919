"""Stopping criteria over a committed chunk: the one-call forms of generate's length and EOS criteria decide exactly
as transformers' own criteria called on every prefix."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria

from hf_treespec.generation.stopping import _fast_stops, tokens_before_stop


def per_prefix(criteria: StoppingCriteriaList, extended: torch.Tensor, start: int) -> tuple[bool, int]:
    """transformers' criteria on every prefix, one call each: the reference."""
    for i in range(extended.shape[1] - start):
        if bool(criteria(extended[:, : start + i + 1], None).any()):
            return True, i + 1
    return False, extended.shape[1] - start


@pytest.mark.parametrize("eos", [[2], [2, 5]])
def test_length_and_eos_in_one_call_match_every_prefix(eos):
    generator = torch.Generator().manual_seed(0)
    checked = stopped = 0
    for start, count, max_length in itertools.product([3, 6], [1, 2, 4], [4, 5, 7, 8, 20]):
        for _ in range(8):
            extended = torch.randint(0, 8, (1, start + count), generator=generator)
            criteria = StoppingCriteriaList([MaxLengthCriteria(max_length), EosTokenCriteria(eos)])
            assert _fast_stops(criteria, extended, start) is not None  # the fast form ran
            expected = per_prefix(criteria, extended, start)
            assert tokens_before_stop(criteria, extended, start) == expected
            checked, stopped = checked + 1, stopped + expected[0]
    assert 0 < stopped < checked  # both outcomes were exercised


def test_a_criterion_without_a_fast_form_runs_on_every_prefix():
    class StopAfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids[0, -1].item() == 3, dtype=torch.bool)

    criteria = StoppingCriteriaList([MaxLengthCriteria(50), StopAfterThree()])
    extended = torch.tensor([[1, 1, 7, 3, 9]])
    assert _fast_stops(criteria, extended, 2) is None
    assert tokens_before_stop(criteria, extended, 2) == (True, 2)


def test_past_the_position_limit_transformers_own_call_decides():
    """MaxLengthCriteria warns past max_position_embeddings: that chunk goes through transformers' call."""
    criteria = StoppingCriteriaList([MaxLengthCriteria(20, max_position_embeddings=6)])
    extended = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assert _fast_stops(criteria, extended, 5) is None
    assert tokens_before_stop(criteria, extended, 5) == (False, 3)
