"""Drafter interface: proposes next-token logits for tree nodes. Drafters know nothing of policies or verifiers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from ..registry import Registry
from ..tree import DraftTree

DRAFTER_ADAPTERS: Registry["Drafter"] = Registry("drafter adapter")


@dataclass
class TargetFeatures:
    """What the target's forward produced for newly committed tokens (used by feature drafters, ignored otherwise).

    ``hidden_states``: ``[k, H]`` target hidden states at the committed positions (row i predicts token i + 1).
    """

    hidden_states: torch.Tensor | None = None


class Drafter(ABC):
    """Per-generation state around an assistant model.

    Life cycle: ``start(prefix)`` once (prefix = committed tokens before the first tree root), then per step any number
    of ``expand(tree, nodes)`` calls and one ``commit(tree, accepted)``.
    """

    model: torch.nn.Module
    #: target layers whose hidden states the drafter consumes (-1 = pre-norm last layer); None = tokens only
    target_layers: tuple[int, ...] | None = None
    #: fast paths this drafter implements (a subset of ``{"greedy_chain", "topk_logprobs"}``); policies use them only
    #: when declared here (and no logits processor runs)
    capabilities: frozenset[str] = frozenset()

    #: how `as_drafter` chooses among the registered adapters that accept a model: the highest priority wins, a tie
    #: at the top is an error. Generic adapters (any causal LM) keep 0; one that drives a narrower kind of model (a
    #: subclass the generic one would also accept) declares more, so the choice never depends on registration names.
    priority: int = 0

    @classmethod
    @abstractmethod
    def accepts(cls, model: torch.nn.Module) -> bool:
        """Whether this adapter knows how to drive ``model``."""

    @classmethod
    def attach(cls, model: torch.nn.Module, target: torch.nn.Module) -> None:
        """Readies ``model`` to draft for ``target`` before the adapter wraps it (called by ``as_drafter`` when the
        target is known): checks the pair and shares what the drafter takes from the target. Default: nothing."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def start(self, prefix_ids: torch.Tensor, features: TargetFeatures | None = None) -> None:
        """Prefill on ``prefix_ids`` ``[L]`` (the tokens before the first root)."""

    @property
    def draft_support(self) -> torch.Tensor | None:
        """Sorted target ids outside which this drafter's logits are always -inf (a reduced draft vocabulary), or
        None (any id may be proposed). Draws and their verification then pass over these columns only."""
        return None

    @abstractmethod
    def expand(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """Raw next-token logits ``[len(nodes), V]`` (float32) after each node in ``nodes``, in one forward."""

    def greedy_chain(self, tree: DraftTree, node: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fast path ``"greedy_chain"``: the chain that ``length`` rounds of ``expand`` + argmax would draft below
        ``node``, as ``(tokens, logprobs)`` (log-softmax of the raw logits at each chosen token; shorter where the
        drafter has no proposal). Drafters that propose whole paths at once (prompt lookup) implement it and list it
        in ``capabilities``."""
        raise NotImplementedError(f"{type(self).__name__} does not declare the 'greedy_chain' capability")

    def topk_logprobs(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fast path ``"topk_logprobs"``: ``(values, tokens)`` ``[len(nodes), <= k]`` of the best children of each
        node under the log-softmax of ``expand``'s logits, best first, -inf where a node has fewer proposals.
        Drafters whose proposals are a handful of tokens (prompt lookup) implement it and list it in
        ``capabilities``, so a policy never builds and ranks ``[len(nodes), V]`` rows of -inf."""
        raise NotImplementedError(f"{type(self).__name__} does not declare the 'topk_logprobs' capability")

    @classmethod
    def expand_rows(cls, requests: list[tuple["Drafter", DraftTree, torch.Tensor]]) -> list[torch.Tensor]:
        """``expand`` for several rows of a batch at once: ``requests`` holds one ``(drafter, tree, nodes)`` per row,
        each drafter the per-sequence state of one row around the same model. Default: one ``expand`` per row;
        adapters that can join the rows into one batched forward override it and set `batches_rows`."""
        return [drafter.expand(tree, nodes) for drafter, tree, nodes in requests]

    #: whether `expand_rows` runs all rows in one forward (a batch's draft round then costs about one forward)
    batches_rows: bool = False

    def use_compiled(self, settings, batch: int = 1) -> None:
        """Called when the target's steps run compiled (``settings``: its `hf_treespec.compiled.CompileSettings`)
        before `start`, for a batch of ``batch`` rows: an adapter whose forwards cost enough to matter compiles them
        too. Default: stays eager."""

    @abstractmethod
    def commit(self, tree: DraftTree, accepted: torch.Tensor, features: TargetFeatures | None = None) -> None:
        """The target accepted path ``accepted`` (node indices, root first); drop every other tree row."""

    def bundled_path(self, name: str) -> Path | None:
        """``name`` inside the local folder the assistant model was loaded from, or None (no such entry, or a model
        that came from no folder). A drafter checkpoint can carry companions trained for it, such as the delay
        selector ``tree_policy="nde"`` uses (``delay_selector/``); this is how a policy finds them."""
        source = getattr(getattr(self, "model", None), "name_or_path", None)
        if not source:
            return None
        path = Path(source) / name
        return path if path.exists() else None


def as_drafter(model: torch.nn.Module, target: torch.nn.Module | None = None) -> Drafter:
    """Wraps an ``assistant_model`` in its adapter; with ``target``, the adapter first attaches the drafter to it
    (``Drafter.attach``: e.g. a feature drafter is tied to the target's embeddings). A `Drafter` is returned as is.

    The rule: of the registered adapters (``DRAFTER_ADAPTERS``) whose ``accepts(model)`` is true, the one with the
    highest ``priority`` wraps it; two at that priority is an error that names them (give one a higher priority, or
    pass the adapter instance itself as ``assistant_model``)."""
    if isinstance(model, Drafter):
        return model
    accepting = [DRAFTER_ADAPTERS.get(name) for name in DRAFTER_ADAPTERS if DRAFTER_ADAPTERS.get(name).accepts(model)]
    if not accepting:
        raise ValueError(
            f"Cannot use a {type(model).__name__} as a tree drafter: pass hf_treespec.drafters.prompt_lookup(target), "
            "a TreeSpecDrafterModel (hf_treespec.assets.default_drafter(target), or one from `hf-treespec train`), or "
            "an AutoModelForCausalLM sharing the target's vocabulary."
        )
    top = max(adapter.priority for adapter in accepting)
    chosen = [adapter for adapter in accepting if adapter.priority == top]
    if len(chosen) > 1:
        names = ", ".join(f"{adapter.name!r} ({adapter.__name__})" for adapter in chosen)
        raise ValueError(
            f"Ambiguous drafter adapters for a {type(model).__name__}: {names} all accept it at priority {top}. "
            "Give one of them a higher `priority`, or pass the adapter instance itself as assistant_model."
        )
    adapter = chosen[0]
    if target is not None:
        adapter.attach(model, target)
    return adapter(model)
