"""Collators: prepared rows -> padded drafter batches, one per objective.

Alignment (``TreeSpecDrafterModel.forward``): drafter position ``j`` reads token ``x[j + 1]`` with the target state
``h[j]`` and is scored against the target's distribution at ``j + 1`` (recomputed from the pre-norm state), which
predicts ``x[j + 2]``; the position counts when ``x[j + 2]`` is an assistant token.

Every batch carries ``labels``: a loss-item marker (1 per scored position or tree node, -100 elsewhere). The Trainer
counts it for ``num_items_in_batch``, so losses are normalised over all items of a gradient-accumulation window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .prepared import STORAGE_DTYPES, PreparedData, decode_tensor
from ..objectives.unroll import TreeLevels


@dataclass
class DrafterCollator:
    """Context batch (EAGLE): ``input_ids``, ``attention_mask``, ``target_hidden_states`` (drafter inputs),
    ``next_hidden_states`` (feature-regression targets), ``label_hidden`` (soft-label source), ``context_mask``."""

    feature_size: int
    hidden_size: int
    storage_dtype: str = "bfloat16"
    stores_last_hidden: bool = False
    last_slot: int = 0  # which feature slot holds the pre-norm last state when it has no column of its own

    @classmethod
    def from_prepared(cls, data: PreparedData, **kwargs: Any) -> "DrafterCollator":
        layers = data.config.target_layers
        return cls(feature_size=data.feature_size, hidden_size=data.hidden_size,
                   storage_dtype=data.config.storage_dtype, stores_last_hidden=data.config.stores_last_hidden,
                   last_slot=layers.index(-1) if -1 in layers else 0, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.storage_dtype]

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.context_batch(rows)
        batch["labels"] = torch.where(batch["context_mask"], 1, -100)
        return batch

    def context_batch(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(row["input_ids"]) for row in rows]
        if min(lengths) < 2:
            raise ValueError("every prepared row needs at least 2 tokens.")
        size, width = len(rows), max(lengths) - 1
        input_ids = torch.zeros(size, width, dtype=torch.long)
        attention = torch.zeros(size, width, dtype=torch.long)
        context_mask = torch.zeros(size, width, dtype=torch.bool)
        inputs = torch.zeros(size, width, self.feature_size, dtype=self.dtype)
        nexts = torch.zeros(size, width, self.feature_size, dtype=self.dtype)
        labels = torch.zeros(size, width, self.hidden_size, dtype=self.dtype)
        for b, row in enumerate(rows):
            n = lengths[b] - 1
            ids = torch.tensor(row["input_ids"], dtype=torch.long)
            mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
            states = decode_tensor(row["hidden_states"], self.dtype, self.feature_size)
            last = (decode_tensor(row["last_hidden_state"], self.dtype, self.hidden_size) if self.stores_last_hidden
                    else states[:, self.last_slot * self.hidden_size:(self.last_slot + 1) * self.hidden_size])
            input_ids[b, :n] = ids[1:]
            attention[b, :n] = 1
            context_mask[b, : n - 1] = mask[2:]
            inputs[b, :n] = states[:-1]
            nexts[b, :n] = states[1:]
            labels[b, :n] = last[1:]
        return {"input_ids": input_ids, "attention_mask": attention, "target_hidden_states": inputs,
                "next_hidden_states": nexts, "label_hidden": labels, "context_mask": context_mask}


@dataclass
class EAGLECollator(DrafterCollator):
    """EAGLE: the context batch only."""


@dataclass
class HASSCollator(DrafterCollator):
    """HASS: the context batch plus, at every position, a chain of the next ``steps - 1`` data tokens (the drafter
    feeds its own features along it). Node labels / regression targets are read from the context arrays at
    ``root + depth``; ``node_loss_mask`` marks the scored nodes."""

    steps: int = 3

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.steps < 1:
            raise ValueError(f"HASS needs steps >= 1, got {self.steps}.")
        batch = self.context_batch(rows)
        levels = chain_levels(batch["input_ids"], batch["attention_mask"].sum(-1), self.steps - 1)
        index = (levels.roots + levels.depth).clamp(max=batch["input_ids"].shape[1] - 1)
        node_mask = levels.valid & batch["context_mask"].gather(1, index)
        batch.update(levels.to_batch())
        batch["node_loss_mask"] = node_mask
        batch["labels"] = torch.where(torch.cat([batch["context_mask"], node_mask], 1), 1, -100)
        return batch


def chain_levels(input_ids: torch.Tensor, lengths: torch.Tensor, depth: int) -> TreeLevels:
    """Chains of data tokens: at level d (1..depth), the node of root j is token ``input_ids[j + d]``."""
    size, width = input_ids.shape
    positions = torch.arange(width)
    tokens, parents, roots, depths, valid = [], [], [], [], []
    for level in range(1, depth + 1):
        index = (positions + level).clamp(max=width - 1)
        tokens.append(input_ids[:, index])
        parents.append((positions + (level - 2) * width).expand(size, -1) if level > 1
                       else torch.full((size, width), -1, dtype=torch.long))
        roots.append(positions.expand(size, -1))
        depths.append(torch.full((size, width), level, dtype=torch.long))
        valid.append((positions + level)[None, :] < lengths[:, None])
    if depth == 0:
        empty = torch.zeros(size, 0, dtype=torch.long)
        return TreeLevels(empty, empty, empty, empty, empty.bool(), torch.zeros(0, 2, dtype=torch.long))
    bounds = torch.tensor([[i * width, (i + 1) * width] for i in range(depth)], dtype=torch.long)
    return TreeLevels(torch.cat(tokens, 1), torch.cat(parents, 1).contiguous(), torch.cat(roots, 1).contiguous(),
                      torch.cat(depths, 1), torch.cat(valid, 1), bounds)


@dataclass
class TALFCollator(DrafterCollator):
    """TALF: the context batch (every position is a tree root whose label is free) plus the stored target trees'
    expanded nodes, with their labels in ``node_label_hidden`` and ``node_loss_mask``."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.context_batch(rows)
        node_rows = [stored_tree_nodes(row) for row in rows]
        levels, slots = TreeLevels.from_arrays(node_rows)
        node_hidden = torch.zeros(len(rows), levels.tokens.shape[1], self.hidden_size, dtype=self.dtype)
        for b, (row, slot) in enumerate(zip(rows, slots)):
            hidden = decode_tensor(row["tree_hidden"], self.dtype, self.hidden_size)
            if hidden.shape[0] != slot.numel():
                raise ValueError(f"row has {slot.numel()} tree nodes but {hidden.shape[0]} stored label states.")
            node_hidden[b, slot] = hidden
        batch.update(levels.to_batch())
        batch["node_label_hidden"] = node_hidden
        batch["node_loss_mask"] = levels.valid.clone()
        batch["labels"] = torch.where(torch.cat([batch["context_mask"], levels.valid], 1), 1, -100)
        return batch


def stored_tree_nodes(row: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, parents, roots, depth)`` of the non-root nodes of a prepared row's stored trees, in stored order:
    ``parents`` index this list (-1 = the tree's root), ``roots`` is the root's drafter position (its sequence
    position - 1), ``depth`` >= 1. Depths come from the parent pointers by pointer jumping, one tensor op per level."""
    sizes = torch.tensor([len(tokens) for tokens in row["tree_tokens"]], dtype=torch.long)
    if int(sizes.sum()) == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty, empty
    tokens = torch.tensor([t for tree in row["tree_tokens"] for t in tree], dtype=torch.long)
    local_parent = torch.tensor([q for tree in row["tree_parents"] for q in tree], dtype=torch.long)
    tree = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    first = (sizes.cumsum(0) - sizes)[tree]  # each node's tree root, as an index into this row's nodes
    local = torch.arange(tokens.numel()) - first
    is_root = local == 0
    bad = ~is_root & ((local_parent < 0) | (local_parent >= local))
    if bool(bad.any()):
        raise ValueError(f"stored tree parents must precede their nodes, got {row['tree_parents'][int(tree[bad][0])]}.")
    parent = torch.where(is_root, first, first + local_parent)
    depth = torch.zeros_like(local)
    for _ in range(int(sizes.max())):  # a parent precedes its child: one more level settles per pass
        deeper = torch.where(is_root, 0, depth[parent] + 1)
        if torch.equal(deeper, depth):
            break
        depth = deeper
    kept = ~is_root
    renumbered = kept.long().cumsum(0) - 1  # index among the non-root nodes
    parents = torch.where(is_root[parent], -1, renumbered[parent])
    roots = torch.tensor(row["tree_roots"], dtype=torch.long)[tree] - 1
    return tokens[kept], parents[kept], roots[kept], depth[kept]

