"""EAGLE-3 training: three target layers as input and the *training-time test* (TTT), with TALF's tree loss on top.

EAGLE-3 reads low / mid / high target layers instead of the last one, and trains the drafter on its own fed-back
features for several steps ("training-time test"), because that is what it sees after the first drafted token. Here
the TTT is a chain of the next ``ttt_steps - 1`` data tokens hanging off every position (the drafter's output feature
at each step feeds the next, with the keys / values of earlier steps visible, as at inference); with regenerated data
those tokens are the target's own continuation. When the prepared data also holds target-built trees (TALF), their
nodes join the same unroll, so one forward per depth trains both: every chain step and every tree node is scored by
cross-entropy to the target's distribution there (no feature regression, as in EAGLE-3 and TALF), optionally weighted
by ``step_decay ** (depth - 1)`` (EAGLE-3's code weighs step i by 0.8^i).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.collators import TALFCollator, chain_levels
from .trainer import TALFConfig, TALFTrainer
from .unroll import TreeLevels, gather_positions

#: ``--input-mode`` values of ``train prepare`` / ``train <objective>``
INPUT_MODES = ("fc", "eagle3")


def resolve_target_layers(input_mode: str, target_layers: list[int] | None, num_target_layers: int) -> list[int]:
    """The target layers to extract: explicit ones win; else ``eagle3`` = EAGLE-3's low / mid / high layers for the
    target's depth and ``fc`` = the pre-norm last state (EAGLE-1)."""
    from hf_treespec.api import eagle3_default_target_layers

    if input_mode not in INPUT_MODES:
        raise ValueError(f"input mode must be one of {INPUT_MODES}, got {input_mode!r}.")
    if target_layers:
        return [int(i) for i in target_layers]
    return eagle3_default_target_layers(num_target_layers) if input_mode == "eagle3" else [-1]


def infer_input_mode(input_mode: str, target_layers: list[int]) -> str:
    """``auto``: the EAGLE-3 layout for data with several target layers, EAGLE-1's (``fc``) for one."""
    if input_mode == "auto":
        return "eagle3" if len(target_layers) > 1 else "fc"
    if input_mode not in INPUT_MODES:
        raise ValueError(f"input mode must be 'auto' or one of {INPUT_MODES}, got {input_mode!r}.")
    return input_mode


def merge_levels(first: TreeLevels, second: TreeLevels) -> tuple[TreeLevels, torch.Tensor, torch.Tensor]:
    """One depth-ordered layout holding the nodes of both (same batch rows and roots' context columns).

    Returns the merged levels and, for each input, the index of its node slots in the merged layout (so per-node
    tensors such as labels can be placed alongside). Within a depth the first input's nodes come first."""
    if first.tokens.shape[0] != second.tokens.shape[0]:
        raise ValueError("merge_levels needs the same batch rows in both layouts.")
    widths = [_level_widths(first), _level_widths(second)]
    depth = max(len(widths[0]), len(widths[1]))
    for w in widths:
        w.extend([0] * (depth - len(w)))
    maps, offset = [[], []], 0
    for level in range(depth):
        for part in (0, 1):
            maps[part].append(torch.arange(offset, offset + widths[part][level]))
            offset += widths[part][level]
    maps = [torch.cat(m).long() if m else torch.zeros(0, dtype=torch.long) for m in maps]
    size, batch = offset, first.tokens.shape[0]
    merged = TreeLevels(
        tokens=first.tokens.new_zeros(batch, size), parents=first.parents.new_full((batch, size), -1),
        roots=first.roots.new_zeros(batch, size), depth=first.depth.new_zeros(batch, size),
        valid=first.valid.new_zeros(batch, size),
        bounds=torch.tensor([[sum(widths[0][:lv]) + sum(widths[1][:lv]),
                              sum(widths[0][:lv + 1]) + sum(widths[1][:lv + 1])] for lv in range(depth)],
                            dtype=torch.long).reshape(-1, 2),
    )
    for part, index in zip((first, second), maps):
        if index.numel() == 0:
            continue
        index = index.to(part.tokens.device)
        parents = torch.where(part.parents >= 0, index[part.parents.clamp(min=0)], part.parents)
        for name, value in (("tokens", part.tokens), ("parents", parents), ("roots", part.roots),
                            ("depth", part.depth), ("valid", part.valid)):
            getattr(merged, name)[:, index] = value
    return merged, maps[0], maps[1]


def _level_widths(levels: TreeLevels) -> list[int]:
    return [int(stop - start) for start, stop in levels.bounds.tolist()]


@dataclass
class TTTCollator(TALFCollator):
    """The context batch plus, at every position, a chain of the next ``steps - 1`` data tokens (EAGLE-3's
    training-time test) and, with ``tree_loss`` and data prepared with a tree policy, the stored target trees' nodes.
    Every node carries its label state in ``node_label_hidden`` (the chain's are read from the context arrays at
    ``root + depth``) and ``node_loss_mask`` marks the scored ones."""

    steps: int = 7
    tree_loss: bool = True

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.steps < 1:
            raise ValueError(f"the training-time test needs steps >= 1, got {self.steps}.")
        has_trees = self.tree_loss and any(row["tree_roots"] for row in rows)
        batch = super().__call__(rows) if has_trees else self.context_batch(rows)
        chain = chain_levels(batch["input_ids"], batch["attention_mask"].sum(-1), self.steps - 1)
        index = (chain.roots + chain.depth).clamp(max=batch["input_ids"].shape[1] - 1)
        chain_mask = chain.valid & batch["context_mask"].gather(1, index)
        chain_labels = gather_positions(batch["label_hidden"], index)
        if has_trees:
            trees = TreeLevels.from_batch(batch)
            levels, chain_slots, tree_slots = merge_levels(chain, trees)
            labels = batch["label_hidden"].new_zeros(len(rows), levels.tokens.shape[1], self.hidden_size)
            mask = torch.zeros_like(levels.valid)
            labels[:, chain_slots], mask[:, chain_slots] = chain_labels, chain_mask
            labels[:, tree_slots], mask[:, tree_slots] = batch["node_label_hidden"], batch["node_loss_mask"]
        else:
            levels, labels, mask = chain, chain_labels, chain_mask
        batch.update(levels.to_batch())
        batch["node_label_hidden"] = labels
        batch["node_loss_mask"] = mask
        batch["labels"] = torch.where(torch.cat([batch["context_mask"], mask], 1), 1, -100)
        return batch


@dataclass
class TTTConfig(TALFConfig):
    """EAGLE-3's training-time test (+ TALF's tree loss): TALF's optimiser settings, ``ttt_steps`` drafter passes."""

    ttt_steps: int = field(default=7, metadata={"help": "drafter passes per position (EAGLE-3: 7; 1 = no unroll)"})
    step_decay: float = field(default=0.8, metadata={"help": "weight of a depth-d item: step_decay ** (d - 1) "
                                                             "(EAGLE-3 weighs training-time-test step i by 0.8^i; "
                                                             "1 = every depth alike)"})
    tree_loss: bool = field(default=True, metadata={"help": "also score the stored TALF target trees, if any"})


class TTTTrainer(TALFTrainer):
    """Cross-entropy to the target along a ``ttt_steps``-step unroll of the drafter on its own features over the
    data (EAGLE-3's training-time test), and at the nodes of the stored target trees when the data has them (TALF)."""

    config_class = TTTConfig
    collator_class = TTTCollator
    objective_name = "ttt"

    @classmethod
    def make_collator(cls, prepared, args):
        return cls.collator_class.from_prepared(prepared, steps=args.ttt_steps, tree_loss=args.tree_loss)

    def item_weights(self, depth: torch.Tensor) -> torch.Tensor | None:
        if self.args.step_decay == 1.0:
            return None
        return self.args.step_decay ** (depth - 1).float()
