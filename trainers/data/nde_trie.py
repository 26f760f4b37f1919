"""Sampling every delayed tree of the NDE action space at once, as one trie (see :mod:`.nde_data` for why sharing
draws across actions is exact), and the verifiers' per-node tables over it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hf_treespec.api import (
    RandomSource, Randomness, categorical, DraftTree, Regime, NodeTable, branching_law, node_tables,
)

#: a draft / target callable: ``(tree, nodes) -> [len(nodes), V]`` warped probabilities
ProbsFn = Callable[[DraftTree, torch.Tensor], torch.Tensor]


@dataclass
class SampledTrees:
    """``num_trees`` samples of every delayed tree of the action space, merged into one trie.

    Attributes:
        trie: all sampled paths merged by prefix (node 0 = root); q recorded at every expanded node.
        trunk: ``[N, max_l1 + 1]`` trie node at each trunk depth of sample s (column 0 = the root).
        branches: ``[N, len(trunks), max_k, max_l2 + 1]`` trie nodes of path j grown from the trunk node at depth
            ``trunks[t]`` (column 0 = that node), in draw order.
        trunks: the trunk lengths l1 that have paths.
    """

    trie: DraftTree
    trunk: torch.Tensor
    branches: torch.Tensor
    trunks: list[int]


def _draw(probs: torch.Tensor, inverse: torch.Tensor, generator: Randomness) -> torch.Tensor:
    """One i.i.d. token per slot; slot i draws from ``probs[inverse[i]]`` (slots are distinguishable paths, so their
    order matters). Inverse-CDF sampling on each distinct row (``torch.multinomial`` is far slower on 49k-token rows);
    the generator must live on ``probs``' device."""
    if isinstance(generator, RandomSource):
        return torch.tensor([categorical(probs[int(r)], generator) for r in inverse], dtype=torch.long)
    cdf = probs.float().cumsum(-1)
    sizes = torch.bincount(inverse, minlength=probs.shape[0])
    order = torch.sort(inverse, stable=True).indices
    rank = torch.empty_like(inverse)
    rank[order] = torch.arange(inverse.numel()) - (sizes.cumsum(0) - sizes)[inverse[order]]
    uniform = torch.rand(probs.shape[0], int(sizes.max()), generator=generator, device=probs.device) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniform, right=True).clamp(max=probs.shape[1] - 1).cpu()
    return tokens[inverse, rank]


def sample_trees(
    draft: ProbsFn, root_token: int, num_trees: int, trunks: Sequence[int], max_paths: int, max_branch: int,
    generator: Randomness = None, device: torch.device | str = "cpu",
) -> SampledTrees:
    """Grows, level by level with one draft call per level, ``num_trees`` trunks of ``max(trunks)`` tokens and from
    each trunk depth in ``trunks`` ``max_paths`` i.i.d. paths of ``max_branch`` tokens, every draw from q."""
    trunks = sorted({int(t) for t in trunks})
    longest, n, t_count, k = max(trunks), num_trees, len(trunks), max_paths
    owners = torch.arange(n).repeat_interleave(t_count * k)
    starts = torch.cat([torch.zeros(n, dtype=torch.long),
                        torch.tensor(trunks).repeat_interleave(k).repeat(n)])
    lengths = torch.cat([torch.full((n,), longest), torch.full((n * t_count * k,), max_branch)])
    path = torch.full((starts.numel(), max(longest, max_branch) + 1), -1, dtype=torch.long)
    path[:n, 0] = 0
    trie = DraftTree.root(root_token, device=device, regime=Regime.IID)
    child_of: dict[tuple[int, int], int] = {}
    expanded, tables = [], []  # q is recorded once at the end (recording per level re-copies the growing table)
    for level in range(longest + max_branch):
        beginning = (starts[n:] == level).nonzero().flatten()
        if beginning.numel():
            path[n + beginning, 0] = path[owners[beginning], level]
        active = ((starts <= level) & (level < starts + lengths)).nonzero().flatten()
        if active.numel() == 0:
            continue
        cols = level - starts[active]
        current = path[active, cols]
        frontier, inverse = current.unique(return_inverse=True)
        probs = draft(trie, frontier.to(device))
        expanded.append(frontier)
        tables.append(probs)
        tokens = _draw(probs, inverse, generator)
        new_parents, new_tokens, children = [], [], []
        for u, x in zip(current.tolist(), tokens.tolist()):
            if (u, x) not in child_of:
                child_of[(u, x)] = trie.num_nodes + len(new_parents)
                new_parents.append(u)
                new_tokens.append(x)
            children.append(child_of[(u, x)])
        if new_parents:
            parents = torch.tensor(new_parents)
            xs = torch.tensor(new_tokens)
            rows = torch.searchsorted(frontier, parents)
            logq = probs[rows.to(probs.device), xs.to(probs.device)].log()
            trie = trie.add_children(parents.to(device), xs.to(device), logq)
        path[active, cols + 1] = torch.tensor(children)
    trie = trie.record_draft_probs(torch.cat(expanded).to(device), torch.cat(tables))
    return SampledTrees(trie=trie, trunk=path[:n, : longest + 1],
                        branches=path[n:, : max_branch + 1].view(n, t_count, k, max_branch + 1), trunks=trunks)


def trie_tables(trees: SampledTrees, target: ProbsFn, verifier: str, max_paths: int,
                chunk: int = 128) -> dict[int, NodeTable]:
    """:class:`NodeTable` of every expanded trie node, target probabilities fetched ``chunk`` nodes at a time."""
    trie = trees.trie
    expanded = (trie.q_index >= 0).nonzero().flatten()
    kids: dict[int, list[int]] = {}
    for u, x in zip(trie.parents.tolist(), trie.tokens.tolist()):
        if u >= 0:
            kids.setdefault(u, []).append(x)
    solver = branching_law(verifier)
    depth_of = solver.branching_rows
    columns = solver.branching_columns  # None when the verifier's law reads no per-child columns
    copies = max_copies(trees).tolist()
    tables: dict[int, NodeTable] = {}
    for start in range(0, expanded.numel(), chunk):
        nodes = expanded[start : start + chunk]
        p = target(trie, nodes)
        q = trie.draft_probs[trie.q_index[nodes]].to(p.device, p.dtype)
        ids = nodes.tolist()
        for node, table in zip(ids, node_tables(p, q, [kids[v] for v in ids], [depth_of(copies[v]) for v in ids],
                                                columns)):
            tables[node] = table
    return tables


def max_copies(trees: SampledTrees) -> torch.Tensor:
    """``[n]`` the most draws any one action tree makes at each trie node (k paths through a node = k copies in its
    child list; a trunk node has one), which bounds the residual rows its table needs."""
    copies = torch.zeros(trees.trie.num_nodes, dtype=torch.long)
    parents = trees.branches[..., :-1]  # [N, T, K, L2]: the node each draw was made at
    n, t, _, levels = parents.shape
    group = (torch.arange(n * t).view(n, t, 1, 1) * levels + torch.arange(levels)).expand_as(parents)
    pairs, counts = torch.stack([group.flatten(), parents.flatten()], 1).unique(dim=0, return_counts=True)
    copies.scatter_reduce_(0, pairs[:, 1], counts, reduce="amax")
    trunk = trees.trunk[:, :-1].flatten()
    copies[trunk] = copies[trunk].clamp(min=1)
    return copies
