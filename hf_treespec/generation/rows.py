"""The rows of a decoding batch: per-row state, the verify phase's hand-offs, the batch's input checks, a chunk
appended under the stopping criteria, and the output assembled from the rows.

A single prompt is a batch of one; rows commit different numbers of tokens every step, so each keeps its own ids,
drafter and outputs (`RowState`), and the output is laid out as plain batched ``generate`` lays it out (finished rows
padded with ``pad_token_id``, scores ``[B, V]`` per generated position).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..drafters.base import Drafter, as_drafter
from ..step_context import StepContext
from .stopping import tokens_before_stop


@dataclass
class RowState:
    """One prompt of the batch while it decodes."""

    index: int
    ids: torch.Tensor  # [1, length]: the (left-padded) prompt and every token committed so far
    drafter: Drafter
    processors: LogitsProcessorList  # generate's processors with any per-row state narrowed to this row
    pads: int = 0  # left-padding columns of the prompt
    context: StepContext | None = None
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def context_length(self) -> int:
        """Committed tokens (padding not counted), the step's root included."""
        return int(self.ids.shape[1]) - self.pads


@dataclass
class RowVerdict:
    """One row's verified step (verify -> commit -> emit).

    Attributes:
        accepted: host node indices of the accepted path, root first.
        tokens: host tokens the step commits (the accepted drafts, then the target's next token).
        raw / processed: ``[len(tokens), V]`` raw and processed target logits along the path (None for a drafted
            row of a loop that keeps neither: `TreeDecodingLoop.keeps_rows`).
        path / device_tokens: ``accepted`` and ``tokens`` on the device (one copy); None for a root-only row.
        stopped: for a plain row, whose token was appended and checked with its group: whether it stopped.
    """

    accepted: torch.Tensor
    tokens: torch.Tensor
    raw: torch.Tensor | None
    processed: torch.Tensor | None
    path: torch.Tensor | None = None
    device_tokens: torch.Tensor | None = None
    stopped: bool | None = None


@dataclass
class Verification:
    """The verify phase's hand-off: a verdict per active row, the forward's captured target layers, its tree width."""

    verdicts: list[RowVerdict]
    states: object
    width: int


def append_chunk(row: RowState, tokens: torch.Tensor, processed: torch.Tensor, raw: torch.Tensor,
                 stopping_criteria: StoppingCriteriaList, want_scores: bool, want_logits: bool) -> tuple[bool, int]:
    """Appends a chunk of device ``tokens`` to ``row``, honouring every stopping criterion inside it as if its tokens
    came one by one (each sees every prefix, as in plain generate); one host read of all the verdicts. Keeps the
    chunk's processed / raw rows when asked. Returns (stopped, tokens kept)."""
    start = row.ids.shape[1]
    extended = torch.cat([row.ids, tokens.view(1, -1)], dim=1)
    step_scores = [processed[i : i + 1] for i in range(tokens.numel())] if want_scores else None
    stopped, count = tokens_before_stop(
        stopping_criteria, extended, start, tuple(row.scores + step_scores) if want_scores else None
    )
    row.ids = extended[:, : start + count]
    if want_scores:
        row.scores += step_scores[:count]
    if want_logits:
        row.logits += [raw[i : i + 1] for i in range(count)]
    return stopped, count


def fork_drafter(drafter: Drafter, assistant, target) -> Drafter:
    """A drafter with its own per-sequence state for another row: a fresh adapter around the same model, or a shallow
    copy of a `Drafter` passed as it is (its ``start`` resets every per-sequence field)."""
    return copy.copy(drafter) if isinstance(assistant, Drafter) else as_drafter(assistant, target=target)


def pad_token(generation_config: GenerationConfig) -> int | None:
    """The id plain ``generate`` pads finished rows with (``pad_token_id``, else the first EOS id)."""
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id)
    eos = generation_config.eos_token_id
    if eos is None:
        return None
    return int(eos[0] if isinstance(eos, (list, tuple)) else torch.as_tensor(eos).reshape(-1)[0])


def check_batch_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, streamer) -> torch.Tensor:
    """The prompt mask as bools, refusing what a batch cannot be decoded from."""
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(
            f"a streamer takes one sequence (transformers' streamers support batch size 1); got a batch of "
            f"{input_ids.shape[0]}. Drop the streamer or generate one prompt at a time."
        )
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; input_ids {tuple(input_ids.shape)}: pass the "
                         "attention_mask the tokenizer returned with these input_ids (one 0/1 per token).")
    if not bool(mask.any(-1).all()):
        raise ValueError("a prompt of the batch is all padding (its attention_mask row has no 1): drop empty prompts "
                         "from the batch before tokenizing.")
    if not bool(mask[:, -1].all()):
        raise ValueError(
            "tree speculation needs left padding for a batch of prompts (decoder-only models generate after the "
            "last column): set tokenizer.padding_side = 'left' before tokenizing."
        )
    return mask


def padded_sequences(rows: list[RowState], pad_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, width]`` sequences (a finished row padded after its end with ``pad_id``) and ``[B]`` row lengths."""
    lengths = torch.tensor([row.ids.shape[1] for row in rows])
    if len(rows) == 1:
        return rows[0].ids, lengths
    width = int(lengths.max())
    if pad_id is None and bool((lengths < width).any()):
        raise ValueError("rows finished at different lengths and generation_config has neither pad_token_id nor "
                         "eos_token_id to pad them with; set pad_token_id.")
    device = rows[0].ids.device
    sequences = torch.full((len(rows), width), pad_id if pad_id is not None else 0, dtype=torch.long, device=device)
    for row in rows:
        sequences[row.index, : row.ids.shape[1]] = row.ids[0]
    return sequences, lengths


def stack_steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per-row lists of ``[1, V]`` rows -> one ``[B, V]`` tensor per generated position, as plain ``generate`` returns
    them; a row that had already finished gets a row of zeros there (plain ``generate`` would score its padding)."""
    if len(per_row) == 1:
        return tuple(per_row[0])
    steps = max(len(r) for r in per_row)
    like = next(t for r in per_row for t in r)
    return tuple(
        torch.cat([r[i] if i < len(r) else torch.zeros_like(like) for r in per_row]) for i in range(steps)
    )


def attention_mask_of(sequences: torch.Tensor, prompt_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, width]``: 1 where a row's sequence holds a real token (its prompt without padding, then what it
    generated), 0 at left padding and at the padding after a row finished; with the returned cache it continues
    plain ``generate``."""
    columns = torch.arange(sequences.shape[1], device=sequences.device)
    mask = (columns[None] < lengths[:, None]).long()
    mask[:, : prompt_mask.shape[1]] = prompt_mask.long()
    return mask
