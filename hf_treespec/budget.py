"""``tree_budget``: a number of draft nodes, or ``"auto"``; and `StepBudget`, the per-step size a policy reads.

A numeric budget is the policy's own parameter. ``"auto"`` hands sizing to the decoding loop: its sizing component
(`hf_treespec.generation.sizing.TreeSizing`) decides whether a step drafts at all and, when it does, puts a
`StepBudget` in the step's `StepContext` (``context.budget``). The policy consults it while it grows; it never sees
how the budget was priced (measured costs live in `hf_treespec.cost`), so policies depend on this protocol only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from .tree import DraftTree

AUTO = "auto"
#: children drafted per expanded node under "auto" (`StepBudget.max_children`): a node's j-th most likely child has
#: draft probability at most 1/j, and no measured cost curve let a row of acceptance 1/9 or less pay on its own;
#: drafting the 96 a full tree could hold (the fixed policies' k = budget + 1) made every round's host bookkeeping
#: several times a fixed tree's
AUTO_MAX_CHILDREN = 8


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


def check_budget(value) -> None:
    """``tree_budget`` is a positive int or "auto"."""
    if isinstance(value, str):
        if value != AUTO:
            raise ValueError(f"tree_budget must be a number of draft nodes (>= 1) or 'auto', got {value!r}.")
        return
    if int(value) < 1:
        raise ValueError(f"tree_budget must be >= 1 (number of draft nodes per step) or 'auto', got {value}.")


class StepBudget(Protocol):
    """One step's size, for one tree: what an auto-sized policy asks while it grows.

    * ``max_nodes``: the most draft nodes the tree may hold; ``max_children``: the most children worth drafting per
      expanded node;
    * ``in_best_prefix(tree, nodes, members)``: bool over ``nodes``, those the kept tree would hold now (only they
      are worth expanding);
    * ``expand_again(tree, expand, members)``: whether expanding the nodes ``expand`` (with ``members``, bool over
      nodes, the ones the tree would keep; all when None) is expected to pay; a True answer counts the expansion;
    * ``prune(tree)``: the kept tree (a prefix of nodes by draft score; the root alone when no draft pays);
    * ``choose_shape(nodes_of, max_k, max_l)``: the ``(k, l)`` of a sampled tree (``nodes_of(k, l)`` nodes), or
      None for a step without drafts.
    """

    max_nodes: int
    max_children: int

    def in_best_prefix(self, tree: "DraftTree", nodes: "torch.Tensor",
                       members: "torch.Tensor | None" = None) -> "torch.Tensor": ...

    def expand_again(self, tree: "DraftTree", expand: "torch.Tensor",
                     members: "torch.Tensor | None" = None) -> bool: ...

    def prune(self, tree: "DraftTree") -> "DraftTree": ...

    def choose_shape(self, nodes_of: Callable[[int, int], int], max_k: int, max_l: int) -> tuple[int, int] | None:
        ...


def step_budget(context, tree_budget, policy: str) -> StepBudget | None:
    """The `StepBudget` an auto-sized policy grows by this step (``context.budget``); None for a numeric
    ``tree_budget`` (the policy's own size). A clear error when ``"auto"`` comes without one."""
    if not is_auto(tree_budget):
        return None
    if context.budget is None:
        raise ValueError(
        f"tree_policy={policy!r} with tree_budget='auto' is sized per step by the decoding loop from measured costs; "
        "model.generate does that. When growing a tree by hand, give a number (tree_budget=16) or pass "
        "StepContext(budget=...) (e.g. hf_treespec.cost.TreeSizer(SpeedModel(curve), context_length))."
        )
    return context.budget
