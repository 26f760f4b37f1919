"""`DraftTree`: a speculation tree held as flat tensors (one row per node), never as Python node objects.

Node 0 is the root: the last committed token, whose KV row is not yet in the target cache. Every other node is a
draft token whose parent index is smaller than its own, so ``tokens[parents[i]]`` precedes ``tokens[i]``.
Siblings appear in draft-rank order (best first), which is the order sequential verifiers visit them in.

The structure (tokens, parents, depths, scores, uids, counts and the ancestor mask) is host bookkeeping: it lives on
the CPU whatever device the models run on, so growing, pruning and walking a tree never waits for an accelerator.
``add_children`` / ``add_path`` accept device tensors and copy them to the host once per call; only the recorded
draft distributions (``draft_probs``, ``[m, V]`` rows the verifiers read next to the target's) stay on the device
they came from. The ancestor mask is extended row by row as nodes are appended (a new node's row is its parent's
row plus itself), never rebuilt from scratch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch


def host_longs(values: list[int]) -> torch.Tensor:
    """A host int64 tensor of ``values`` (a numpy round trip: ~1 us, where ``torch.tensor(list)`` takes ~3 us)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the host, the device ones moved in ONE copy (one sync on a GPU instead of one per tensor): their
    bytes are packed into one buffer on the device, copied, and viewed back. Host tensors are returned as they are."""
    moving = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    if len(moving) < 2 or len({tensors[i].device for i in moving}) > 1:
        return tuple(t.cpu() for t in tensors)
    order = sorted(moving, key=lambda i: -tensors[i].element_size())  # widest first: every slice stays aligned
    buffer = torch.cat([tensors[i].detach().contiguous().reshape(-1).view(torch.uint8) for i in order]).cpu()
    out, offset = list(tensors), 0
    for i in order:
        size = tensors[i].numel() * tensors[i].element_size()
        out[i] = buffer[offset : offset + size].view(tensors[i].dtype).view(tensors[i].shape)
        offset += size
    return tuple(out)


class Regime:
    """How children are made: decides which verifiers stay lossless (docs/algorithms.md, "Drafting regimes")."""

    DETERMINISTIC = "deterministic"  # top-k by draft score (EAGLE-2, optimal, SALF, C2T, chain at T=0)
    IID = "iid"  # paths sampled with replacement from q (SpecInfer / SpecTr, delayed expansion)
    SWOR = "swor"  # siblings sampled without replacement from q (Sequoia, DySpec)

    ALL = (DETERMINISTIC, IID, SWOR)


@dataclass
class DraftTree:
    """Flat tensor representation of a draft tree.

    Attributes:
        tokens: ``[n]`` token id per node (node 0 = root).
        parents: ``[n]`` parent index, -1 for the root.
        depth: ``[n]`` distance from the root.
        scores: ``[n]`` cumulative draft log-probability of the path root -> node (root: 0).
        regime: one of :class:`Regime`.
        draft_probs: optional ``[m, V]`` table of warped draft distributions q(. | node) for expanded nodes.
        q_index: ``[n]`` row of ``draft_probs`` holding q(. | node), -1 where the node was not expanded.
        draft_support: optional sorted columns outside which every row of ``draft_probs`` is zero (a drafter's
            reduced vocabulary): verifiers may pass over them instead of the vocabulary.
        uids: ``[n]`` identity of each node that survives ``select`` (caches map uids, not indices, to KV rows).
        counts: optional ``[n]`` multiplicity of each node in its parent's child list: the number of i.i.d. draft
            draws at the parent that produced this token (i.i.d. trees merge equal draws into one node, so verifiers
            see children "with multiplicity" without duplicate rows in the target forward). None means all ones.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor
    regime: str = Regime.DETERMINISTIC
    draft_probs: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    draft_support: torch.Tensor | None = None
    uids: torch.Tensor | None = None
    next_uid: int = 1
    counts: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens.device.type != "cpu":
            raise ValueError("DraftTree structure is host bookkeeping: build it on the CPU (DraftTree.root(token)); "
                             "add_children / add_path accept device tensors and copy them over.")
        if self.uids is None:  # trees written out by hand (tests, tools): identities are the indices
            self.uids = torch.arange(self.tokens.shape[0], device=self.tokens.device)
            self.next_uid = int(self.tokens.shape[0])

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def root(cls, token: int | torch.Tensor, device: torch.device | str = "cpu", regime: str = Regime.DETERMINISTIC):
        """A one-node tree. ``device`` is accepted for backward compatibility and ignored: trees live on the host."""
        tree = cls(
            tokens=torch.full((1,), int(token), dtype=torch.long),
            parents=torch.full((1,), -1, dtype=torch.long),
            depth=torch.zeros(1, dtype=torch.long),
            scores=torch.zeros(1, dtype=torch.float32),
            regime=regime,
            uids=torch.zeros(1, dtype=torch.long),
        )
        tree._cache["anc"] = torch.ones(1, 1, dtype=torch.bool)
        return tree

    def add_children(
        self, parents: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor | None = None
    ) -> "DraftTree":
        """Returns a new tree with children appended; ``logprobs`` is the child's own draft log-prob (not cumulative).

        ``counts`` (optional) is each child's multiplicity in its parent's child list (see the class docstring).
        Children of draft probability zero (log-prob -inf) are never drafts and are dropped.
        """
        parents, tokens, logprobs, *rest = to_host(parents, tokens, logprobs, *(() if counts is None else (counts,)))
        counts = rest[0] if rest else None
        if not all(map(math.isfinite, logprobs.tolist())):  # (a host list: no tensor op when all are finite)
            finite = torch.isfinite(logprobs)
            parents, tokens, logprobs = parents[finite], tokens[finite], logprobs[finite]
            counts = None if counts is None else counts[finite]
        if parents.dtype != torch.long:
            parents = parents.long()
        if counts is None and self.counts is None:
            new_counts = None
        else:
            old = self.counts if self.counts is not None else torch.ones_like(self.tokens)
            new = counts.long() if counts is not None else torch.ones_like(parents)
            new_counts = torch.cat([old, new])
        if logprobs.dtype != torch.float32:
            logprobs = logprobs.float()
        return self._append(tokens, parents, self.depth.index_select(0, parents).add_(1),
                            self.scores.index_select(0, parents).add_(logprobs), new_counts)

    def add_path(self, parent: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> "DraftTree":
        """Returns a new tree with the chain ``tokens`` hung below ``parent`` in one call (``logprobs``: each token's
        own draft log-prob). Equivalent to one ``add_children`` per token, for drafters that propose a whole path."""
        tokens, logprobs = to_host(tokens, logprobs)
        count = int(tokens.numel())
        if count == 0:
            return self
        start = self.num_nodes
        parents = torch.cat([torch.tensor([int(parent)]), torch.arange(start, start + count - 1)])
        steps = torch.arange(1, count + 1)
        counts = None if self.counts is None else torch.cat([self.counts, torch.ones_like(parents)])
        return self._append(tokens, parents, self.depth[parent] + steps,
                            self.scores[parent] + logprobs.float().cumsum(0), counts)

    def _append(self, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, scores: torch.Tensor,
                counts: torch.Tensor | None) -> "DraftTree":
        """The new nodes' fields appended (``counts``: the whole new column, or None); fresh uids, no recorded q."""
        count = int(parents.numel())
        cache = {}
        anc = self._cache.get("anc")
        if anc is not None:  # extend the mask: a new node sees its parent's ancestors and itself
            n, total = self.num_nodes, self.num_nodes + count
            levels = _parent_levels(parents.tolist(), n)
            if len(levels) == 1:  # children of existing nodes: their parents' rows, then themselves, in one block
                seen = torch.cat([anc.index_select(0, parents), torch.eye(count, dtype=torch.bool)], dim=1)
                cache["anc"] = torch.cat([torch.cat([anc, anc.new_zeros(n, count)], dim=1), seen])
            else:
                grown = torch.zeros(total, total, dtype=torch.bool)
                grown[:n, :n] = anc
                for lo, hi in levels:  # one run per level of nodes whose parents have rows
                    grown[n + lo : n + hi] = grown.index_select(0, parents[lo:hi])
                    grown.diagonal()[n + lo : n + hi] = True
                cache["anc"] = grown
        next_uid = self.next_uid + count
        return replace(
            self,
            uids=torch.cat([self.uids, torch.arange(self.next_uid, next_uid)]),
            next_uid=next_uid,
            tokens=torch.cat([self.tokens, tokens if tokens.dtype == torch.long else tokens.long()]),
            parents=torch.cat([self.parents, parents]),
            depth=torch.cat([self.depth, depth]),
            scores=torch.cat([self.scores, scores]),
            q_index=None if self.q_index is None else torch.cat([self.q_index, torch.full_like(parents, -1)]),
            counts=counts,
            _cache=cache,
        )

    def record_draft_probs(self, nodes: torch.Tensor, probs: torch.Tensor,
                           support: torch.Tensor | None = None) -> "DraftTree":
        """Returns a new tree that remembers q(. | node) for ``nodes`` (rows of ``probs``), and ``support`` (sorted
        columns outside which those rows are zero; joined with the earlier tables' while each table has one)."""
        q_index = self.q_index if self.q_index is not None else torch.full_like(self.tokens, -1)
        start = 0 if self.draft_probs is None else self.draft_probs.shape[0]
        table = probs if self.draft_probs is None else torch.cat([self.draft_probs, probs.to(self.draft_probs.device)])
        q_index = q_index.clone()
        q_index[nodes.long().cpu()] = torch.arange(start, start + nodes.numel())
        if self.draft_probs is not None and support is not self.draft_support:  # the union covers every table
            known = self.draft_support
            support = (None if support is None or known is None
                       else torch.cat([known, support.to(known.device)]).unique())
        return replace(self, draft_probs=table, q_index=q_index, draft_support=support, _cache=dict(self._cache))

    def select(self, keep: torch.Tensor) -> "DraftTree":
        """Sub-tree with the nodes of the boolean/index ``keep`` (must be closed under parents; root kept first)."""
        keep = keep.cpu()
        if keep.dtype == torch.bool:
            keep = keep.nonzero().squeeze(-1)
        kept = keep.tolist()
        if kept != sorted(set(kept)):
            kept = sorted(set(kept))
            keep = host_longs(kept)
        if len(kept) == self.num_nodes:  # every node: the tree itself (trees are never changed in place)
            return self
        # the parents renumbered on the host: a list pass instead of a remap tensor
        parents = self.parents.tolist()
        index = {old: new for new, old in enumerate(kept)}
        new_parents = [index.get(parents[old], -1) for old in kept]
        if not kept or kept[0] != 0 or -1 in new_parents[1:]:
            raise ValueError("DraftTree.select: the kept set must contain the root and every kept node's parent")
        keep = keep.long()

        def pick(column: torch.Tensor | None) -> torch.Tensor | None:
            return None if column is None else column.index_select(0, keep)

        anc = self._cache.get("anc")
        return replace(
            self,
            tokens=pick(self.tokens),
            parents=host_longs(new_parents),
            depth=pick(self.depth),
            scores=pick(self.scores),
            q_index=pick(self.q_index),
            uids=pick(self.uids),
            counts=pick(self.counts),
            _cache={} if anc is None else {"anc": anc.index_select(0, keep).index_select(1, keep)},
        )

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def is_chain(self) -> bool:
        """True when every node has at most one child."""
        return self.num_nodes - 1 == self.max_depth

    def draft_q(self, node: int) -> torch.Tensor:
        """q(. | node) recorded while drafting; raises if the policy did not record it."""
        if self.q_index is None or int(self.q_index[node]) < 0:
            raise ValueError(f"node {node} has no recorded draft distribution (policy did not record q)")
        return self.draft_probs[int(self.q_index[node])]

    # ------------------------------------------------------------------------------------------- derived tensors
    def ancestor_mask(self) -> torch.Tensor:
        """``[n, n]`` bool, ``[i, j]`` True iff j is i or an ancestor of i. Kept up to date as nodes are appended or
        selected; built by pointer chasing over depth only for trees written out by hand."""
        n = self.num_nodes
        if "anc" not in self._cache and torch.equal(self.depth, torch.arange(n, device=self.device)):
            # node i at depth i: a chain in depth order (node i's parent is node i - 1), so the mask is triangular
            self._cache["anc"] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        if "anc" not in self._cache:
            rows = torch.arange(n, device=self.device)
            anc = torch.zeros(n, n, dtype=torch.bool, device=self.device)
            anc[rows, rows] = True
            cur = self.parents.clone()
            for _ in range(self.max_depth):
                valid = cur >= 0
                anc[rows[valid], cur[valid]] = True
                cur = torch.where(valid, self.parents[cur.clamp(min=0)], cur)
            self._cache["anc"] = anc
        return self._cache["anc"]

    def paths(self) -> torch.Tensor:
        """``[n, max_depth + 1]`` tokens on the path root -> node, padded with -1 after the node's depth."""
        if "paths" not in self._cache:
            anc = self.ancestor_mask()
            node, ancestor = anc.nonzero(as_tuple=True)
            out = torch.full((self.num_nodes, self.max_depth + 1), -1, dtype=torch.long, device=self.device)
            out[node, self.depth[ancestor]] = self.tokens[ancestor]
            self._cache["paths"] = out
        return self._cache["paths"]

    def path_to(self, node: int) -> torch.Tensor:
        """Node indices root -> ``node``."""
        return self.ancestor_mask()[node].nonzero().squeeze(-1)

    def children(self, node: int) -> torch.Tensor:
        """Indices of the children of ``node`` in sibling (draft-rank) order."""
        return (self.parents == node).nonzero().squeeze(-1)

    def multiplicity(self) -> torch.Tensor:
        """``[n]`` multiplicity of every node in its parent's child list (ones when the tree has no ``counts``)."""
        return self.counts if self.counts is not None else torch.ones_like(self.tokens)

    def num_children(self) -> torch.Tensor:
        """``[n]`` number of children per node."""
        counts = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
        counts.index_add_(0, self.parents[1:], torch.ones_like(self.parents[1:]))
        return counts


def _parent_levels(parents: list[int], start: int) -> list[tuple[int, int]]:
    """Splits appended nodes (new indices ``start + i``, parents ``parents``) into consecutive runs ``[lo, hi)`` whose
    parents all precede the run, so each run's mask rows can be copied from rows already written: one run for
    ``add_children`` (parents are existing nodes), one per node for a path from ``add_path``."""
    runs, lo = [], 0
    for i, parent in enumerate(parents):
        if parent - start >= lo:  # node i's parent is new too, in this run: a new run starts at i
            runs.append((lo, i))
            lo = i
    runs.append((lo, len(parents)))
    return [(lo, hi) for lo, hi in runs if hi > lo]


def on_path(tree: DraftTree, accepted: torch.Tensor) -> torch.Tensor:
    """Bool ``[num_nodes - 1]``: whether each draft node (root excluded) is on the accepted path."""
    mask = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.device)
    mask[accepted] = True
    return mask[1:]


def top_by_score(tree: DraftTree, count: int) -> DraftTree:
    """Keeps the root and the ``count`` best-scoring other nodes. Ties go to lower indices, so parents (score >=
    child's, index < child's) always outrank their children and the result is closed under parents."""
    if tree.num_nodes - 1 <= count:
        return tree
    order = torch.sort(-tree.scores[1:], stable=True).indices[:count] + 1
    keep = torch.cat([order.new_zeros(1), order])
    return tree.select(keep)
