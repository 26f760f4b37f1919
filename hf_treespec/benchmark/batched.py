"""``hf-treespec bench --batch-size 1,4,16``: total tokens/s of batched ``generate`` per method and batch size.

The questions are cut into consecutive batches of B prompts (the last one may be smaller), left-padded as
transformers requires for decoder-only batched generation, and every method generates the same batches; methods are
interleaved per batch so drift on a noisy machine hits them alike. A method's throughput is the real tokens it
generated (up to each row's EOS / length) over its summed wall time; its speedup is that over plain batched
``generate``'s in the same run (and over plain decoding through the method's compiled step, ``plain@compile=true`` or
``plain@compile=openvino``, when the run has that row: `compiled_reference`). Greedy rows are checked token for
token against plain decoding through the same forward: plain batched ``generate`` for eager methods, the plain row of
the method's compile backend for compiled ones (eager plain counted beside).
transformers' assisted generation refuses batches, so only ``plain`` and ``tree:<policy>`` methods run here.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from ..cost.hardware import detect
from ..cost.timing import sync
from .methods import BenchMethod, PlainGenerate, TreeMethod
from .results import BASELINE, COMPILED_BASELINE, identity_reference, identity_text, plain_reference

__all__ = ["BatchRow", "run_batched", "left_pad", "write_batched_report"]


@dataclass
class BatchRow:
    """One (method, batch size): totals over every batch of the run."""

    method: str
    batch_size: int
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # target forwards after the prefill, summed over batches (tree methods)
    row_steps: int = 0  # per-row commits, summed (tau = tokens / row_steps, prefill token excluded)
    identical_rows: int | None = None  # greedy: rows equal to plain decoding's through the same forward
    identical_eager_rows: int | None = None  # greedy, compiled methods: rows equal to eager plain `generate`'s
    rows: int = 0
    speedup: float | None = None
    speedup_compiled: float | None = None  # over `compiled_reference`'s tokens/s (None when the run has no such row)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return (self.tokens - self.rows) / self.row_steps if self.row_steps else None

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "batch_size": self.batch_size, "tokens": self.tokens,
                "seconds": round(self.seconds, 3), "tokens_per_second": round(self.tokens_per_second, 2),
                "speedup": None if self.speedup is None else round(self.speedup, 3),
                "speedup_compiled": None if self.speedup_compiled is None else round(self.speedup_compiled, 3),
                "tau": None if self.tau is None else round(self.tau, 3), "rows": self.rows,
                "identical_rows": self.identical_rows, "identical_eager_rows": self.identical_eager_rows}


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, L_i]`` prompts -> left-padded ``input_ids`` and ``attention_mask`` ``[B, max L_i]``."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - prompt.shape[1]:] = prompt[0]
        mask[i, width - prompt.shape[1]:] = 1
    return ids, mask


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos: set[int], pad_id: int) -> list[torch.Tensor]:
    """Each row's new tokens up to and including its first EOS (the padding after it removed)."""
    rows = []
    for row in sequences[:, prompt_width:].cpu():
        stops = [i for i, t in enumerate(row.tolist()) if t in eos]
        rows.append(row[: stops[0] + 1] if stops else row)
    return rows


def _run_once(method: BenchMethod, model, ids, mask, drafter, gen_kwargs) -> tuple[Any, float]:
    kwargs = method.call_kwargs(drafter, gen_kwargs)
    with method.prepared(drafter):
        ids, mask = ids.to(model.device), mask.to(model.device)
        sync(model.device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        sync(model.device)
    return out, time.perf_counter() - start


def run_batched(methods: list[BenchMethod], model, drafters: dict[str, Any], prompts: list[torch.Tensor],
                batch_sizes: list[int], gen_kwargs: dict[str, Any], *, pad_id: int, eos: set[int], seed: int = 0,
                repeats: int = 1, progress: bool = True, greedy: bool = True,
                on_batch_size: Callable[[list[BatchRow]], None] | None = None) -> list[BatchRow]:
    """Every method on every batch of every batch size; returns one `BatchRow` per (method, batch size).
    ``on_batch_size`` gets the rows so far after each batch size, so a long run can write partial reports."""
    usable = [m for m in methods if isinstance(m, (PlainGenerate, TreeMethod))]
    if not usable or not isinstance(usable[0], PlainGenerate):
        raise ValueError("a batched benchmark needs plain first and tree:<policy> methods (transformers' assisted "
                         "generation refuses batches).")
    out_rows = []
    total = sum((len(prompts) + b - 1) // b for b in batch_sizes) * len(usable) * repeats
    bar = tqdm(total=total, desc="bench batches", unit="batch", disable=not progress)
    try:
        for batch_size in batch_sizes:
            results = {m.name: BatchRow(m.name, batch_size) for m in usable}
            for start in range(0, len(prompts), batch_size):
                ids, mask = left_pad(prompts[start : start + batch_size], pad_id)
                batch_rows: dict[str, list[torch.Tensor]] = {}
                others = usable[1:]
                shift = (start // batch_size) % max(len(others), 1)
                # plain first on every batch (its rows are the identity reference); the others rotate. Repeats go
                # round the methods, so a noisy stretch of the machine falls on every method, not on one
                order = [usable[0]] + others[shift:] + others[:shift]
                times: dict[str, list[float]] = {method.name: [] for method in order}
                outs: dict[str, Any] = {}
                for _ in range(repeats):
                    for method in order:
                        torch.manual_seed(seed + start)
                        out, seconds = _run_once(method, model, ids, mask, drafters.get(method.name), gen_kwargs)
                        times[method.name].append(seconds)
                        outs[method.name] = out
                        bar.set_postfix_str(f"B={batch_size} {method.name}", refresh=False)
                        bar.update()
                for method in order:
                    out = outs[method.name]
                    rows = generated_tokens(out.sequences, ids.shape[1], eos, pad_id)
                    record = results[method.name]
                    record.tokens += sum(int(r.numel()) for r in rows)
                    record.seconds += statistics.median(times[method.name])
                    record.rows += len(rows)
                    if getattr(out, "row_accepted_lengths", None) is not None:
                        record.row_steps += sum(len(r) for r in out.row_accepted_lengths)
                    elif getattr(out, "accepted_lengths", None) is not None:
                        record.row_steps += len(out.accepted_lengths)
                    batch_rows[method.name] = rows
                if greedy:
                    _count_identical(usable, batch_rows, results)
            plain = results[usable[0].name]
            for method in usable:
                record = results[method.name]
                record.speedup = record.tokens_per_second / plain.tokens_per_second if plain.seconds else None
                compiled = results.get(compiled_reference(method.compile_backend))
                if compiled is not None and compiled.seconds:
                    record.speedup_compiled = record.tokens_per_second / compiled.tokens_per_second
            out_rows.extend(results.values())
            if on_batch_size is not None:
                on_batch_size(list(out_rows))
    finally:
        bar.close()
    return out_rows


def compiled_reference(backend: str | None) -> str:
    """The compiled plain row a method's ``speedup_compiled`` is over: plain decoding through the method's own
    compiled step (``plain@compile=openvino`` for an OpenVINO row), `COMPILED_BASELINE` for an inductor or eager one."""
    return COMPILED_BASELINE if backend in (None, "inductor") else plain_reference(backend)


def _count_identical(methods: list[BenchMethod], batch_rows: dict[str, list[torch.Tensor]],
                     results: dict[str, BatchRow]) -> None:
    """Adds one batch's identical rows to every method's counts: against plain decoding through the same forward
    (``plain@compile=true`` for compiled methods when the run has it, else plain batched ``generate``)."""
    def same(rows, reference):
        return sum(torch.equal(a, b) for a, b in zip(rows, reference))

    for method in methods[1:]:
        rows, record = batch_rows[method.name], results[method.name]
        reference = identity_reference(method.name, method.compile_backend, batch_rows)
        record.identical_rows = (record.identical_rows or 0) + same(rows, batch_rows[reference])
        if reference != BASELINE:
            record.identical_eager_rows = (record.identical_eager_rows or 0) + same(rows, batch_rows[BASELINE])


def write_batched_report(rows: list[BatchRow], settings: dict[str, Any], folder: str | Path,
                         echo: bool = True) -> Path:
    """``batched.md`` (table), ``batched.json`` and ``batched.png`` (speedup vs batch size per method)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    versus = any(r.speedup_compiled is not None for r in rows)
    lines = [
        f"hardware: {settings.get('hardware', '')}",
        f"dtype {settings.get('dtype')}, {settings.get('num_questions')} questions x {settings.get('max_new_tokens')} "
        f"new tokens, {'greedy' if settings.get('greedy') else 'sampled'}, median of {settings.get('repeats', 1)} "
        f"repeat(s); {settings.get('date', '')}, commit {settings.get('commit')}",
        "",
        "| batch | method | tokens/s | speedup vs plain batched |" + (" vs compiled plain batched |" if versus else "")
        + " tau | rows identical to plain |",
        "|---:|---|---:|---:|" + ("---:|" if versus else "") + "---:|---:|",
    ]
    for row in rows:
        identical = "" if row.identical_rows is None else identity_text(row.identical_rows, row.rows,
                                                                          row.identical_eager_rows)
        tau = "" if row.tau is None else f"{row.tau:.2f}"
        compiled = "" if not versus else (f" {row.speedup_compiled:.2f}x |" if row.speedup_compiled is not None
                                          else " |")
        lines.append(f"| {row.batch_size} | {row.method} | {row.tokens_per_second:.1f} | {row.speedup:.2f}x |{compiled}"
                     f" {tau} | {identical} |")
    table = "\n".join(lines) + "\n"
    if versus:
        table += ("\nvs compiled plain batched: over plain decoding through the row's own compiled step "
                  "(`plain@compile=openvino` for `@compile=openvino` rows), else over `plain@compile=true`.\n"
                  "identical: rows equal to plain decoding's through the same forward (`plain@compile=true` for "
                  "`@compile=true` rows, eager plain batched `generate` beside it); a greedy near-tie can round either "
                  "way between eager and compiled kernels.\n")
    (folder / "batched.md").write_text(table)
    (folder / "batched.json").write_text(json.dumps({"settings": settings, "rows": [r.as_dict() for r in rows]},
                                                    indent=1))
    _plot(rows, folder / "batched.png")
    if echo:
        print(table)
    return folder


def _plot(rows: list[BatchRow], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra brings matplotlib; the table and JSON are written without it
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r.method for r in rows):
        points = sorted((r.batch_size, r.speedup) for r in rows if r.method == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s vs plain batched generate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def batch_settings(config, model, num_questions: int) -> dict[str, Any]:
    import transformers

    return {"hardware": detect(next(model.parameters()).device).describe(), "dtype": config.resolved_dtype,
            "num_questions": num_questions,
            "max_new_tokens": config.max_new_tokens, "greedy": config.greedy, "threads": config.threads,
            "repeats": config.repeats, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": config.model, "drafter": config.drafter}


def run_batched_benchmark(config, batch_sizes: list[int], on_batch_size: Callable[[list[BatchRow], dict[str, Any]], None]
                          | None = None) -> tuple[list[BatchRow], dict[str, Any]]:
    """Loads what ``config`` names (as ``run_benchmark`` does) and measures every batch size; ``on_batch_size`` gets
    the rows so far and the settings after each batch size."""
    from .runner import (
        build_prompt, fitting_prompts, load_benchmark_questions, load_drafter, load_model, method_drafters,
        plan_methods, shared_generate_kwargs, source_commit, torch_threads,
    )

    config.validate()
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-size takes batch sizes >= 1, got {batch_sizes}.")
    model, tokenizer = load_model(config.model, config.resolved_dtype, config.resolved_device)
    model.eval()
    drafter = load_drafter(config.drafter, model, config.resolved_dtype, target_name=config.model) \
        if config.drafter else None
    questions = load_benchmark_questions(config)
    prompts = [build_prompt(tokenizer, q) for q in questions]
    questions, prompts = fitting_prompts(questions, prompts, config.max_prompt_tokens, config.num_questions)
    methods, _ = plan_methods(config)
    skipped = [m.name for m in methods if not isinstance(m, (PlainGenerate, TreeMethod))]
    methods = [m for m in methods if isinstance(m, (PlainGenerate, TreeMethod))]
    gen_kwargs = shared_generate_kwargs(config, model, tokenizer)
    pad_id = gen_kwargs.get("pad_token_id", model.generation_config.pad_token_id)
    if pad_id is None:
        raise ValueError("a batch needs a padding id: the tokenizer has neither pad_token_id nor eos_token_id.")
    eos = model.generation_config.eos_token_id
    eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    drafters = method_drafters(methods, drafter, model, config)
    with torch_threads(config.threads):
        # untimed, at every batch size to be timed: first-use costs (auto's cost-curve calibration, lazy inits, and a
        # compiled method's graphs, which differ between a batch of one and a larger batch)
        for size in sorted({min(b, len(prompts)) for b in batch_sizes}):
            warm_ids, warm_mask = left_pad(prompts[:size], int(pad_id))
            for method in methods:
                _run_once(method, model, warm_ids, warm_mask, drafters.get(method.name),
                          {**gen_kwargs, "max_new_tokens": min(8, config.max_new_tokens)})
        settings = batch_settings(config, model, len(prompts))
        settings.update(batch_sizes=batch_sizes, commit=source_commit())  # the code that runs, read before it runs
        if skipped:
            settings["skipped"] = {name: "transformers' assisted generation refuses batches" for name in skipped}
        report = None if on_batch_size is None else (lambda rows_so_far: on_batch_size(rows_so_far, settings))
        rows = run_batched(methods, model, drafters, prompts, batch_sizes, gen_kwargs, pad_id=int(pad_id), eos=eos,
                           seed=config.seed, repeats=config.repeats, progress=config.progress, greedy=config.greedy,
                           on_batch_size=report)
    return rows, settings
