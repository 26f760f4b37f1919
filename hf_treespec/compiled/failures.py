"""Why a compiler gave up, in one line: the compiled paths log it when they fall back (eager forward, bmm)."""

from __future__ import annotations


def failure_reason(error: BaseException) -> str:
    """The root cause of a compiler failure in one line (dynamo wraps a backend's error in BackendCompilerFailed)."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
