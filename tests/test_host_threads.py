"""`HostThreads`: draft-free steps on an engine with its own thread pool run torch's ops on one thread, and the
caller's thread count comes back when a step drafts or the call ends (errors included)."""

from __future__ import annotations

import pytest
import torch

from hf_treespec.compiled.host_threads import HostThreads


class _Engine:
    own_threads = True


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_an_engines_draft_free_steps_run_on_one_thread_and_drafting_gets_them_back(two_threads):
    with HostThreads(_Engine()) as threads:
        threads.narrow()
        assert torch.get_num_threads() == 1 and threads.narrowed
        threads.widen()
        assert torch.get_num_threads() == 2
        threads.narrow()
    assert torch.get_num_threads() == 2  # the end of the call gives them back


def test_an_error_gives_the_threads_back(two_threads):
    with pytest.raises(RuntimeError), HostThreads(_Engine()) as threads:
        threads.narrow()
        raise RuntimeError("a step failed")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("engine", [None, object()])
def test_without_an_engine_of_its_own_threads_nothing_changes(two_threads, engine):
    with HostThreads(engine) as threads:
        threads.narrow()
        assert torch.get_num_threads() == 2 and not threads.narrowed
