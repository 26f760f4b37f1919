"""Tree policy interface: how a draft tree is grown. Policies see a draft source and the tree, never a verifier."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..registry import Registry
from ..tree import DraftTree, Regime
from .auto import check_budget, is_auto

if TYPE_CHECKING:
    from ..drafters.base import Drafter

POLICIES: Registry["TreePolicy"] = Registry("tree policy")


class DraftSource(Protocol):
    """What a policy may ask of the drafter: warped log-probabilities of the children of some nodes, in one forward."""

    def logprobs(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """``[len(nodes), V]`` log q(. | node) after the same logits processors as the target's."""

    # Optional fast paths (a source may offer them and may answer None; `draft_greedy_chain` / `topk_children` fall
    # back to ``logprobs``):
    #   ``greedy_chain(tree, node, length) -> (tokens, logprobs) | None``: the chain of draft argmaxes below ``node``;
    #   ``topk_logprobs(tree, nodes, k) -> (values, tokens) | None``: each node's best children, without [m, V] rows.


class TreePolicy(ABC):
    """Grows a `DraftTree` from a root token.

    ``defaults`` lists the generate kwargs the policy reads (``tree_budget``, ``tree_depth`` ...) with the values of its
    paper; the generation config overrides them. ``regime`` says how children are made (which verifiers stay
    lossless); ``default_verifier`` is used when sampling and the user named none.
    """

    defaults: ClassVar[dict[str, Any]] = {}
    regime: ClassVar[str] = Regime.DETERMINISTIC
    default_verifier: ClassVar[str] = "nss"
    name: ClassVar[str] = ""
    #: True for policies that implement ``tree_budget="auto"``
    supports_auto: ClassVar[bool] = False
    #: True for policies whose ``build`` takes ``context=`` (a `StepContext`, filled by the decoding loop per step)
    needs_step_context: ClassVar[bool] = False

    @property
    def auto_sized(self) -> bool:
        """True when the tree is sized per step by measured cost (``tree_budget="auto"``); the loop then passes a
        `StepContext` carrying its `SpeedModel` and learns from every verified step."""
        return is_auto(self.params.get("tree_budget"))

    def __init__(self, do_sample: bool = False, **params: Any):
        self.do_sample = do_sample
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise TypeError(f"tree_policy={self.name!r} does not take {sorted(unknown)}")
        self.params = {**self.defaults, **{k: v for k, v in params.items() if v is not None}}
        self.validate()

    #: kwargs the policy takes only with the value "auto" (the sampled policies' tree_budget)
    auto_only: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def takes(cls, key: str, value: Any = "auto") -> bool:
        """Whether ``key=value`` is a kwarg this policy reads (benchmark group overrides and sweeps ask)."""
        return key in cls.defaults and (key not in cls.auto_only or is_auto(value))

    @classmethod
    def defaults_from_drafter(cls, drafter: "Drafter") -> dict[str, Any]:
        """Values for generate kwargs the user left unset that come with the assistant model (a policy component
        trained for that drafter, say); generate kwargs always win. None by default."""
        return {}

    def validate(self) -> None:
        budget = self.params.get("tree_budget")
        if budget is not None:
            if is_auto(budget) and not self.supports_auto:
                raise ValueError(
                    f"tree_policy={self.name!r} does not size its tree by measured cost; tree_budget='auto' works "
                    "with the best-first policies (salf, optimal, eagle2). Give a number."
                )
            check_budget(budget)
        depth = self.params.get("tree_depth")
        if depth is not None and int(depth) < 1:
            raise ValueError(f"tree_depth must be >= 1, got {depth}.")
        topk = self.params.get("tree_topk")
        if topk is not None and int(topk) < 1:
            raise ValueError(f"tree_topk must be >= 1, got {topk}.")

    @property
    def is_chain(self) -> bool:
        """Whether every tree this policy builds is a single path (for chain-only verifiers)."""
        return False

    def regime_for(self) -> str:
        return self.regime

    @abstractmethod
    def build(self, source: DraftSource, root_token: int, device: torch.device) -> DraftTree:
        """Grows the tree for one decoding step."""


def top_by_score(tree: DraftTree, count: int) -> DraftTree:
    """Keeps the root and the ``count`` best-scoring other nodes. Ties go to lower indices, so parents (score >=
    child's, index < child's) always outrank their children and the result is closed under parents."""
    if tree.num_nodes - 1 <= count:
        return tree
    order = torch.sort(-tree.scores[1:], stable=True).indices[:count] + 1
    keep = torch.cat([order.new_zeros(1), order])
    return tree.select(keep)


def draft_greedy_chain(source: DraftSource, tree: DraftTree, node: int, length: int) -> DraftTree:
    """Hangs below ``node`` the chain of draft argmaxes, up to ``length`` tokens, stopping where q has no support.

    A source that offers ``greedy_chain`` (prompt lookup without logits processors) proposes the whole chain in one
    call; any other is asked depth by depth. Both give the same tree.
    """
    fast = getattr(source, "greedy_chain", None)
    chain = fast(tree, node, length) if fast is not None else None
    if chain is not None:
        return tree.add_path(node, *chain)
    current = torch.tensor([node], device=tree.device)
    for _ in range(length):
        logq, token = source.logprobs(tree, current).max(dim=-1)  # argmax (first on ties), ~3x faster on CPU
        if not bool(torch.isfinite(logq).all()):  # the drafter has no proposal here
            break
        tree = tree.add_children(current, token, logq)
        current = torch.tensor([tree.num_nodes - 1], device=tree.device)
    return tree


def topk_children(
    source: DraftSource, tree: DraftTree, nodes: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, tokens)`` ``[len(nodes), <= k]``: each node's ``k`` most likely children under q, best first, -inf
    where q has fewer tokens (`DraftTree.add_children` drops those). Sparse when the source offers ``topk_logprobs``."""
    fast = getattr(source, "topk_logprobs", None)
    top = fast(tree, nodes, k) if fast is not None else None
    if top is None:
        logq = source.logprobs(tree, nodes)
        top = logq.topk(min(k, logq.shape[-1]), dim=-1)
    return top
