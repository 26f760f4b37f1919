"""Applies generate's own logits processors to every tree node, with the node's full prefix as ``input_ids``."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from ..tree import DraftTree


def process_tree_logits(
    processors: LogitsProcessorList, prefix_ids: torch.Tensor, tree: DraftTree, nodes: torch.Tensor,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Processed logits ``[len(nodes), V]``.

    ``prefix_ids`` ``[1, L]`` ends with the tree root. Node v sees ``prefix_ids + path(v)[1:]``, exactly what plain
    ``generate`` would pass after committing that path; nodes of equal depth share a length and go in one call.
    """
    if len(processors) == 0:
        return logits
    paths = tree.paths()
    out = torch.empty_like(logits)
    depths = tree.depth[nodes]
    for d in depths.unique().tolist():
        rows = (depths == d).nonzero().squeeze(-1)
        ids = torch.cat([prefix_ids.expand(rows.numel(), -1), paths[nodes[rows], 1 : d + 1].to(prefix_ids.device)], 1)
        out[rows] = processors(ids, logits[rows])
    return out
