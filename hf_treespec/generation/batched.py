"""The tree loop for a batch of prompts: one tree per row per step, ONE target forward for the whole batch.

Each row keeps its own drafter state, policy and ids (rows commit different numbers of tokens every step); trees are
packed to the widest one with padding nodes masked out (`RaggedKV.tree_inputs`), the target verifies every row in one
forward, each row's verifier rule picks its accepted path, and `RaggedKV` moves each row's accepted KV rows next to
its committed ones. Finished rows (EOS, stop strings, ``max_new_tokens``) leave the batch at once; their output is
padded with ``pad_token_id`` exactly as plain ``generate`` pads it.

Drafting is batched too: every row's policy grows its own data-dependent tree (``TreePolicy.grow`` yields its draft
requests), and the rows' draft forwards are joined into one forward per round (`drafting.draft_trees`,
`Drafter.expand_rows`). The rows share one policy and one verifier (neither keeps per-tree state); drafted rows are
verified in one `Verifier.verify_rows` call (greedy: one host copy of every row's choices). Python loops over rows
remain where a per-row rule is the contract: the policies' own bookkeeping, the verifiers' walks (their acceptance
rules are sequential per tree), and stopping criteria (callables over a ``[batch, length]`` tensor whose rows here
have different lengths). The target forward, the dominant cost, the draft forwards and the KV moves are batched.
Draft-free rows (every row, when ``tree_budget="auto"`` finds that no tree could pay at this batch) are handled as
plain batched ``generate`` handles its batch: rows of equal length share one logits-processor call and one
stopping-criteria call, and no row's policy runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..attention import check_tree_attention
from ..compat import CACHE_KWARG
from ..drafters.base import Drafter, TargetFeatures, as_drafter
from ..kv.ragged import RaggedKV
from ..step_context import DecodingSetup, StepContext, StepOutcome, sampling_params
from ..cost.timing import Clock, RunningMean
from .components import TreeSpecGenerateOutput, check_drafter, resolve
from .draft_source import WarpedDraftSource
from .drafting import DraftRound, draft_trees
from .processors import process_tree_logits, processors_for_rows
from .stopping import tokens_before_stop
from .target import TargetForward, compiled_for_generation


@dataclass
class RowState:
    """One prompt of the batch while it decodes."""

    index: int
    ids: torch.Tensor  # [1, length]: the left-padded prompt and every token committed so far
    drafter: Drafter
    processors: LogitsProcessorList  # generate's processors with any per-row state narrowed to this row
    context: StepContext | None = None
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)


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
    if streamer is not None:
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


def batched_tree_decoding(
    model, input_ids, logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig, *, streamer, assistant_model, **model_kwargs,
):
    """The batched loop (called by ``tree_speculative_decoding`` for a batch or a padded prompt; same inputs and
    outputs, under its ``inference_mode``)."""
    prompt_mask = check_batch_inputs(input_ids, model_kwargs.get("attention_mask"), streamer)
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    first_drafter = check_drafter(model, assistant_model)
    check_tree_attention(model, role="target model")
    cache = model_kwargs.get(CACHE_KWARG)
    if cache is None:
        raise ValueError("tree speculation needs use_cache=True.")
    # ONE policy and ONE verifier for every row: neither keeps per-tree state between calls (each call's state is
    # local), so the rows share the policy's parameters, helper networks and, under "auto", its speed model, which
    # observes the batch step; the verifier checks every drafted row in one `verify_rows` call
    policy, verifier = resolve(generation_config, first_drafter)
    compiled = compiled_for_generation(model, cache, generation_config, sliding=False, batch=batch)
    policy.setup(DecodingSetup(model, first_drafter, *sampling_params(generation_config), batch=batch,
                               compiled=compiled))
    rows = []
    for index in range(batch):
        drafter = first_drafter if index == 0 else fork_drafter(first_drafter, assistant_model, model)
        rows.append(RowState(index, input_ids[index : index + 1], drafter,
                             processors_for_rows(logits_processor, index)))
    if compiled is not None:
        for row in rows:
            row.drafter.use_compiled(compiled.settings)
    pad_id = pad_token(generation_config)

    do_sample = generation_config.do_sample
    want_dict = generation_config.return_dict_in_generate
    want_scores = want_dict and generation_config.output_scores
    want_logits = want_dict and generation_config.output_logits
    needs = policy.context_needs
    mask_dtype = model.dtype
    clock = Clock(device, enabled=want_dict or policy.wants_timing)
    t_start = clock.now()
    layers = tuple(first_drafter.target_layers or ())
    captured = layers + ((-1,) if "target_hidden" in needs else ())
    target = TargetForward(model, cache, captured, compiled)
    temperature, top_p = sampling_params(generation_config)
    draft_mean, target_mean = RunningMean(), RunningMean()
    kv = RaggedKV(cache, prompt_mask)

    def drafter_features(states) -> torch.Tensor | None:
        """The drafter's target features of the last forward, ``[B, T, F]``: joined once per forward, read per row."""
        return states.joined(len(layers)) if layers else None

    def features(joined, slot: int, positions) -> TargetFeatures | None:
        return TargetFeatures(joined[slot, positions]) if joined is not None else None

    def step_context(states, slot: int, position: int, processed_row: torch.Tensor, row: RowState) -> StepContext:
        return StepContext(
            root_token=int(row.ids[0, -1]), device=device, context_length=int(row.ids.shape[1] - kv.pads[row.index]),
            temperature=temperature, top_p=top_p,
            target_probs=processed_row.softmax(-1) if "target_probs" in needs else None,
            target_hidden=states.parts[-1][slot, position] if "target_hidden" in needs else None,
            draft_seconds=draft_mean.value, target_seconds=target_mean.value,
        )

    def emit(row: RowState, tokens: torch.Tensor, processed: torch.Tensor, raw: torch.Tensor) -> tuple[bool, int]:
        start = row.ids.shape[1]
        extended = torch.cat([row.ids, tokens.view(1, -1).to(device)], dim=1)
        step_scores = [processed[i : i + 1] for i in range(tokens.numel())] if want_scores else None
        done, count = tokens_before_stop(
            stopping_criteria, extended, start, tuple(row.scores + step_scores) if want_scores else None
        )
        row.ids = extended[:, : start + count]
        if want_scores:
            row.scores += step_scores[:count]
        if want_logits:
            row.logits += [raw[i : i + 1] for i in range(count)]
        return done, count

    def plain_rows(slots: list[int], all_logits: torch.Tensor) -> dict[int, tuple]:
        """Draft-free rows, handled as plain batched ``generate`` handles its batch: rows of equal length share one
        call of the logits processors and of the stopping criteria. Returns slot -> (next token, stopped, raw row,
        processed row)."""
        out = {}
        by_length: dict[int, list[int]] = {}
        for slot in slots:
            by_length.setdefault(active[slot].ids.shape[1], []).append(slot)
        for group in by_length.values():
            index = torch.tensor(group, device=device)
            ids = torch.cat([active[slot].ids for slot in group])
            raw = all_logits[index, 0]
            processors = processors_for_rows(logits_processor, [active[slot].index for slot in group])
            processed = processors(ids, raw.clone()) if len(processors) else raw
            if do_sample:
                tokens = torch.tensor([verifier.target_choice(processed[i]) for i in range(len(group))])
            else:
                tokens = processed.max(-1).indices.cpu()  # plain generate's argmax (first maximum on ties)
            extended = torch.cat([ids, tokens[:, None].to(device)], dim=1)
            stopped = stopping_criteria(extended, None).cpu()
            for i, slot in enumerate(group):
                active[slot].ids = extended[i : i + 1]
                out[slot] = (int(tokens[i]), bool(stopped[i]), raw[i : i + 1], processed[i : i + 1])
        return out

    # prefill: every row's first token, chosen as plain batched generate chooses it
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0).to(device)
    prefill_logits, states = target.prefill(input_ids=input_ids, attention_mask=prompt_mask.long().to(device),
                                            position_ids=positions, logits_to_keep=1)
    logits = prefill_logits[:, -1].float()
    processed = logits_processor(input_ids, logits)
    first = torch.multinomial(processed.softmax(-1), 1)[:, 0] if do_sample else processed.argmax(-1)
    t0 = clock.now()
    finished = torch.zeros(batch, dtype=torch.bool)
    joined = drafter_features(states)
    for slot, row in enumerate(rows):
        real = prompt_mask[slot].nonzero().squeeze(-1).to(device)
        row.drafter.start(row.ids[0, real], features(joined, slot, real))
        finished[slot] = emit(row, first[slot : slot + 1], processed[slot : slot + 1], logits[slot : slot + 1])[0]
        row.context = step_context(states, slot, -1, processed[slot], row)
    draft_seconds, verify_seconds, draft_rounds = clock.now() - t0, 0.0, 0
    kv.retire(~finished)
    active = [row for row, done in zip(rows, finished.tolist()) if not done]
    root_only = torch.zeros(1, dtype=torch.long)

    while active:
        t0 = clock.now()
        # one check for the batch: when no tree could pay at any row's context, no row's policy runs
        contexts = [row.context for row in active]
        if policy.may_draft(int(kv.positions().min())):
            sources = [WarpedDraftSource(row.drafter, row.processors, row.ids) for row in active]
            drafts = draft_trees(policy, sources, contexts)
        else:
            drafts = DraftRound.draft_free(contexts)
        trees, rounds = drafts.trees, drafts.rounds
        t1 = clock.now()
        draft_rounds += rounds
        ids, pos, mask4d = kv.tree_inputs(trees, mask_dtype)
        step_logits, states = target.step(ids.to(device), pos.to(device), mask4d.to(device))
        if "latencies" in needs:
            target_mean.add(clock.now() - t1)
        all_logits = step_logits.float()
        free = {slot for slot, tree in enumerate(trees) if tree.num_nodes == 1 and not want_scores}
        outcome = plain_rows(sorted(free), all_logits)  # slot -> (next token, stopped, raw rows, processed rows)
        verdicts = [root_only] * len(active)
        drafted, processed_rows = [], {}
        for slot, (row, tree) in enumerate(zip(active, trees)):
            if slot in free:
                continue
            raw = all_logits[slot, : tree.num_nodes]
            processed = process_tree_logits(row.processors, row.ids, tree, torch.arange(tree.num_nodes), raw)
            processed_rows[slot] = processed
            if tree.num_nodes == 1:  # a draft-free row whose scores are kept: the target's own choice
                outcome[slot] = (verifier.target_choice(processed[0]), None, raw, processed)
            else:
                drafted.append(slot)
        results = verifier.verify_rows([trees[slot] for slot in drafted], [processed_rows[s] for s in drafted])
        for slot, result in zip(drafted, results):
            accepted = result.accepted.cpu()
            rows_on_path = accepted.to(device)
            outcome[slot] = (result.next_token, None, all_logits[slot, rows_on_path],
                             processed_rows[slot][rows_on_path])
            verdicts[slot] = accepted
        kv.commit(verdicts)
        t2 = clock.now()
        draft_seconds += t1 - t0
        verify_seconds += t2 - t1
        if "latencies" in needs and rounds:
            draft_mean.add(t1 - t0, rounds)
        policy.observe(StepOutcome(
            trees=trees, accepted=verdicts, contexts=[row.context for row in active], width=int(ids.shape[1]),
            context_length=int(kv.positions().float().mean()), draft_seconds=t1 - t0, verify_seconds=t2 - t1,
            draft_rounds=rounds, shapes=drafts.shapes,
        ))
        joined = drafter_features(states)
        done = torch.zeros(len(active), dtype=torch.bool)
        for slot, (row, tree, accepted) in enumerate(zip(active, trees, verdicts)):
            row.tree_sizes.append(tree.num_nodes - 1)
            row.drafter.commit(tree, accepted, features(joined, slot, accepted.to(device)))
            next_token, stopped, raw, processed = outcome[slot]
            if slot in free:  # its token is in row.ids already (plain_rows)
                done[slot], count = stopped, 1
                if want_logits:
                    row.logits.append(raw)
            else:
                new_tokens = torch.cat([tree.tokens[accepted[1:]], torch.tensor([next_token])])
                done[slot], count = emit(row, new_tokens, processed, raw)
            row.accepted_lengths.append(count)
            row.context = step_context(states, slot, int(accepted[-1]), processed[-1], row)
        kv.retire(~done)
        active = [row for row, stop in zip(active, done.tolist()) if not stop]

    lengths = torch.tensor([row.ids.shape[1] for row in rows])
    width = int(lengths.max())
    if pad_id is None and bool((lengths < width).any()):
        raise ValueError("rows finished at different lengths and generation_config has neither pad_token_id nor "
                         "eos_token_id to pad them with; set pad_token_id.")
    sequences = torch.full((batch, width), pad_id if pad_id is not None else 0, dtype=torch.long, device=device)
    for row in rows:
        sequences[row.index, : row.ids.shape[1]] = row.ids[0]
    kv.finish(lengths)
    if not want_dict:
        return sequences
    return TreeSpecGenerateOutput(
        sequences=sequences,
        scores=stack_steps([row.scores for row in rows]) if want_scores else None,
        logits=stack_steps([row.logits for row in rows]) if want_logits else None,
        **{CACHE_KWARG: cache},
        accepted_lengths=[n for row in rows for n in row.accepted_lengths],
        tree_sizes=[n for row in rows for n in row.tree_sizes],
        draft_forwards=draft_rounds,
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
        total_seconds=clock.now() - t_start,
        drafted_steps=sum(size > 0 for row in rows for size in row.tree_sizes),
        row_accepted_lengths=[row.accepted_lengths for row in rows],
        attention_mask=attention_mask_of(sequences, prompt_mask.to(device), lengths.to(device)),
    )


def stack_steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per-row lists of ``[1, V]`` rows -> one ``[B, V]`` tensor per generated position, as plain ``generate`` returns
    them; a row that had already finished gets a row of zeros there (plain ``generate`` would score its padding)."""
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
