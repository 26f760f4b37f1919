"""Benchmark methods: one ``generate`` call each, returning the new tokens and what the call cost.

Every method but ``openvino`` runs through the *same* ``model.generate`` with ``return_dict_in_generate=True``, so the
only thing that differs between them is how tokens are proposed and verified. Peers use transformers' own assisted
generation; ``tree:<policy>`` uses hf_treespec's tree speculation with the same drafter model as ``assisted_drafter``;
``openvino`` is another engine on the same weights, prompt ids, threads and dtype: OpenVINO GenAI's greedy loop.
Methods are looked up by name in `METHODS` (kinds) and built with :func:`build_method`. A name may carry generate
kwargs of its own after ``@`` (``tree:iid@verifier=specinfer@tree_paths=4``), so one run can compare several settings
of the same method against one plain baseline; the whole name is the variant's label.
"""

from __future__ import annotations

import copy
import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch
from transformers import CompileConfig

from ..generation.config import TREE_GENERATION_KWARGS
from ..generation.binding import DRAFTER_KWARG
from ..generation.entry import tree_generate
from ..generation.plain import plain_generate
from ..policies import POLICIES
from ..registry import Registry
from ..cost.timing import sync

TREE_PREFIX = "tree:"
#: separates a method from its own settings: ``base@key=value@key=value``
VARIANT_SEP = "@"
#: the papers' policies first, in the order a reader compares them; any other registered policy follows
PREFERRED_POLICY_ORDER = ("chain", "eagle2", "optimal", "salf")
#: the peers: stock decoders of transformers, then other engines (OpenVINO GenAI's greedy loop)
PEER_ORDER = ("plain", "assisted_lookup", "assisted_drafter", "openvino")
#: a method setting (``tree:salf@drafter=runs/gto``) that runs that method with its own drafter (loaded like
#: ``--drafter``) instead of the run's, so two drafters are compared against one plain baseline in one run
DRAFTER_SETTING = "drafter"
#: a method setting (``plain@compile=true``, ``tree:salf@compile=true``, or ``--set tree.compile=true``) that runs
#: the target's steps through its compiled forward (`hf_treespec.compiled`: ``generate(compile_config=...)``);
#: ``plain@compile=true`` is plain decoding through those same compiled graphs, the baseline of compiled tree rows
COMPILE_SETTING = "compile"
#: the values ``@compile=`` takes besides true / false: a named compile backend (``openvino``: the OpenVINO step,
#: `hf_treespec.compiled.openvino_step`)
COMPILE_BACKENDS = ("inductor", "openvino")


def compile_config_for(backend: str) -> CompileConfig:
    """The ``compile_config`` of a compile backend's rows: ``CompileConfig()`` for inductor (the recommended
    settings), ``CompileConfig(backend=...)`` for another."""
    return CompileConfig() if backend == "inductor" else CompileConfig(backend=backend)
#: assistant-side settings that transformers reads from ``assistant_model.generation_config``, not generate kwargs
ASSISTANT_CONFIG_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@dataclass
class RunOutput:
    """One timed ``generate`` call. Tree statistics are None for methods that do not report them."""

    tokens: torch.Tensor  # [n] new tokens (prompt removed)
    seconds: float
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    draft_forwards: int | None = None
    tree_sizes: list[int] | None = None
    accepted_lengths: list[int] | None = None  # tokens committed per verified step (accepted drafts + 1)


class BenchMethod:
    """A named way of calling ``generate``. Subclasses add their own kwargs in :meth:`method_kwargs`.

    Three layers of extra generate kwargs, later ones winning: ``overrides`` from ``--set`` (``salf.tree_budget=16``);
    ``variant``, the ``@key=value@...`` part of the method's name as written (``@verifier=specinfer``), parsed into
    ``settings``; ``sweep``, the ``(key, value)`` this instance was built for in a cost-curve sweep.

    ``base_name`` is the registered method (``tree:iid``), ``label`` the name as written (``tree:iid@tree_paths=4``)
    and ``name`` the unique row label: the label, plus ``@key=value`` for sweep variants.
    """

    kind: ClassVar[str] = ""
    #: what the method set up before timing (an engine's export and load), one line for the report; None: nothing
    setup_note: str | None = None
    needs_drafter: ClassVar[bool] = False
    #: whether ``@compile=true`` applies (the target's steps through hf_treespec's compiled forward)
    compilable: ClassVar[bool] = False

    def __init__(self, name: str, overrides: dict[str, Any] | None = None, sweep: tuple[str, Any] | None = None,
                 variant: str = ""):
        self.base_name = name
        self.label = name + variant
        self.settings = parse_variant(self.label, variant)
        self.sweep = sweep
        self.overrides = dict(overrides or {})
        # an instance attribute: the method registry sets a class attribute ``name`` on registered classes
        self.name = self.label if sweep is None else f"{self.label}{VARIANT_SEP}{sweep[0]}={sweep[1]}"
        if DRAFTER_SETTING in self.settings and not self.needs_drafter:
            raise ValueError(f"method {self.label!r}: {self.base_name} uses no drafter, so it takes no "
                             f"{VARIANT_SEP}{DRAFTER_SETTING}=...; only tree:<policy> and assisted_drafter do.")
        refused = [key for key, value in self.settings.items() if not self.accepts(key, value)]
        if refused:
            taken = [key for key in TREE_GENERATION_KWARGS if self.accepts(key)]
            raise ValueError(
                f"method {self.label!r}: {self.base_name} does not take {', '.join(map(repr, refused))}; of the tree "
                f"kwargs it takes {', '.join(taken) if taken else 'none'} (any other generate kwarg is passed on)."
            )

    @property
    def generate_overrides(self) -> dict[str, Any]:
        """This method's own generate kwargs: ``--set`` values, then the name's settings, then the sweep value."""
        own = (DRAFTER_SETTING, COMPILE_SETTING)
        kwargs = {k: v for k, v in {**self.overrides, **self.settings}.items() if k not in own}
        if self.sweep is not None:
            kwargs[self.sweep[0]] = self.sweep[1]
        return kwargs

    @property
    def compile_backend(self) -> str | None:
        """How this method runs the target's steps: ``"inductor"`` (``@compile=true`` or ``--set ...compile=true``:
        hf_treespec's compiled forward), ``"openvino"`` (``@compile=openvino``: the OpenVINO step), None (eager)."""
        value = {**self.overrides, **self.settings}.get(COMPILE_SETTING, False)
        if value is True or value == "inductor":
            return "inductor"
        if value is False or value is None:
            return None
        if value not in COMPILE_BACKENDS:
            raise ValueError(f"method {self.name!r}: {COMPILE_SETTING}={value!r} is not one of true, false, "
                             f"{', '.join(COMPILE_BACKENDS)}.")
        return str(value)

    @property
    def compiled(self) -> bool:
        """Whether this method runs the target's steps through a compiled forward or engine (`compile_backend`)."""
        return self.compile_backend is not None

    @property
    def drafter_spec(self) -> str | None:
        """The ``@drafter=...`` of this method's name (None: the run's ``--drafter``)."""
        spec = self.settings.get(DRAFTER_SETTING)
        return None if spec is None else str(spec)

    def accepts(self, key: str, value: Any = "auto") -> bool:
        """Whether a group override, a sweep or a ``@key=value`` setting of ``key`` (to ``value``) applies here."""
        if key == COMPILE_SETTING:
            return self.compilable
        return key not in TREE_GENERATION_KWARGS

    def check(self, model: torch.nn.Module, drafter: torch.nn.Module | None) -> None:
        """Raises ValueError when the method cannot run with this model / drafter."""
        if self.needs_drafter and drafter is None:
            raise ValueError(f"method {self.name!r} needs a drafter; pass --drafter (e.g. truncated:6).")

    def method_kwargs(self, drafter: torch.nn.Module | None) -> dict[str, Any]:
        return {}

    @contextmanager
    def prepared(self, drafter: torch.nn.Module | None) -> Iterator[None]:
        """State a call needs around ``generate`` (restored afterwards, so runs stay independent)."""
        yield

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, drafter: torch.nn.Module | None,
            **generate_kwargs: Any) -> RunOutput:
        """Runs and times one generate call; ``generate_kwargs`` carry the sampling / length settings shared by all."""
        kwargs = self.call_kwargs(drafter, generate_kwargs)
        attention_mask = torch.ones_like(input_ids)
        with self.prepared(drafter):
            sync(input_ids.device)
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
            sync(input_ids.device)
            seconds = time.perf_counter() - start
        return self.collect(out, input_ids.shape[1], seconds)

    def call_kwargs(self, drafter: torch.nn.Module | None, generate_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every kwarg of this method's ``generate`` call: the shared ones, the method's own, its settings."""
        kwargs = {**generate_kwargs, **self.method_kwargs(drafter), **self.generate_overrides,
                  "return_dict_in_generate": True}
        backend = self.compile_backend
        if backend is not None:
            kwargs["compile_config"] = compile_config_for(backend)
        return {k: v for k, v in kwargs.items() if k not in ASSISTANT_CONFIG_KEYS}

    def collect(self, out: Any, prompt_len: int, seconds: float) -> RunOutput:
        return RunOutput(tokens=out.sequences[0, prompt_len:].cpu(), seconds=seconds)


METHODS: Registry[BenchMethod] = Registry("benchmark method")


@METHODS.register("plain")
class PlainGenerate(BenchMethod):
    """Stock ``generate``: greedy or sampling, one target forward per token, under ``torch.inference_mode`` as the
    tree loop runs (so that mode's lower dispatch cost is no part of any speedup). The baseline every ratio uses.
    ``plain@compile=true`` is plain decoding through hf_treespec's compiled forward (`plain_generate`): the same
    graphs as a compiled tree run, the strongest plain decoder we build from stock parts on a CPU, where
    transformers' own compile switch does not fire."""

    compilable = True

    def method_kwargs(self, drafter):
        return {"custom_generate": plain_generate} if self.compiled else {}

    @contextmanager
    def prepared(self, drafter):
        with torch.inference_mode():
            yield


@METHODS.register("assisted_lookup")
class PromptLookup(BenchMethod):
    """transformers' prompt lookup decoding: drafts by copying n-gram continuations from the prompt."""

    defaults: ClassVar[dict[str, Any]] = {"prompt_lookup_num_tokens": 10}

    def check(self, model, drafter):
        super().check(model, drafter)
        if model.generation_config.eos_token_id is None and not _lookup_runs_without_eos():
            raise ValueError(
                "this transformers release's prompt lookup needs an end-of-sequence token (it crashes in "
                "PromptLookupCandidateGenerator when eos_token_id is None); set model.generation_config.eos_token_id "
                "or upgrade transformers."
            )

    def method_kwargs(self, drafter):
        return dict(self.defaults)


def _lookup_runs_without_eos() -> bool:
    """Whether the installed transformers' prompt lookup guards a missing eos token (older 5.x releases call
    ``torch.isin(..., None)``); read from its source, as no version number marks the fix."""
    import inspect

    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    return "eos_token_id is not None" in inspect.getsource(PromptLookupCandidateGenerator.get_candidates)


@METHODS.register("assisted_drafter")
class AssistedDrafter(BenchMethod):
    """transformers' own assisted generation (chain speculation) with the same drafter model as the tree methods.

    Its draft-length settings (``num_assistant_tokens`` ...) are read by transformers from the assistant's generation
    config; overrides of those keys are set on a copy of that config for the duration of the call only.
    """

    needs_drafter = True

    def check(self, model, drafter):
        super().check(model, drafter)
        if not hasattr(drafter, "generate"):
            raise ValueError(
                f"assisted_drafter needs an AutoModelForCausalLM drafter; {type(drafter).__name__} is a tree-only "
                "drafter. Leave assisted_drafter out of --methods."
            )

    def method_kwargs(self, drafter):
        return {"assistant_model": drafter}

    def accepts(self, key: str, value: Any = "auto") -> bool:
        return super().accepts(key, value) or key in ASSISTANT_CONFIG_KEYS

    @contextmanager
    def prepared(self, drafter):
        assistant_settings = {k: v for k, v in self.generate_overrides.items() if k in ASSISTANT_CONFIG_KEYS}
        original = drafter.generation_config
        config = copy.deepcopy(original)
        for key, value in assistant_settings.items():
            setattr(config, key, value)
        # a fresh copy per call also stops the "heuristic" schedule carrying its draft length from one run to the next
        drafter.generation_config = config
        try:
            yield
        finally:
            drafter.generation_config = original


@METHODS.register("openvino")
class OpenVINOPipeline(BenchMethod):
    """OpenVINO GenAI's ``LLMPipeline`` greedy loop on the CPU: the engine a CPU user would pick instead of
    ``generate`` (the ``[openvino]`` extra). Same prompt token ids (chat template already applied), same threads,
    the bench's dtype as the inference precision (the KV cache too), same length and EOS rule as ``generate``; its IR
    is exported from the target's own weights once per machine (`hf_treespec.benchmark.openvino`). Greedy only.
    Settings: ``openvino@kv_cache_precision=u8``, ``@attention_backend=SDPA``, ``@prefix_caching=true``,
    ``@inference_precision=f32``. Its tau is n/a: the target module never runs."""

    def __init__(self, name, overrides=None, sweep=None, variant=""):
        super().__init__(name, overrides, sweep, variant)
        self.pipeline = None
        self._key: tuple | None = None

    def accepts(self, key: str, value: Any = "auto") -> bool:
        from .openvino import PIPELINE_SETTINGS

        return key in PIPELINE_SETTINGS

    def check(self, model, drafter):
        from .openvino import pipeline_properties, require_genai

        require_genai()
        if model.device.type != "cpu":
            raise ValueError(f"openvino runs on the CPU; the target is on {model.device}.")
        pipeline_properties(model, 1, self.generate_overrides)  # refuses a malformed setting here

    def load(self, model) -> None:
        """The pipeline, loaded on the first (untimed warm-up) call, after exporting the IR when this machine has
        none cached; loaded again only when the threads or the model change."""
        from .openvino import describe_setup, ensure_ir, load_pipeline, pipeline_properties

        properties = pipeline_properties(model, torch.get_num_threads(), self.generate_overrides)
        key = (id(model), repr(properties))
        if self.pipeline is not None and self._key == key:
            return
        ir = ensure_ir(model)
        start = time.perf_counter()
        self.pipeline = load_pipeline(ir.folder, properties)
        self._key = key
        self.setup_note = describe_setup(ir, properties, time.perf_counter() - start)

    def run(self, model, input_ids, drafter, **generate_kwargs):
        from .openvino import greedy_config, greedy_tokens

        if generate_kwargs.get("do_sample"):
            raise ValueError("openvino runs greedy decoding only (temperature 0): its sampler draws from a random "
                             "stream of its own, so its sampled tokens could not be compared; leave it out of "
                             "sampled runs.")
        if input_ids.shape[0] != 1:
            raise ValueError("openvino runs one prompt at a time.")
        self.load(model)
        config = greedy_config(self.pipeline, model, generate_kwargs)
        tokens, seconds = greedy_tokens(self.pipeline, input_ids, config)
        return RunOutput(tokens=tokens, seconds=seconds)


class TreeMethod(BenchMethod):
    """hf_treespec tree speculation with one tree policy (``tree:<policy>``)."""

    kind = "tree"
    needs_drafter = True
    compilable = True

    def __init__(self, policy: str, overrides=None, sweep=None, variant: str = ""):
        if policy not in POLICIES:
            raise ValueError(f"Unknown tree policy {policy!r} in 'tree:{policy}'. Valid: {', '.join(POLICIES.names())}.")
        self.policy = policy
        super().__init__(TREE_PREFIX + policy, overrides, sweep, variant)

    def accepts(self, key: str, value: Any = "auto") -> bool:
        """``value``: the one a group override or sweep would set (a policy may take a kwarg for some values only)."""
        if key == COMPILE_SETTING:
            return True
        return key == "verifier" or POLICIES.get(self.policy).takes(key, value) or key not in TREE_GENERATION_KWARGS

    def method_kwargs(self, drafter):
        return {"custom_generate": tree_generate, DRAFTER_KWARG: drafter, "tree_policy": self.policy}

    def collect(self, out, prompt_len, seconds):
        return RunOutput(
            tokens=out.sequences[0, prompt_len:].cpu(),
            seconds=seconds,
            draft_seconds=out.draft_seconds,
            verify_seconds=out.verify_seconds,
            draft_forwards=out.draft_forwards,
            tree_sizes=list(out.tree_sizes or []),
            accepted_lengths=list(out.accepted_lengths or []),
        )


def available_methods() -> list[str]:
    """Every method name, peers first, then one ``tree:<policy>`` per registered policy."""
    policies = [p for p in PREFERRED_POLICY_ORDER if p in POLICIES]
    policies += [p for p in POLICIES.names() if p not in policies]
    peers = sorted(METHODS.names(), key=lambda n: PEER_ORDER.index(n) if n in PEER_ORDER else len(PEER_ORDER))
    return peers + [TREE_PREFIX + p for p in policies]


def build_method(name: str, overrides: dict[str, Any] | None = None, sweep: tuple[str, Any] | None = None
                 ) -> BenchMethod:
    """``plain`` / ``assisted_lookup`` / ``assisted_drafter`` / ``tree:<policy>`` -> a method instance; each may be
    followed by its own settings, ``tree:iid@verifier=specinfer@tree_paths=4``."""
    base, sep, settings = name.partition(VARIANT_SEP)
    variant = sep + settings
    if base.startswith(TREE_PREFIX):
        return TreeMethod(base[len(TREE_PREFIX):], overrides, sweep, variant)
    if base not in METHODS:
        where = f" in {name!r}" if variant else ""
        raise ValueError(f"Unknown benchmark method {base!r}{where}. Valid: {', '.join(available_methods())} "
                         f"(each optionally followed by {VARIANT_SEP}key=value settings).")
    return METHODS.get(base)(base, overrides, sweep, variant)


def parse_variant(label: str, variant: str) -> dict[str, Any]:
    """``@verifier=specinfer@tree_paths=4`` -> ``{"verifier": "specinfer", "tree_paths": 4}`` (values as
    :func:`parse_value`); ``label`` is the full method name, for the error message."""
    settings: dict[str, Any] = {}
    for part in variant.split(VARIANT_SEP)[1:]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise ValueError(f"method {label!r}: each {VARIANT_SEP} part must be key=value (e.g. "
                             f"tree:iid{VARIANT_SEP}verifier=specinfer{VARIANT_SEP}tree_paths=4); got {part!r}.")
        if key in settings:
            raise ValueError(f"method {label!r} sets {key!r} twice.")
        settings[key] = parse_value(value)
    return settings


@dataclass
class Override:
    """One ``--set selector.key=value``. The selector is a method name (``tree:salf``; with a named variant's full name,
    ``tree:iid@tree_paths=4``, that variant only), a policy name (``salf`` = ``tree:salf``), ``tree`` (every tree
    method whose policy takes ``key``) or ``*`` (every method that takes ``key``). A method name or policy name also
    selects the named variants of that method."""

    selector: str
    key: str
    value: Any
    group: bool = field(init=False)

    def __post_init__(self):
        self.group = self.selector in ("tree", "*")

    def rank(self, method: BenchMethod) -> int | None:
        """How specifically this override names ``method``: None (not at all), 0 as a group, 1 by its base method or
        policy, 2 by its full variant name. A more specific override wins."""
        if self.selector == "*":
            return 0 if method.accepts(self.key, self.value) else None
        if self.selector == "tree":
            return 0 if isinstance(method, TreeMethod) and method.accepts(self.key, self.value) else None
        if self.selector in (method.base_name, method.base_name.removeprefix(TREE_PREFIX)):
            return 1
        return 2 if self.selector == method.label else None


def parse_value(text: str) -> Any:
    """``16`` -> 16, ``0.5`` -> 0.5, ``true`` / ``false`` / ``none`` -> bool / None, ``[[0], [1]]`` (JSON list, e.g.
    a ``tree_shape``) -> list, anything else stays a string."""
    lowered = text.strip().lower()
    if lowered.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{text!r} starts like a JSON list but does not parse ({error.msg}).") from None
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


#: ``selector.key=value``: the first ``.key=`` ends the selector, so a variant's name (``tree:salf@salf_threshold=0.3``)
#: and a value (``*.tree_selector=runs/a.b``) may contain dots and ``=``
OVERRIDE_PATTERN = re.compile(r"(?P<selector>.+?)\.(?P<key>\w+)\s*=(?P<value>.*)", re.DOTALL)


def parse_override(text: str) -> Override:
    """Parses ``method.key=value`` (e.g. ``salf.tree_budget=16``, ``assisted_lookup.prompt_lookup_num_tokens=5``,
    ``tree:iid@tree_paths=4.tree_depth=2``)."""
    match = OVERRIDE_PATTERN.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"--set expects method.key=value (e.g. salf.tree_budget=16, tree.tree_budget=16, "
            f"assisted_lookup.prompt_lookup_num_tokens=5); got {text!r}."
        )
    return Override(match["selector"].strip(), match["key"], parse_value(match["value"]))


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """Parses ``key=v1,v2,..`` (e.g. ``tree_budget=8,16,32,60``)."""
    key, sep, values = text.partition("=")
    parsed = [parse_value(v) for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not parsed:
        raise ValueError(f"--sweep expects key=v1,v2,... (e.g. tree_budget=8,16,32,60); got {text!r}.")
    return key.strip(), parsed


def overrides_for(method: BenchMethod, overrides: list[Override]) -> dict[str, Any]:
    """The kwargs that ``overrides`` set for ``method``: a group override never beats one naming the method, and one
    naming the base method never beats one naming the variant. (The variant's own settings beat all of them.)"""
    ranked = [(rank, override) for override in overrides if (rank := override.rank(method)) is not None]
    return {override.key: override.value for _, override in sorted(ranked, key=lambda pair: pair[0])}


def check_overrides(overrides: list[Override], methods: list[BenchMethod]) -> None:
    """Refuses a ``--set`` whose selector matches none of the methods being run (a typo would be silently ignored)."""
    for override in overrides:
        if override.group or any(override.rank(method) is not None for method in methods):
            continue
        raise ValueError(
            f"--set {override.selector}.{override.key}=...: no method {override.selector!r} in this run "
            f"({', '.join(m.name for m in methods)}). Use a method name, a policy name, 'tree' or '*'."
        )


def check_distinct(methods: list[BenchMethod]) -> None:
    """Refuses two methods with one name (their rows would mix) or one method listed twice under two names."""
    names: set[str] = set()
    runs: dict[tuple, str] = {}
    for method in methods:
        if method.name in names:
            source = "a --sweep variant and a listed method" if method.sweep is not None else "--methods"
            raise ValueError(f"method {method.name!r} appears twice ({source}); give each method a distinct name.")
        names.add(method.name)
        run = (method.base_name, frozenset(method.settings.items()), method.sweep)
        if run in runs:
            raise ValueError(f"methods {runs[run]!r} and {method.name!r} are the same method with the same settings; "
                             "list it once.")
        runs[run] = method.name
