"""What a benchmark run produces: per-(method, question) records, per-method summaries and the whole result.

Its own module so that the runner (which fills these) and the report (which writes them) both import it and neither
imports the other.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

#: the method every speedup is measured against
BASELINE = "plain"
#: the second baseline, where a run has it: plain decoding through the same compiled target forward
COMPILED_BASELINE = "plain@compile=true"


def plain_reference(backend: str | None) -> str:
    """The plain row of a compile backend: `COMPILED_BASELINE` for inductor (``@compile=true``),
    ``plain@compile=<backend>`` for another (``openvino``), `BASELINE` for eager (None)."""
    if backend is None:
        return BASELINE
    return COMPILED_BASELINE if backend == "inductor" else f"plain@compile={backend}"


def identity_reference(method: str, backend: str | bool | None, names) -> str:
    """The run a method's greedy tokens are held to: plain decoding through the same forward, i.e. the plain row of
    its compile ``backend`` (True: inductor; `plain_reference`) when the run (``names``) has it, else `BASELINE`."""
    reference = plain_reference("inductor" if backend is True else backend or None)
    if method != reference and reference in names:
        return reference
    return BASELINE


def identity_text(identical: int, compared: int, eager: int | None = None) -> str:
    """``identical/compared``, and for a compiled method also counted against eager plain ``generate``
    (``eager``), `` (eager/compared vs eager)``."""
    text = f"{identical}/{compared}"
    return text if eager is None else f"{text} ({eager}/{compared} vs eager)"


@dataclass
class QuestionResult:
    """One (method, question): median wall time over repeats and the statistics of that median run."""

    method: str
    question_id: int | str
    category: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    all_seconds: list[float]
    target_forwards: int
    tau: float
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    draft_forwards: int | None = None
    mean_tree_size: float | None = None
    drafted_share: float | None = None  # steps that verified a draft tree / all steps (auto may skip drafting)
    accepted_lengths: list[int] | None = None  # tokens committed per verified step (accepted drafts + 1)
    identical: bool | None = None  # greedy: equal to plain decoding through the same forward (eager or compiled)
    divergence: dict[str, Any] | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    identical_eager: bool | None = None  # greedy, compiled methods: also equal to eager plain `generate`?


@dataclass
class MethodSummary:
    """Totals of one method over all questions; ratios against plain generate measured in the same run."""

    method: str
    base_method: str
    sweep_value: Any
    questions: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float | None
    tau: float
    draft_seconds: float | None
    verify_seconds: float | None
    other_seconds: float | None
    mean_tree_size: float | None
    drafted_share: float | None
    identical: int | None
    compared: int | None
    divergences: list[dict[str, Any]]
    #: entry d - 1: share of the verified steps (all questions) that accepted at least d draft tokens
    reached_depth: list[float] | None = None
    #: tokens/s over `COMPILED_BASELINE`'s in the same run (None when the run has no such row)
    speedup_compiled: float | None = None
    #: greedy, compiled methods: questions whose tokens also equal eager plain `generate`'s
    identical_eager: int | None = None
    #: wall time per new token (1000 / tokens_per_s)
    ms_per_token: float | None = None


@dataclass
class BenchmarkResult:
    settings: dict[str, Any]
    methods: list[str]
    records: list[QuestionResult]
    skipped: dict[str, str]
    sweep: tuple[str, list[Any]] | None = None
    sweep_methods: dict[str, tuple[str, Any]] = field(default_factory=dict)  # variant name -> (base method, value)

    def summaries(self) -> list[MethodSummary]:
        """One summary per method, in run order (sweep variants included)."""
        baseline = self._totals(BASELINE)
        compiled = self._totals(COMPILED_BASELINE) if COMPILED_BASELINE in self.methods else None
        return [self._summary(name, baseline, compiled) for name in self.methods]

    def _totals(self, method: str) -> tuple[int, float]:
        rows = [r for r in self.records if r.method == method]
        return sum(r.new_tokens for r in rows), sum(r.seconds for r in rows)

    def _summary(self, name: str, baseline: tuple[int, float], compiled: tuple[int, float] | None = None
                 ) -> MethodSummary:
        rows = [r for r in self.records if r.method == name]
        tokens, seconds = self._totals(name)
        rate = tokens / seconds if seconds > 0 else float("nan")
        base_rate = baseline[0] / baseline[1] if baseline[1] > 0 else None
        forwards = sum(r.target_forwards for r in rows)
        timed = [r for r in rows if r.draft_seconds is not None]
        draft = sum(r.draft_seconds for r in timed) if timed else None
        verify = sum(r.verify_seconds for r in timed) if timed else None
        sizes = [r.mean_tree_size for r in rows if r.mean_tree_size is not None]
        shares = [r.drafted_share for r in rows if r.drafted_share is not None]
        compared = [r for r in rows if r.identical is not None]
        base, value = self.sweep_methods.get(name, (name, None))
        return MethodSummary(
            method=name,
            base_method=base,
            sweep_value=value,
            questions=len(rows),
            new_tokens=tokens,
            seconds=seconds,
            tokens_per_s=rate,
            speedup=rate / base_rate if base_rate else None,
            tau=tokens / forwards if forwards else float("nan"),
            draft_seconds=draft,
            verify_seconds=verify,
            other_seconds=seconds - draft - verify if timed else None,
            mean_tree_size=statistics.fmean(sizes) if sizes else None,
            drafted_share=statistics.fmean(shares) if shares else None,
            identical=sum(r.identical for r in compared) if compared else None,
            compared=len(compared) if compared else None,
            divergences=[{"question_id": r.question_id, **r.divergence} for r in rows if r.divergence],
            reached_depth=reached_depth([n for r in rows for n in r.accepted_lengths or []]),
            speedup_compiled=rate * compiled[1] / compiled[0] if compiled and compiled[0] else None,
            identical_eager=(sum(r.identical_eager for r in rows)
                             if rows and all(r.identical_eager is not None for r in rows) else None),
            ms_per_token=1000 * seconds / tokens if tokens else None,
        )


def reached_depth(accepted_lengths: list[int]) -> list[float] | None:
    """Entry d - 1: share of steps that accepted at least d draft tokens (a step commits its accepted drafts plus
    one token of the target's), for d = 1 .. the deepest accepted; None without steps. Entry d over entry d - 1 is
    the acceptance at depth d given depth d - 1 was accepted (the delayed-expansion paper's Figure 1)."""
    if not accepted_lengths:
        return None
    drafts = [max(n - 1, 0) for n in accepted_lengths]
    return [round(sum(k >= d for k in drafts) / len(drafts), 4) for d in range(1, max(drafts) + 1)]
