"""Benchmark methods: one ``generate`` call each, returning the new tokens and what the call cost.

Every method runs through the *same* ``model.generate`` with ``return_dict_in_generate=True``, so the only thing that
differs between them is how tokens are proposed and verified. Peers use transformers' own assisted generation;
``tree:<policy>`` uses hf_treespec's tree speculation with the same drafter model as ``assisted_drafter``.
Methods are looked up by name in `METHODS` (kinds) and built with :func:`build_method`.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch

from ..generation.config import TREE_GENERATION_KWARGS
from ..policies import POLICIES
from ..registry import Registry

TREE_PREFIX = "tree:"
#: the papers' policies first, in the order a reader compares them; any other registered policy follows
PREFERRED_POLICY_ORDER = ("chain", "eagle2", "optimal", "salf")
PEER_ORDER = ("plain", "assisted_lookup", "assisted_drafter")
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


class BenchMethod:
    """A named way of calling ``generate``. Subclasses add their own kwargs in :meth:`method_kwargs`.

    ``overrides`` are extra generate kwargs for this method only (``--set salf.tree_budget=16``); ``sweep`` is the
    ``(key, value)`` this instance was built for in a cost-curve sweep, also applied as an override.
    """

    kind: ClassVar[str] = ""
    needs_drafter: ClassVar[bool] = False

    def __init__(self, name: str, overrides: dict[str, Any] | None = None, sweep: tuple[str, Any] | None = None):
        self.base_name = name
        self.sweep = sweep
        self.overrides = dict(overrides or {})
        if sweep is not None:
            self.overrides[sweep[0]] = sweep[1]

    @property
    def name(self) -> str:
        """Unique label: the base name, plus ``@key=value`` for sweep variants."""
        return self.base_name if self.sweep is None else f"{self.base_name}@{self.sweep[0]}={self.sweep[1]}"

    def accepts(self, key: str) -> bool:
        """Whether a group override / sweep of ``key`` applies to this method."""
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
        kwargs = {**generate_kwargs, **self.method_kwargs(drafter), **self.overrides, "return_dict_in_generate": True}
        kwargs = {k: v for k, v in kwargs.items() if k not in ASSISTANT_CONFIG_KEYS}
        attention_mask = torch.ones_like(input_ids)
        with self.prepared(drafter):
            _sync(input_ids.device)
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
            _sync(input_ids.device)
            seconds = time.perf_counter() - start
        return self.collect(out, input_ids.shape[1], seconds)

    def collect(self, out: Any, prompt_len: int, seconds: float) -> RunOutput:
        return RunOutput(tokens=out.sequences[0, prompt_len:].cpu(), seconds=seconds)


METHODS: Registry[BenchMethod] = Registry("benchmark method")


@METHODS.register("plain")
class PlainGenerate(BenchMethod):
    """Stock ``generate``: greedy or sampling, one target forward per token. The baseline every ratio uses."""


@METHODS.register("assisted_lookup")
class PromptLookup(BenchMethod):
    """transformers' prompt lookup decoding: drafts by copying n-gram continuations from the prompt."""

    defaults: ClassVar[dict[str, Any]] = {"prompt_lookup_num_tokens": 10}

    def method_kwargs(self, drafter):
        return dict(self.defaults)


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

    def accepts(self, key: str) -> bool:
        return super().accepts(key) or key in ASSISTANT_CONFIG_KEYS

    @contextmanager
    def prepared(self, drafter):
        assistant_settings = {k: v for k, v in self.overrides.items() if k in ASSISTANT_CONFIG_KEYS}
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


class TreeMethod(BenchMethod):
    """hf_treespec tree speculation with one tree policy (``tree:<policy>``)."""

    kind = "tree"
    needs_drafter = True

    def __init__(self, policy: str, overrides=None, sweep=None):
        if policy not in POLICIES:
            raise ValueError(f"Unknown tree policy {policy!r} in 'tree:{policy}'. Valid: {', '.join(POLICIES.names())}.")
        self.policy = policy
        super().__init__(TREE_PREFIX + policy, overrides, sweep)

    def accepts(self, key: str) -> bool:
        return key == "verifier" or key in POLICIES.get(self.policy).defaults or key not in TREE_GENERATION_KWARGS

    def check(self, model, drafter):
        super().check(model, drafter)
        if not hasattr(model, "_check_tree_request"):
            raise ValueError("tree methods need hf_treespec.enable(model) on the target.")

    def method_kwargs(self, drafter):
        return {"assistant_model": drafter, "tree_policy": self.policy}

    def collect(self, out, prompt_len, seconds):
        return RunOutput(
            tokens=out.sequences[0, prompt_len:].cpu(),
            seconds=seconds,
            draft_seconds=out.draft_seconds,
            verify_seconds=out.verify_seconds,
            draft_forwards=out.draft_forwards,
            tree_sizes=list(out.tree_sizes or []),
        )


def available_methods() -> list[str]:
    """Every method name, peers first, then one ``tree:<policy>`` per registered policy."""
    policies = [p for p in PREFERRED_POLICY_ORDER if p in POLICIES]
    policies += [p for p in POLICIES.names() if p not in policies]
    peers = sorted(METHODS.names(), key=lambda n: PEER_ORDER.index(n) if n in PEER_ORDER else len(PEER_ORDER))
    return peers + [TREE_PREFIX + p for p in policies]


def build_method(name: str, overrides: dict[str, Any] | None = None, sweep: tuple[str, Any] | None = None
                 ) -> BenchMethod:
    """``plain`` / ``assisted_lookup`` / ``assisted_drafter`` / ``tree:<policy>`` -> a method instance."""
    if name.startswith(TREE_PREFIX):
        return TreeMethod(name[len(TREE_PREFIX):], overrides, sweep)
    if name not in METHODS:
        raise ValueError(f"Unknown benchmark method {name!r}. Valid: {', '.join(available_methods())}.")
    return METHODS.get(name)(name, overrides, sweep)


@dataclass
class Override:
    """One ``--set selector.key=value``. The selector is a method name, a policy name (``salf`` = ``tree:salf``),
    ``tree`` (every tree method whose policy takes ``key``) or ``*`` (every method that takes ``key``)."""

    selector: str
    key: str
    value: Any
    group: bool = field(init=False)

    def __post_init__(self):
        self.group = self.selector in ("tree", "*")

    def applies_to(self, method_name: str, method: BenchMethod) -> bool:
        if self.selector == "*":
            return method.accepts(self.key)
        if self.selector == "tree":
            return isinstance(method, TreeMethod) and method.accepts(self.key)
        return self.selector == method_name or TREE_PREFIX + self.selector == method_name


def parse_value(text: str) -> Any:
    """``16`` -> 16, ``0.5`` -> 0.5, ``true`` / ``false`` / ``none`` -> bool / None, anything else stays a string."""
    lowered = text.strip().lower()
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


def parse_override(text: str) -> Override:
    """Parses ``method.key=value`` (e.g. ``salf.tree_budget=16``, ``assisted_lookup.prompt_lookup_num_tokens=5``)."""
    lhs, sep, value = text.partition("=")
    selector, dot, key = lhs.strip().rpartition(".")
    if not sep or not dot or not selector or not key:
        raise ValueError(
            f"--set expects method.key=value (e.g. salf.tree_budget=16, tree.tree_budget=16, "
            f"assisted_lookup.prompt_lookup_num_tokens=5); got {text!r}."
        )
    return Override(selector, key, parse_value(value))


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """Parses ``key=v1,v2,..`` (e.g. ``tree_budget=8,16,32,60``)."""
    key, sep, values = text.partition("=")
    parsed = [parse_value(v) for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not parsed:
        raise ValueError(f"--sweep expects key=v1,v2,... (e.g. tree_budget=8,16,32,60); got {text!r}.")
    return key.strip(), parsed


def overrides_for(method: BenchMethod, overrides: list[Override]) -> dict[str, Any]:
    """The kwargs that ``overrides`` set for ``method``; a group override never beats a method-specific one."""
    selected: dict[str, Any] = {}
    for override in sorted(overrides, key=lambda o: not o.group):  # groups first, specific ones win
        if override.applies_to(method.base_name, method):
            selected[override.key] = override.value
    return selected


def check_overrides(overrides: list[Override], method_names: list[str]) -> None:
    """Refuses a ``--set`` whose selector matches none of the methods being run (a typo would be silently ignored)."""
    for override in overrides:
        if override.group:
            continue
        if not any(override.selector == n or TREE_PREFIX + override.selector == n for n in method_names):
            raise ValueError(
                f"--set {override.selector}.{override.key}=...: no method {override.selector!r} in this run "
                f"({', '.join(method_names)}). Use a method name, a policy name, 'tree' or '*'."
            )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
