"""Applies generate's own logits processors to every tree node, with the node's full prefix as ``input_ids``.

Most of generate's warpers (temperature, top-k, top-p, min-p, typical, epsilon, eta) transform each row of scores on
its own: they never read ``input_ids``. Those run once over all tree rows (one batched call, which also lets torch
spread the per-row sort of top-p over threads). Processors that read the prefix (repetition penalty,
no-repeat-ngram, min-length, bad words, ...) run per depth with each node's own prefix. A processor class not listed
in `PREFIX_INDEPENDENT` is treated as prefix-dependent (safe by default); `register_prefix_independent` adds one.
`run_processors` calls a list as transformers does, except the processors of `FAST_PROCESSORS`, computed a faster
way with the same output.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from itertools import groupby

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from ..tree import DraftTree

#: processor classes whose output row depends only on that row's scores (exact class match: a subclass may read the
#: prefix). Extend with `register_prefix_independent`.
PREFIX_INDEPENDENT: set[type] = {
    cls
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
        "EpsilonLogitsWarper", "EtaLogitsWarper", "InfNanRemoveLogitsProcessor", "LogitNormalization",
        "SuppressTokensLogitsProcessor",
    )
    if (cls := getattr(lp, name, None)) is not None
}


#: attributes in which transformers keeps processor state per batch row: the repetition penalty's
#: ``prompt_ignore_length`` holds each row's left padding for a padded batch.
ROW_STATE_ATTRIBUTES = ("prompt_ignore_length",)


def processors_for_rows(processors: LogitsProcessorList, rows: int | list[int]) -> LogitsProcessorList:
    """The processors as they apply to some rows of the batch, for a loop that calls them on single rows or groups
    of rows. Per-row state is narrowed to those rows: one row's value becomes a plain int (so the processor accepts
    any number of copies of that row, e.g. one per tree node), a group's an indexed tensor. Processors without such
    state are shared, not copied (the list itself, when none has any)."""
    if not any(isinstance(getattr(p, name, None), torch.Tensor) for p in processors for name in ROW_STATE_ATTRIBUTES):
        return processors
    narrowed = []
    for processor in processors:
        state = {name: value for name in ROW_STATE_ATTRIBUTES
                 if isinstance(value := getattr(processor, name, None), torch.Tensor)}
        if state:
            processor = copy.copy(processor)
            for name, value in state.items():
                if isinstance(rows, int):
                    setattr(processor, name, int(value[rows]))
                else:
                    setattr(processor, name, value[torch.as_tensor(rows, device=value.device)])
        narrowed.append(processor)
    return LogitsProcessorList(narrowed)


def _eos_suppressed(processor, scores: torch.Tensor, active: bool) -> torch.Tensor:
    """A copy of ``scores`` with the processor's EOS ids at -inf when ``active``: what the min-length processors
    compute through a vocabulary-wide ``isin`` and ``where`` (0.1-0.2 ms a call on a 49k vocabulary, paid per tree
    depth and per draft round)."""
    out = scores.clone()
    if active:
        eos = processor.eos_token_id.to(scores.device)
        out[..., eos[(eos >= 0) & (eos < scores.shape[-1])]] = -math.inf  # isin ignores ids outside the vocabulary
    return out


#: generate's processors computed a faster way with the same output (exact class -> function(processor, input_ids,
#: scores)); `run_processors` uses them, anything else runs as transformers runs it
FAST_PROCESSORS: dict[type, Callable] = {
    lp.MinLengthLogitsProcessor:
        lambda p, ids, scores: _eos_suppressed(p, scores, ids.shape[-1] < p.min_length),
    lp.MinNewTokensLengthLogitsProcessor:
        lambda p, ids, scores: _eos_suppressed(p, scores, ids.shape[-1] - p.prompt_length_to_skip < p.min_new_tokens),
}


def run_processors(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processors(input_ids, scores)``, the processors of `FAST_PROCESSORS` computed their faster way."""
    if not any(type(processor) in FAST_PROCESSORS for processor in processors):
        return processors(input_ids, scores)
    for processor in processors:
        fast = FAST_PROCESSORS.get(type(processor))
        scores = fast(processor, input_ids, scores) if fast else LogitsProcessorList([processor])(input_ids, scores)
    return scores


def register_prefix_independent(cls: type) -> type:
    """Declares a custom processor class row-wise (it must not read ``input_ids``), so tree rows share one call."""
    PREFIX_INDEPENDENT.add(cls)
    return cls


def is_prefix_independent(processor) -> bool:
    return type(processor) in PREFIX_INDEPENDENT


def process_tree_logits(
    processors: LogitsProcessorList, prefix_ids: torch.Tensor, tree: DraftTree, nodes: torch.Tensor,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Processed logits ``[len(nodes), V]``, in generate's processor order.

    ``prefix_ids`` ``[1, L]`` ends with the tree root. Node v sees ``prefix_ids + path(v)[1:]``, exactly what plain
    ``generate`` would pass after committing that path. Consecutive prefix-independent processors run once over all
    rows; each run of prefix-dependent ones runs per depth (nodes of equal depth share a length: one call).
    """
    if len(processors) == 0:
        return logits
    # fp32 scores, as generate hands its processors (a bf16 step's rows are cast where processed); a copy either way:
    # a processor may write in place, and the raw logits are returned separately
    out = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits.clone()
    for independent, run in groupby(processors, key=is_prefix_independent):
        run = list(run)
        if independent:
            ids = prefix_ids.expand(out.shape[0], -1)  # not read by these processors; shaped as generate passes it
            for processor in run:
                out = processor(ids, out)
        else:
            out = process_per_depth(LogitsProcessorList(run), prefix_ids, tree, nodes, out)
    return out


class NodeRows:
    """A tree's processed target logits where each node's row is processed on its first read.

    Why: a top-down verifier reads the rows of the nodes its walk visits (the accepted path, one to three rows of a
    five-node tree at T=1), and processing a row (generate's top-k warp over a 49152-token vocabulary) costs about
    0.2 ms on a 2-core CPU. ``rows[node]`` (an int) gives node's ``[V]`` row; ``rows[nodes]`` (a list or tensor of
    indices) stacks theirs, as the tensor `process_tree_logits` returns would."""

    def __init__(self, processors: LogitsProcessorList, prefix_ids: torch.Tensor, tree: DraftTree,
                 logits: torch.Tensor):
        self.processors, self.prefix_ids, self.tree, self.logits = processors, prefix_ids, tree, logits
        self._done: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, int):
            return self._row(index)
        return torch.stack([self._row(node) for node in torch.as_tensor(index).tolist()])

    def _row(self, node: int) -> torch.Tensor:
        row = self._done.get(node)
        if row is None:
            if not 0 <= node < len(self):
                raise IndexError(f"node {node} is not in a tree of {len(self)} nodes")
            row = process_tree_logits(self.processors, self.prefix_ids, self.tree, torch.tensor([node]),
                                      self.logits[node : node + 1])[0]
            self._done[node] = row
        return row


def process_per_depth(processors: LogitsProcessorList, prefix_ids: torch.Tensor, tree: DraftTree,
                      nodes: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Every processor called once per tree depth with each node's full prefix (correct for any processor)."""
    paths = tree.paths()
    out = torch.empty_like(logits)
    depths = tree.depth[nodes]
    for d in depths.unique().tolist():
        rows = (depths == d).nonzero().squeeze(-1)
        ids = torch.cat([prefix_ids.expand(rows.numel(), -1), paths[nodes[rows], 1 : d + 1].to(prefix_ids.device)], 1)
        out[rows] = run_processors(processors, ids, logits[rows])
    return out
