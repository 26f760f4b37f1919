"""`CompiledForward`: the target's forward compiled once per model, for the decoding loops' steps.

Measured on 2-core AMD EPYC CPUs (fp32, torch 2.13): eager MKL pays about twice for a 2-row forward what it pays for
one row, while inductor with frozen, prepacked weights and its C++ GEMM kernels streams the weights once per forward
and runs a one-row step about twice as fast as eager. What this module does:

- compiles ``model(input_ids, position_ids, attention_mask, cache)`` with the dimensions that vary marked dynamic
  (rows of a tree, batch, the capacity of a `PreallocatedLayer` cache) and every other one static: two graphs per
  batch shape (one row, several rows: torch specialises a size of 1; a batch of one's tree steps get a third where
  `few_rows_linear` runs their linears, see `graph_name`), never recompiled as the context grows; with the
  recommended CPU settings each graph is compiled once per machine into an AOTInductor package (`packaged`), which
  later processes load, else by ``torch.compile`` in every process;
- captures the output of every decoder layer through forward hooks registered once, before the first compile (hooks
  added or removed later would change the graph's guards and recompile), so any feature drafter reads its layers;
- falls back to the eager forward, with one warning that says why, when compilation fails (no C++ compiler, an op or
  architecture inductor cannot compile): never a crash and never another token than eager decoding would give;
- picks the graph of a step in Python (one package or compiled function per graph, each its own code object) and,
  once a ``torch.compile`` graph has compiled, calls it without evaluating dynamo's guards
  (``skip_guard_eval_unsafe``, which checks only the guards that tell a function's graphs apart: with one graph per
  function, none). The full guard set covers every
  parameter and cache layer: its check took 1.39 ms of a one-row step, 0.42 ms remain (SmolLM2-135M bf16 at context
  200, 2-core EPYC, docs/results/compiled/guard-free-steps). The inputs that vary between steps are marked dynamic,
  so a function never needs a second graph (a slow test decodes 200 steps with the guards evaluated without one).

The frozen graph holds the weights as constants: after changing the model's weights, call `release`.
"""

from __future__ import annotations

import logging
import time
import types
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..attention import additive_mask, causal_row_mask, prompt_visibility
from ..compat import CACHE_KWARG
from ..features import CapturedStates, decoder_layers
from .attention import use_lean_attention
from .cpp_ops import has_compiler
from .failures import failure_reason
from .few_rows_linear import MOST_ROWS, FewRowsLinears
from .packaged import PackagedGraph, packaged_graph, varying_dims
from .preallocated import reserve, start_empty

logger = logging.getLogger(__name__)

#: where a model instance keeps its compiled forwards (one per `CompileSettings`)
_STORE = "_treespec_compiled_forwards"
#: rows of the warm-up forward that compiles the several-rows graph: inductor tunes its GEMM kernels for this size
WARM_UP_ROWS = 8
#: a warm-up prefill long enough that the cached length is never specialised (torch specialises sizes 0 and 1)
WARM_UP_CONTEXT = 8
#: prompt rows per compiled prefill forward: bounds the several-rows graph's scores (rows x context per head) and
#: logits (rows x vocabulary) on a long prompt
PREFILL_CHUNK = 256
#: the kind of graph (`CompiledForward.graph_name`) whose linears run the few-rows op
FEW_ROWS = "few rows"


@dataclass(frozen=True)
class CompileSettings:
    """How the target's forward is compiled (``torch.compile`` arguments; the dimensions that vary between steps are
    marked dynamic by `CompiledForward`, so ``dynamic`` is not one of them)."""

    backend: Any = "inductor"  # a name torch.compile knows, or a backend callable
    mode: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    fullgraph: bool = False
    #: call a graph that has compiled without evaluating its guards (one graph per compiled function)
    skip_guards: bool = True
    #: inductor on a CPU with ``avx512_bf16``: bf16 linears run the few-rows op (`few_rows_linear`) in the graphs
    few_rows_linear: bool = True
    #: compile once per machine: each graph exported and compiled ahead of time by AOTInductor into a package on
    #: disk that later processes load (`packaged`), instead of ``torch.compile`` in every process (inductor only)
    packaged: bool = False

    @classmethod
    def recommended(cls, device: torch.device | str = "cpu") -> "CompileSettings":
        """What measured fastest: on a CPU, frozen weights with inductor's C++ GEMM templates chosen by autotuning;
        on an accelerator, inductor's autotuned kernels (without CUDA graphs, which need static shapes)."""
        if torch.device(device).type == "cpu":
            return cls(options=(("freezing", True), ("max_autotune", True)), packaged=True)
        return cls(mode="max-autotune-no-cudagraphs")

    @classmethod
    def from_compile_config(cls, config, device: torch.device | str = "cpu") -> "CompileSettings":
        """transformers' ``CompileConfig``: its defaults (tuned for CUDA graphs over a static cache) mean
        `recommended`; anything else set on it is taken as given (``dynamic`` aside)."""
        from transformers import CompileConfig

        if _same_config(config, CompileConfig()):
            return cls.recommended(device)
        options = tuple(sorted((config.options or {}).items()))
        return cls(backend=config.backend, mode=config.mode, options=options, fullgraph=bool(config.fullgraph))

    def compile_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.options:
            kwargs["options"] = dict(self.options)
        return kwargs

    def config_context(self):
        """Inductor's options set around every compiled call: ``freezing`` is read from inductor's config when a
        graph compiles, not from ``torch.compile(options=...)`` (measured, torch 2.13: passed as an option the
        weights stay graph inputs and every linear runs as ``aten::mm``)."""
        if self.backend != "inductor" or not self.options:
            return nullcontext()
        import torch._inductor.config as inductor_config

        return inductor_config.patch(dict(self.options))

    def guard_stance(self):
        """The compiler's stance on the calls of a graph that has compiled (see `skip_guards`)."""
        if not self.skip_guards:
            return nullcontext()
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)

    def describe(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")
        parts = [backend] + ([f"mode={self.mode}"] if self.mode else [])
        parts += [f"{key}={value}" for key, value in self.options]
        return ", ".join(parts)


def _same_config(a, b) -> bool:
    keys = ("fullgraph", "dynamic", "backend", "mode", "options")
    return all(getattr(a, key, None) == getattr(b, key, None) for key in keys)


def settings_from_generation_config(generation_config, device: torch.device | str) -> CompileSettings | None:
    """The compile settings a ``generate`` call asks for: ``compile_config=CompileConfig(...)`` (in the call or on
    ``model.generation_config``) turns compilation on, ``disable_compile=True`` off; neither: None (eager)."""
    if getattr(generation_config, "disable_compile", False):
        return None
    config = getattr(generation_config, "compile_config", None)
    if config is None:
        return None
    return CompileSettings.from_compile_config(config, device)


def _mark_varying(input_ids, position_ids, mask, slots, extra: dict) -> None:
    """Marks the dimensions of a step's inputs that vary between steps as dynamic, and only those (`varying_dims`;
    the KV buffers are marked when they are allocated, `PreallocatedLayer`)."""
    inputs = (input_ids, position_ids, mask, slots, [], [], extra)
    tensors = [input_ids, position_ids, mask, slots, *extra.values()]
    ids, positions, rows_mask, slot_dims, _, _, extra_dims = varying_dims(inputs)
    for tensor, dims in zip(tensors, [ids, positions, rows_mask, slot_dims, *extra_dims.values()]):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _with_own_code(method):
    """``method`` bound to a copy of its function with a code object of its own. Dynamo keeps compiled graphs, and
    counts recompilations against its limit, per code object: without a copy, every model compiled in a process
    would share one code object, and after a few models dynamo would stop compiling it."""
    function = method.__func__
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    return types.MethodType(own, method.__self__)


def _store_output(parts: list, slot: int, module, args, output) -> None:
    parts[slot] = output[0] if isinstance(output, tuple) else output


@dataclass(eq=False)
class CompiledForward:
    """One model's forward compiled with ``settings``; ``__call__`` runs a step, `states` reads what it captured.

    Attributes:
        failure: why compilation was given up (the eager forward runs instead), or None.
        package_failure: why packaging was given up (``torch.compile`` compiles in this process instead), or None.
        compile_seconds: wall-clock seconds of each graph's first call (its compilation, or its package's build or
            load), by graph name.
    """

    model: torch.nn.Module
    settings: CompileSettings
    failure: str | None = None
    package_failure: str | None = None
    compile_seconds: dict[str, float] = field(default_factory=dict)
    #: steps run by packages (they do not call the module: its forward hooks do not see them)
    packaged_calls: int = 0
    #: seconds inside those calls (on a CPU the graphs' run, on an accelerator their launch): what a measurement
    #: takes from a call's wall time to leave the host's share (`packaged_time`)
    packaged_seconds: float = 0.0
    #: what the model is, in the log lines
    role: str = "target"

    def __post_init__(self) -> None:
        self._parts: list[torch.Tensor | None] = []
        self._hooks = self._capture_hooks()
        #: the model's bf16 linears routed to the few-rows op while its graphs compile (None: inductor's own)
        self.linears = (FewRowsLinears.attach(self.model)
                        if self.settings.few_rows_linear and self.settings.backend == "inductor" else None)
        #: the model's attention reads only the rows a step's mask covers, KV heads in place (`compiled.attention`);
        #: else the graph attends over every buffer row
        self.lean = use_lean_attention(self.model)
        #: one compiled function per graph name (`graph_name`), each compiling exactly one graph
        self._graphs: dict[str, Any] = {}
        #: the loaded package of each graph name (`settings.packaged`)
        self._packages: dict[str, PackagedGraph] = {}
        #: graphs whose calls evaluate their guards (dynamo kept no compiled graph for them)
        self._guarded: set[str] = set()
        #: per cache layer, one row's key and value shape and their dtype (read in `warm_up`; `prefill` needs them)
        self._layout: list | None = None

    def _capture_hooks(self) -> list:
        """Hooks on every decoder layer storing its output (the drafter's features), registered once."""
        blocks = decoder_layers(self.model)
        self._parts[:] = [None] * len(blocks)
        return [block.register_forward_hook(partial(_store_output, self._parts, slot))
                for slot, block in enumerate(blocks)]

    def _forward(self, input_ids, position_ids, attention_mask, cache):
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                          use_cache=True, **{CACHE_KWARG: cache}).logits

    def _scratch_prefill(self, prompt: torch.Tensor, cache) -> None:
        """Fills a warm-up cache with ``prompt`` eagerly."""
        self.model(input_ids=prompt, use_cache=True, **{CACHE_KWARG: cache})

    def _scratch_extra(self, batch: int, rows: int) -> dict:
        """The inputs of a warm-up ``[batch, rows]`` step besides tokens, positions, mask and cache (none here)."""
        return {}

    def graph_name(self, batch: int, rows: int) -> str:
        """Which compiled graph a ``[batch, rows]`` step runs (torch specialises sizes of 1). With the few-rows
        linear routed, a step of 2 to `MOST_ROWS` rows in all (a batch of one's tree steps and short prompts; a
        batch's one-row and tree steps) has a graph of its own whose linears run it; a batch of one's one-row step
        keeps inductor's linears (they stream the weights faster for one row), and longer prompts keep inductor's
        prepacked linears (where the op would hand over to the slower ``at::linear``: a 20-token compiled prefill 60
        ms against 38, docs/results/compiled/few-rows-linear)."""
        kind = "one row" if rows == 1 else "several rows"
        if self.linears is not None and 1 < batch * rows <= MOST_ROWS:
            kind = FEW_ROWS if rows > 1 else f"one row, {FEW_ROWS}"
        return f"{'batch of 1' if batch == 1 else 'batch'}, {kind}"

    def warm_up_rows(self, batch: int = 1) -> tuple[int, ...]:
        """The row counts whose graphs `warm_up` compiles for ``batch``: one row and several (and, with the few-rows
        linear routed, a count of few rows in all and a prompt's rows past them), one count per graph."""
        extra = () if self.linears is None else (max(2, MOST_ROWS // batch), MOST_ROWS + WARM_UP_ROWS)
        return self._one_per_graph(batch, (1, WARM_UP_ROWS, *extra))

    def _one_per_graph(self, batch: int, counts: tuple[int, ...]) -> tuple[int, ...]:
        """The first of ``counts`` for each graph they reach (inductor tunes a graph's kernels for the rows it
        compiles with: `WARM_UP_ROWS` where that graph takes them)."""
        first: dict[str, int] = {}
        for count in counts:
            first.setdefault(self.graph_name(batch, count), count)
        return tuple(first.values())

    def __call__(self, input_ids, position_ids, attention_mask, cache, **extra):
        """One step over ``cache`` (`PreallocatedLayer` s, grown first if needed), with the step's 4D
        ``attention_mask`` over the cached rows and the new ones, as an eager forward takes it; returns what
        `_forward` returns (the target's logits ``[B, q, V]``)."""
        rows = input_ids.shape[1]
        # lean attention reads the rows its mask covers, which must stay fewer than the buffer's (a free row kept)
        reserve(cache, rows + 1 if self.lean else rows)
        self.clear()
        first = cache.layers[0]
        if self.failure is not None or not first.is_initialized:  # an empty cache's first forward is a prefill
            return self._forward(input_ids, position_ids, attention_mask, cache, **extra)
        used = first.keys.shape[-2] + rows
        first.slots.index = torch.arange(used - rows, used, device=input_ids.device)
        if self.lean:  # the attention reads the first ``used`` buffer rows: the mask's length
            mask = attention_mask
        else:  # the graph attends over every buffer column; the columns past the step's rows are masked out
            lowest = torch.finfo(attention_mask.dtype).min
            mask = attention_mask.new_full((*attention_mask.shape[:-1], first.capacity), lowest)
            mask[..., :used] = attention_mask
        try:
            out = self._compiled_call(input_ids, position_ids, mask, cache, extra)
        finally:
            first.slots.index = None
        if self.failure is not None:  # its compilation failed just now: the eager forward ran on the step's own mask
            return out
        for layer in cache.layers:
            layer.view_rows(used)
        return out

    def prefill(self, input_ids, position_ids, prompt_mask, cache, layers: tuple[int, ...]):
        """The prompt forward through the compiled graphs, `PREFILL_CHUNK` rows at a time, into the empty ``cache``:
        ``(logits of the last row [B, 1, V], the decoder layers ``layers`` over every prompt row)``, or None where
        it cannot run (no warm-up yet, a failed compile, a one-token prompt): the caller prefills eagerly. An eager
        prefill of a 20-token prompt took 51.4 ms against 33.6 compiled (SmolLM2-135M, bf16, 2-core EPYC,
        docs/results/compiled/compiled-prefill). A left-padded prompt's padding sees only itself and is seen by
        nothing."""
        batch, length = input_ids.shape
        first = cache.layers[0]
        if self.failure is not None or self._layout is None or length < 2 or first.is_initialized:
            return None
        device = input_ids.device
        start_empty(cache, batch, self._layout, device)
        mask = additive_mask(prompt_visibility(prompt_mask, batch, length, device), self._layout[0][2])[:, None]
        parts: list[list[torch.Tensor]] = []
        for start in range(0, length, PREFILL_CHUNK):
            stop = min(start + PREFILL_CHUNK, length)
            # fresh tensors with contiguous strides: the graphs were traced on such inputs and guard the strides
            # (even of a size-1 batch), which are not evaluated on their calls
            chunk = [tensor.clone(memory_format=torch.contiguous_format) for tensor in
                     (input_ids[:, start:stop], position_ids[:, start:stop], mask[:, :, start:stop, :stop])]
            logits = self(*chunk, cache)
            if layers:
                parts.append(self.states(layers).parts)
        if not layers:
            return logits[:, -1:], None
        states = CapturedStates(len(layers))
        states.parts = [torch.cat(chunk, dim=1) for chunk in zip(*parts)]
        return logits[:, -1:], states

    def _graph(self, name: str):
        """The compiled function of the graph ``name``: its own code object, so its cache holds that graph alone."""
        if name not in self._graphs:
            self._graphs[name] = torch.compile(_with_own_code(self._forward), **self.settings.compile_kwargs())
        return self._graphs[name]

    def _routing(self, name: str):
        """Around a compile of the graph ``name``: the few-rows linear routed into it only if it is the few-rows
        graph (the hooks read this while dynamo traces; a compiled graph keeps what they chose)."""
        if self.linears is None:
            return nullcontext()
        return self.linears.routing(name.endswith(FEW_ROWS))

    def _packaged_call(self, name: str, input_ids, position_ids, mask, cache, extra: dict):
        """The step through the package of graph ``name`` (loaded, or built, on its first call); None where
        packaging failed (``torch.compile`` then compiles the graphs in this process, with one warning)."""
        package = self._packages.get(name)
        if package is None:
            start = time.perf_counter()
            try:
                package, built = packaged_graph(self, name, input_ids, position_ids, mask, cache, extra)
            except Exception as error:  # an export or AOT compile failure: torch.compile may still compile it
                if not has_compiler():  # it could not either: decode eagerly, with one warning
                    self._give_up(error)
                    return None
                self.package_failure = failure_reason(error)
                logger.warning("hf_treespec: packaging the %s's forward failed (%s); compiling it in this process "
                               "instead (in every process).", self.role, self.package_failure)
                return None
            self._packages[name] = package
            self.compile_seconds[name] = time.perf_counter() - start
            if built is not None:
                logger.warning("hf_treespec: compiled the %s's forward (%s) into %s in %.0f s.", self.role, name,
                               package.path, built)
            else:
                logger.info("hf_treespec: loaded the %s's forward (%s) from %s in %.1f s.", self.role, name,
                            package.path, self.compile_seconds[name])
        self.packaged_calls += 1
        start = time.perf_counter()
        out = package(self, input_ids, position_ids, mask, cache, extra)
        self.packaged_seconds += time.perf_counter() - start
        return out

    def _packaging(self) -> bool:
        """Whether the steps run through packages (`settings.packaged`, inductor, no packaging failure yet)."""
        return self.settings.packaged and self.settings.backend == "inductor" and self.package_failure is None

    def _compiled_call(self, input_ids, position_ids, mask, cache, extra: dict):
        name = self.graph_name(*input_ids.shape)
        if self._packaging():
            out = self._packaged_call(name, input_ids, position_ids, mask, cache, extra)
            if out is not None:
                return out
            if self.failure is not None:
                return self._eager_step(input_ids, position_ids, mask, cache, extra)
            self.compile_seconds.clear()  # compiled afresh from here on
        # dynamo's marks (a package's dimensions were fixed when it was exported)
        _mark_varying(input_ids, position_ids, mask, cache.layers[0].slots.index, extra)
        compiled = self._graph(name)
        if name in self.compile_seconds and name not in self._guarded:
            try:
                with self.settings.config_context(), self.settings.guard_stance():
                    return compiled(input_ids, position_ids, mask, cache, **extra)
            except RuntimeError as error:  # dynamo holds no graph to call (it ran the step eagerly when it compiled)
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
                self._guarded.add(name)
        if name in self.compile_seconds:  # guards evaluated: a failing one recompiles
            with self.settings.config_context(), self._routing(name):
                return compiled(input_ids, position_ids, mask, cache, **extra)
        logger.warning("hf_treespec: compiling the %s's forward for a %s (%s): minutes on a small CPU, once per "
                       "process.", self.role, name, self.settings.describe())
        start = time.perf_counter()
        try:
            with self.settings.config_context(), self._routing(name):
                out = compiled(input_ids, position_ids, mask, cache, **extra)
        except Exception as error:  # any compiler failure: decode eagerly instead
            self._give_up(error)
            return self._eager_step(input_ids, position_ids, mask, cache, extra)
        self.compile_seconds[name] = time.perf_counter() - start
        logger.warning("hf_treespec: compiled the %s's forward (%s) in %.0f s.", self.role, name,
                       self.compile_seconds[name])
        return out

    def _give_up(self, error: Exception) -> None:
        self.failure = failure_reason(error)
        logger.warning("hf_treespec: compiling the %s's forward failed (%s); decoding with its eager forward "
                       "instead (same tokens as eager decoding).", self.role, self.failure)

    def _eager_step(self, input_ids, position_ids, mask, cache, extra: dict):
        """The step a failed compile hands to the eager forward: written after the used rows, on its own mask."""
        first = cache.layers[0]
        first.slots.index = None
        return self._forward(input_ids, position_ids, mask[..., : first.keys.shape[-2] + input_ids.shape[1]], cache,
                             **extra)

    def clear(self) -> None:
        """Empties the capture slots before a forward: the graph's guards see them (a slot still holding the last
        forward's tensor would be a guarded input of the next call, its size a reason to recompile)."""
        self._parts[:] = [None] * len(self._parts)

    def states(self, layers: tuple[int, ...]) -> CapturedStates | None:
        """The outputs of decoder layers ``layers`` (``-1``: the last) in the last forward of the model."""
        if not layers:
            return None
        states = CapturedStates(len(layers))
        states.parts = [self._parts[layer] for layer in layers]
        return states

    def release(self) -> None:
        """Removes the capture hooks (the graphs stay in torch's caches until the process ends)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.linears is not None:
            self.linears.release()

    @torch.inference_mode()
    def warm_up(self, batch: int = 1, rows: tuple[int, ...] | None = None) -> dict[str, float]:
        """Compiles the graphs a decoding loop will call (``rows``, default `warm_up_rows`) on a scratch cache, so
        the first ``generate`` call is not the one that pays; returns the seconds each compile took."""
        rows = self.warm_up_rows(batch) if rows is None else rows
        from transformers import DynamicCache

        from .preallocated import preallocate

        device = next(self.model.parameters()).device
        dtype = self.model.dtype
        missing = [count for count in rows if self.graph_name(batch, count) not in self.compile_seconds]
        if missing and self.failure is None:
            logger.warning("hf_treespec: %s %d graph(s) of the %s's forward before decoding (%s).",
                           "preparing" if self._packaging() else "compiling", len(missing), self.role,
                           ", ".join(self.graph_name(batch, count) for count in missing))
        for count in missing:
            if self.failure is not None:
                break
            cache = DynamicCache(config=self.model.config)
            preallocate(cache, WARM_UP_CONTEXT + max(rows))
            self._scratch_prefill(torch.zeros(batch, WARM_UP_CONTEXT, dtype=torch.long, device=device), cache)
            self._layout = [(layer.keys.shape[1::2], layer.values.shape[1::2], layer.keys.dtype)
                            for layer in cache.layers]
            ids = torch.zeros(batch, count, dtype=torch.long, device=device)
            positions = torch.arange(WARM_UP_CONTEXT, WARM_UP_CONTEXT + count, device=device).repeat(batch, 1)
            mask = causal_row_mask(count, WARM_UP_CONTEXT + count, dtype, device).repeat(batch, 1, 1, 1)
            self(ids, positions, mask, cache, **self._scratch_extra(batch, count))
        return dict(self.compile_seconds)


@dataclass(eq=False)
class CompiledDrafterForward(CompiledForward):
    """A feature drafter's forward (`TreeSpecDrafterModel`: tokens and features in; logits and output features
    out), compiled as the target's is. Drafting a tree runs several of them a step; eager, their fixed costs weigh
    on a compiled target's step."""

    role: str = "drafter"

    def _capture_hooks(self) -> list:
        return []

    def _forward(self, input_ids, position_ids, attention_mask, cache, features=None):
        out = self.model(input_ids=input_ids, features=features, position_ids=position_ids,
                         attention_mask=attention_mask, use_cache=True, **{CACHE_KWARG: cache})
        return out.logits, out.hidden_states

    def _scratch_prefill(self, prompt: torch.Tensor, cache) -> None:
        self.model(input_ids=prompt, use_cache=True, **self._scratch_extra(*prompt.shape), **{CACHE_KWARG: cache})

    def warm_up_rows(self, batch: int = 1) -> tuple[int, ...]:
        """A drafter's prompt forward runs eagerly, so it needs no graph for long prompts: the rows of a step."""
        extra = () if self.linears is None else (max(2, MOST_ROWS // batch),)
        return self._one_per_graph(batch, (1, WARM_UP_ROWS, *extra))

    def _scratch_extra(self, batch: int, rows: int) -> dict:
        device = next(self.model.parameters()).device
        features = torch.zeros(batch, rows, self.model.config.hidden_size, dtype=self.model.dtype, device=device)
        return {"features": features}


def compiled_forward_for(model: torch.nn.Module, settings: CompileSettings,
                         kind: type[CompiledForward] = CompiledForward) -> CompiledForward:
    """The `CompiledForward` (or ``kind``) of ``model`` for ``settings``, kept on the model instance so nothing is
    compiled twice in one process."""
    store = model.__dict__.setdefault(_STORE, {})
    if settings not in store:
        store[settings] = kind(model, settings)
    return store[settings]


def packaged_steps(model: torch.nn.Module) -> int:
    """The steps the packages of ``model``'s compiled forwards ran (`CompiledForward.packaged_calls`)."""
    return sum(compiled.packaged_calls for compiled in model.__dict__.get(_STORE, {}).values())


def packaged_time(*models: torch.nn.Module) -> float:
    """Seconds the packages of the ``models``' compiled forwards ran in this process (`packaged_seconds`): a
    decoding call's wall time less the change in this is its host work on a CPU."""
    return sum(compiled.packaged_seconds for model in models
               for compiled in model.__dict__.get(_STORE, {}).values())


def release(model: torch.nn.Module) -> None:
    """Forgets ``model``'s compiled forwards and removes their hooks (call it after changing the weights: the
    compiled graphs hold them frozen)."""
    for compiled in model.__dict__.pop(_STORE, {}).values():
        compiled.release()
