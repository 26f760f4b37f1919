"""Branching laws of top-down verifiers (Definition 5.3 of the delayed-expansion paper), in closed form.

At an expanded node with drafted children ``x_1..x_k`` (in draw order), a top-down verifier enters child c with some
probability that depends only on p and q at that node: its *branching probability*. Multiplying them along a path
gives the exact probability of accepting that path, which is how the NDE training data estimates block efficiency
without sampling the verifier. Each verifier that has such a law implements ``Verifier.branching`` (and says how many
SpecInfer residual rows its `NodeTable` needs); this module holds the table they read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


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
