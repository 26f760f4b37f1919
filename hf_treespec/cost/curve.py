"""`CostCurve`: seconds of one target verification with ``n`` rows (root included) over ``context`` cached tokens.

Measured once per (model, dtype, device, threads, eager or compiled, batch size) by `calibrate_target` (a few
seconds; the median of repeated timings per point), cached as JSON under `hf_treespec.paths.cost_cache_dir`
(`load_or_calibrate`, written atomically) and refined online from the real steps (EMA). A batch of ``B`` trees has
its own curve over ``[B, n]`` forwards: each sequence reads its own KV cache, so such a forward costs more than
``B x n`` rows of one sequence (`calibrate_batches` measures the gap).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..attention import additive_mask, causal_row_mask
from .timing import sync

logger = logging.getLogger(__name__)

#: rows of one calibration forward (root included) and cached-context lengths measured
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)
CALIBRATION_CONTEXTS = (128, 512)
#: timed forwards per point when a curve is measured at first use (the median is kept)
FIRST_USE_REPEATS = 5
#: a batch's calibration stops at this many rows in all (or 8 rows per tree, when more): larger trees never pay there
MAX_BATCH_ROWS = 64
#: EMA weight of one online observation
COST_RATE = 0.1
#: a calibration in which one row count's forward cost this many times its neighbour's (twice or half the rows) was
#: disturbed (another process held the cores): read from the cache, it is measured again. A cached curve of this
#: machine had 1.66 s for one row beside 62 ms for two, and sized every eager auto tree at 19 nodes
DISTURBED_RATIO = 3.0
#: share of an observation's correction that every other point of the curve takes too: a machine slowed by another
#: process slows forwards of every size, so a stretch of slow one-row steps moves the whole curve, not only its
#: one-row cost (which, the curve being kept nondecreasing, flattened it and grew 25-row trees on a 2-core CPU)
LEVEL_SHARE = 0.8


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear interpolation, linear extrapolation past both ends (costs keep growing past the grid)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interp_numpy(x: np.ndarray, xs: list[float], ys: list[float]) -> np.ndarray:
    """`_interp` over an array of points (linear extrapolation past both ends, as `_interp`)."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if xs.size == 1:
        return np.full_like(x, ys[0])
    i = np.clip(np.searchsorted(xs, x), 1, xs.size - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostCurve:
    """``seconds[j][i]``: one target forward with ``sizes[i]`` rows over ``contexts[j]`` cached tokens."""

    sizes: list[int]
    contexts: list[int]
    seconds: list[list[float]]
    key: dict = field(default_factory=dict)  # what it was measured for (model, dtype, device, threads)

    def __post_init__(self) -> None:
        if not self.sizes or len(self.seconds) != len(self.contexts) or any(
            len(row) != len(self.sizes) for row in self.seconds
        ):
            raise ValueError("CostCurve: seconds must be [len(contexts)][len(sizes)] with at least one size.")
        self._dense: np.ndarray | None = None  # per-row costs at every calibrated context (see `costs`)

    def __call__(self, rows: int, context: int) -> float:
        """Predicted seconds; never below the one-row cost's floor of 0 and nondecreasing in ``rows``."""
        per_context = [max(_interp(rows, self.sizes, row), 1e-9) for row in self.seconds]
        if len(self.contexts) == 1:
            return per_context[0]
        return max(_interp(context, self.contexts, per_context), 1e-9)

    def costs(self, max_rows: int, context: int) -> torch.Tensor:
        """``[max_rows]`` predicted seconds for 1..max_rows rows, nondecreasing (a few tensor ops: the per-row costs
        at every calibrated context are interpolated once per change of the curve, then blended per call)."""
        dense = self._dense
        if dense is None or dense.shape[1] < max_rows:
            rows = np.arange(1, max(max_rows, 128) + 1, dtype=np.float64)
            dense = np.stack([_interp_numpy(rows, self.sizes, row) for row in self.seconds])
            self._dense = dense
        if len(self.contexts) == 1:
            out = dense[0, :max_rows]
        else:
            contexts = self.contexts
            i = 1
            while i < len(contexts) - 1 and context > contexts[i]:
                i += 1
            w = (context - contexts[i - 1]) / (contexts[i] - contexts[i - 1])
            out = dense[i - 1, :max_rows] + w * (dense[i, :max_rows] - dense[i - 1, :max_rows])
        return torch.from_numpy(np.maximum.accumulate(np.maximum(out, 1e-9)))

    def observe(self, rows: int, context: int, seconds: float, rate: float = COST_RATE) -> None:
        """Moves the grid points around (rows, context) towards a measured step, weighted by closeness, and every
        other point by `LEVEL_SHARE` of that correction, then keeps the curve nondecreasing in ``rows``."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        ratio = seconds / self(rows, context)
        j = min(range(len(self.contexts)), key=lambda c: abs(self.contexts[c] - context))
        hi = next((i for i, s in enumerate(self.sizes) if s >= rows), len(self.sizes) - 1)
        lo = max(hi - 1, 0) if self.sizes[hi] != rows else hi
        span = max(self.sizes[hi] - self.sizes[lo], 1)
        weights = {hi: 1.0} if lo == hi else {lo: (self.sizes[hi] - rows) / span, hi: (rows - self.sizes[lo]) / span}
        self._dense = None
        for c, row in enumerate(self.seconds):
            for i in range(len(row)):
                own = max(weights.get(i, 0.0), 0.0) if c == j else 0.0
                row[i] *= 1 + rate * (own + (1 - own) * LEVEL_SHARE) * (ratio - 1)
            for i in range(1, len(row)):
                row[i] = max(row[i], row[i - 1])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        return cls(list(data["sizes"]), list(data["contexts"]), [list(r) for r in data["seconds"]], data.get("key", {}))

    def table(self) -> str:
        """Markdown table: ms per forward, one column per row count, one row per context length."""
        head = "| context \\ rows | " + " | ".join(str(s) for s in self.sizes) + " |"
        sep = "|---|" + "---:|" * len(self.sizes)
        body = [f"| {c} | " + " | ".join(f"{1000 * s:.1f}" for s in row) + " |"
                for c, row in zip(self.contexts, self.seconds)]
        return "\n".join([head, sep, *body])


def position_limit(model: torch.nn.Module) -> int | None:
    """The most positions the model can encode (learned absolute position tables: GPT-2's ``n_positions``, OPT's
    ``max_position_embeddings``), None when the config names none. Calibration stays below it."""
    config = model.config.get_text_config() if hasattr(model, "config") else None
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def calibration_grid(model: torch.nn.Module, batch: int = 1, sizes: tuple[int, ...] = CALIBRATION_SIZES,
                     contexts: tuple[int, ...] = CALIBRATION_CONTEXTS) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (rows, contexts) a curve is measured at for this model and batch size: rows per tree up to
    `MAX_BATCH_ROWS` in all (at least 8 per tree), and every context plus its largest tree within the model's
    `position_limit` (contexts shrink, then rows, for a model of few positions)."""
    sizes = tuple(s for s in sizes if s * batch <= max(MAX_BATCH_ROWS, 8 * batch)) or sizes[:1]
    limit = position_limit(model)
    if limit is None:
        return sizes, contexts
    sizes = tuple(s for s in sizes if s <= limit // 2) or (1,)
    room = limit - max(sizes)
    fitted = sorted({min(c, room) for c in contexts if min(c, room) >= 1})
    return sizes, tuple(fitted) or (max(room, 1),)


def model_key(model: torch.nn.Module, threads: int | None = None, compiled=None, batch: int = 1) -> dict:
    """What a calibration is valid for: model identity (name + config hash), dtype, device/hardware, threads, and
    how the forward runs (eager, or compiled with which settings): the two curves of a machine are cached apart."""
    from .hardware import detect

    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if config is not None else type(model).__name__
    param = next(model.parameters())
    return {
        "model": getattr(model, "name_or_path", "") or type(model).__name__,
        "config_sha": hashlib.sha256(text.encode()).hexdigest()[:16],
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "hardware": detect(param.device).name,
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        **({"compiled": compiled.settings.describe()} if compiled is not None else {}),
        **({"batch": int(batch)} if batch != 1 else {}),
    }


def cache_path(key: dict, cache_dir: str | Path | None = None) -> Path:
    from ..paths import cost_cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    folder = Path(cache_dir) / "latency" if cache_dir is not None else cost_cache_dir()
    return folder / f"{digest}.json"


@torch.inference_mode()
def calibrate_target(
    model: torch.nn.Module,
    sizes: tuple[int, ...] | None = None,
    contexts: tuple[int, ...] | None = None,
    repeats: int = 1,
    compiled=None,
    batch: int = 1,
) -> CostCurve:
    """Times one target forward per (rows, context) exactly as a tree verification runs (``[batch, rows]`` tokens, a
    4D float mask, explicit positions, a cache of ``context`` tokens per sequence, under ``inference_mode`` as the
    loops run), keeping the median of ``repeats``; with ``compiled`` (a `hf_treespec.compiled.CompiledForward`),
    through its compiled graphs over a preallocated cache. The grid defaults to `calibration_grid` (within the
    model's position limit). One untimed forward per context warms up. At first use `load_or_calibrate` keeps the
    median of `FIRST_USE_REPEATS` per point (~10 s for SmolLM2-135M on 2 CPU cores): the cost rule sizes trees by
    the curve's differences between neighbouring row counts, which single measurements on a noisy machine get wrong
    (a 4-row forward measured slower than an 8-row one); the online refinement from real steps corrects what
    remains."""
    from ..compat import CACHE_KWARG

    default_sizes, default_contexts = calibration_grid(model, batch)
    sizes, contexts = tuple(sizes or default_sizes), tuple(contexts or default_contexts)
    device, dtype = next(model.parameters()).device, model.dtype
    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    if getattr(compiled, "owns_cache", False):
        seconds = _engine_seconds(compiled, sizes, contexts, repeats, vocab, gen, batch)
        return CostCurve(list(sizes), list(contexts), seconds, model_key(model, compiled=compiled, batch=batch))
    for context in contexts:
        cache = _prefilled_cache(model, batch, context, gen, capacity=context + max(sizes) if compiled else None)
        row = []
        for rows in sizes:
            ids = torch.randint(0, vocab, (batch, rows), generator=gen).to(device)
            positions = torch.arange(context, context + rows, device=device)[None].expand(batch, -1)
            mask = causal_row_mask(rows, context + rows, dtype, device).expand(batch, -1, -1, -1)
            times = []
            warm_up = rows == sizes[0]
            for attempt in range(repeats + warm_up):
                sync(device)
                t0 = time.perf_counter()
                if compiled is not None:
                    compiled(ids, positions, mask, cache)
                else:
                    model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                          **{CACHE_KWARG: cache})
                sync(device)
                if attempt or not warm_up:
                    times.append(time.perf_counter() - t0)
                cache.crop(-rows)  # drop the rows just added (transformers 5.23: a negative count)
            row.append(statistics.median(times))
        seconds.append(row)
    return CostCurve(list(sizes), list(contexts), seconds, model_key(model, compiled=compiled, batch=batch))


def _engine_seconds(engine, sizes, contexts, repeats: int, vocab: int, generator: torch.Generator, batch: int = 1
                    ) -> list[list[float]]:
    """`calibrate_target`'s grid through an engine that holds the cache (`OpenVINOStep`), ``batch`` sequences at a
    time: it cannot drop rows, so each timed forward's rows stay held and masked out of the next, as rejected tree
    rows are in decoding."""
    seconds = []
    for context in contexts:
        engine.reset(batch)
        prompt = torch.randint(0, vocab, (batch, context), generator=generator)
        engine(prompt, torch.arange(context)[None].expand(batch, -1),
               causal_row_mask(context, context, torch.float32, "cpu").expand(batch, -1, -1, -1), last_only=True)
        row = []
        for rows in sizes:
            ids = torch.randint(0, vocab, (batch, rows), generator=generator)
            positions = torch.arange(context, context + rows)[None].expand(batch, -1)
            times = []
            warm_up = rows == sizes[0]
            for attempt in range(repeats + warm_up):
                visible = torch.zeros(rows, engine.held + rows, dtype=torch.bool)
                visible[:, :context] = True
                visible[:, engine.held:] = torch.ones(rows, rows, dtype=torch.bool).tril()
                mask = additive_mask(visible, torch.float32)[None, None].expand(batch, -1, -1, -1)
                t0 = time.perf_counter()
                engine(ids, positions, mask)
                if attempt or not warm_up:
                    times.append(time.perf_counter() - t0)
            row.append(statistics.median(times))
        seconds.append(row)
    return seconds


def _prefilled_cache(model: torch.nn.Module, batch: int, context: int, generator: torch.Generator,
                     capacity: int | None = None):
    """A cache holding ``context`` random tokens per sequence, laid out as the tree loop runs it (sliding layers
    full-length; the window costs no time here); with ``capacity``, preallocated as a compiled run lays it out."""
    from transformers import DynamicCache

    from ..compat import CACHE_KWARG
    from ..kv.window import prepare

    cache = DynamicCache(config=model.config)
    if capacity is not None:
        from ..compiled import preallocate

        preallocate(cache, capacity)
    else:
        prepare(model, cache)
    vocab = int(model.config.get_text_config().vocab_size)
    prefix = torch.randint(0, vocab, (batch, context), generator=generator).to(next(model.parameters()).device)
    model(input_ids=prefix, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
    return cache


def load_or_calibrate(model: torch.nn.Module, cache_dir: str | Path | None = None, compiled=None, batch: int = 1,
                      **kwargs) -> CostCurve:
    """The cached curve for this (model, dtype, device, threads, eager or compiled, batch size), measuring and
    caching it at first use."""
    key = model_key(model, compiled=compiled, batch=batch)
    path = cache_path(key, cache_dir)
    if path.exists():
        try:
            curve = CostCurve.from_json(json.loads(path.read_text()))
            if curve.key == key and not disturbed(curve):
                return curve
        except (ValueError, KeyError, TypeError):
            pass  # unreadable, stale or disturbed: measure again and overwrite
    kwargs.setdefault("repeats", FIRST_USE_REPEATS)
    curve = calibrate_target(model, compiled=compiled, batch=batch, **kwargs)
    if disturbed(curve):  # once more: a disturbance of a few seconds is over by then
        curve = calibrate_target(model, compiled=compiled, batch=batch, **kwargs)
        if disturbed(curve):
            logger.warning("hf_treespec: the target's cost curve was measured twice on a busy machine (neighbouring "
                           "row counts differ by more than %gx); tree_budget='auto' starts from it and corrects it "
                           "from real steps. `hf-treespec calibrate` measures it again.", DISTURBED_RATIO)
    write_atomically(path, json.dumps(curve.to_json(), indent=1))
    return curve


def disturbed(curve: CostCurve) -> bool:
    """Whether some row count's forward cost `DISTURBED_RATIO` times (or a fraction) its neighbour's at some context:
    what a measurement the machine's other work interrupted looks like (neighbours differ by at most 2x in rows)."""
    return any(max(a, b) > DISTURBED_RATIO * min(a, b) for row in curve.seconds for a, b in zip(row, row[1:]))


def write_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file in the same folder and a rename: a reader (another
    process calibrating the same machine) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@dataclass
class BatchCheck:
    """One point of `calibrate_batches`: a ``[batch, rows]`` verification forward against the curve's price for it
    (``batch x rows`` rows of one sequence)."""

    batch: int
    rows: int
    context: int
    measured: float
    predicted: float

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted


@torch.no_grad()
def calibrate_batches(
    model: torch.nn.Module, curve: CostCurve, batches: tuple[int, ...], rows: tuple[int, ...] = (1, 2, 4, 8),
    context: int = 256, repeats: int = 3,
) -> list[BatchCheck]:
    """Times ``[batch, rows]`` forwards as the batched loop runs them (every sequence ``context`` cached tokens, a
    ``[batch, 1, rows, context + rows]`` float mask, explicit positions), the fastest of ``repeats`` after one warm-up
    per batch, next to ``curve(batch x rows, context)``: the premise a batch's tree sizing rests on."""
    from ..compat import CACHE_KWARG

    device, dtype = next(model.parameters()).device, model.dtype
    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(0)
    checks = []
    for batch in batches:
        cache = _prefilled_cache(model, batch, context, gen)
        for count in rows:
            ids = torch.randint(0, vocab, (batch, count), generator=gen).to(device)
            positions = torch.arange(context, context + count, device=device)[None].expand(batch, -1)
            mask = causal_row_mask(count, context + count, dtype, device).expand(batch, -1, -1, -1)
            best = float("inf")
            for attempt in range(repeats + 1):
                sync(device)
                t0 = time.perf_counter()
                model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                      **{CACHE_KWARG: cache})
                sync(device)
                if attempt:
                    best = min(best, time.perf_counter() - t0)
                cache.crop(-count)
            checks.append(BatchCheck(batch, count, context, best, curve(batch * count, context)))
    return checks
