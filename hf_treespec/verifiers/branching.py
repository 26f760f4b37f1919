"""Branching laws of top-down verifiers (Definition 5.3 of the delayed-expansion paper), in closed form.

At an expanded node with drafted children ``x_1..x_k`` (in draw order), a top-down verifier enters child c with some
probability that depends only on p and q at that node: its *branching probability*. Multiplying them along a path
gives the exact probability of accepting that path, which is how the NDE training data estimates block efficiency
without sampling the verifier. A verifier that has such a law also implements `BranchingLaw` (beside its
verification rule, in its own module); this module holds the protocol, the table the laws read, and `branching_law`,
which finds the law of a registered verifier. Only the NDE training data reads them; decoding never does.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .base import VERIFIERS


@dataclass
class NodeTable:
    """What the branching probabilities at one expanded node need, restricted to that node's drafted children.

    ``residuals[j][c]``: p_j(x_c), the target after j SpecInfer rejections (p_0 = p, p_j = norm((p_{j-1} - q)+),
    unchanged when that residual is empty, as in the verifiers); ``draft[c]``: q(x_c); ``argmax``: argmax of p;
    ``columns_for(k)``: per-child values a verifier whose solver depends on the number k >= 2 of drafted copies reads
    (``Verifier.branching_columns`` over the node's full p and q; computed on first use and kept, since each costs a
    few vocabulary-wide passes and most nodes only ever see one k).
    """

    tokens: list[int]
    residuals: list[list[float]]
    draft: list[float]
    argmax: int
    column: dict[int, int] = field(default_factory=dict)
    columns: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    column_fn: Callable[[int], dict[str, list[float]]] | None = None

    def __post_init__(self) -> None:
        self.column = {t: c for c, t in enumerate(self.tokens)}

    def columns_for(self, k: int) -> dict[str, list[float]]:
        if k not in self.columns:
            if self.column_fn is None:
                raise ValueError("this node table was built without the verifier's branching columns.")
            self.columns[k] = self.column_fn(k)
        return self.columns[k]


class BranchingLaw(ABC):
    """A top-down verifier's branching law in closed form: the probability of entering each drafted child of a node
    from p and q there. Implemented by the verifiers that have one (mixed into their class)."""

    #: Laws that read ``NodeTable.columns`` define it as a method ``branching_columns(p, q, tokens, k) -> {name:
    #: [value per child]}``: per-child values (``tokens``: the node's distinct drafted children) for a child list of
    #: ``k`` copies, computed from the node's full ``[V]`` p and q with the solver's own arithmetic (SpecTr's
    #: division factor, Khisti's selection law depend on k and the whole vocabulary). None: the law needs no columns.
    branching_columns: Callable[[torch.Tensor, torch.Tensor, list[int], int], dict[str, list[float]]] | None = None

    @abstractmethod
    def branching(self, table: NodeTable, order: list[int]) -> dict[int, float]:
        """Probability of entering each child (columns of ``table``, visited in ``order``, a child once per copy)
        at a node whose p / q are summarised by ``table``."""

    def branching_rows(self, copies: int) -> int:
        """SpecInfer residual rows (p_0 = p, p_j = norm((p_{j-1} - q)+)) :meth:`branching` reads at a node whose
        child lists hold at most ``copies`` draws."""
        return 1


def laws() -> list[str]:
    """Names of the registered verifiers that have a closed-form branching law."""
    return sorted(name for name in VERIFIERS if issubclass(VERIFIERS.get(name), BranchingLaw))


def branching_law(verifier: str) -> BranchingLaw:
    """The branching law of the registered verifier ``verifier`` (an instance of it)."""
    cls = VERIFIERS.get(verifier)
    if not issubclass(cls, BranchingLaw):
        raise ValueError(f"verifier={verifier!r} has no closed-form branching law; the top-down verifiers "
                         f"{laws()} have one (traversal is bottom-up: it has no per-node branching law).")
    return cls()


def node_tables(
    p: torch.Tensor, q: torch.Tensor, children: list[list[int]], depths: Sequence[int],
    columns: Callable[[torch.Tensor, torch.Tensor, list[int], int], dict[str, list[float]]] | None = None,
) -> list[NodeTable]:
    """:class:`NodeTable` of each row (``p``, ``q`` ``[m, V]``; ``children[i]``: that node's distinct child tokens;
    ``depths[i]``: residual rows it needs). The residual chain runs only over the rows that still need it.
    ``columns(p_row, q_row, tokens, k)`` (a verifier's ``branching_columns``) backs ``NodeTable.columns_for``."""
    order = sorted(range(len(children)), key=lambda i: -depths[i])
    rows = torch.tensor(order, device=p.device)
    p, q = p[rows], q[rows]
    width = max(len(c) for c in children)
    index = torch.tensor([children[i] + [0] * (width - len(children[i])) for i in order], device=p.device)
    current = p
    gathered = torch.zeros(len(order), max(depths), width, dtype=p.dtype, device=p.device)
    gathered[:, 0] = p.gather(1, index)
    for j in range(1, max(depths)):
        live = sum(1 for i in order if depths[i] > j)  # a prefix: rows are sorted by depth
        current = current[:live]
        excess = (current - q[:live]).clamp(min=0)
        total = excess.sum(-1, keepdim=True)
        current = torch.where(total > 0, excess / total.clamp(min=torch.finfo(p.dtype).tiny), current)
        gathered[:live, j] = current.gather(1, index[:live])
    residuals, draft, argmax = gathered.tolist(), q.gather(1, index).tolist(), p.argmax(-1).tolist()
    tables: list[NodeTable | None] = [None] * len(order)
    for r, i in enumerate(order):
        c = len(children[i])
        tables[i] = NodeTable(tokens=list(children[i]), residuals=[row[:c] for row in residuals[r][: depths[i]]],
                              draft=draft[r][:c], argmax=argmax[r])
        if columns is not None:
            tables[i].column_fn = functools.partial(columns, p[r], q[r], list(children[i]))
    return tables
