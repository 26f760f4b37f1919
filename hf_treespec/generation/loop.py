"""The tree-speculative decoding loop: the one place where drafter, policy and verifier are composed, for a batch of
any size (one prompt is a batch of one).

Every row keeps its own ids, drafter and outputs (`RowState`); the rows share one policy and one verifier (neither
keeps per-tree state between calls). A step reads top to bottom in `TreeDecodingLoop.run`:

1. draft: the sizing (``tree_budget="auto"``: `TreeSizing`) decides whether the step drafts and hands every row its
   step budget; every active row's policy grows its tree (`draft_trees`: the rows' draft forwards joined per round);
2. verify: ONE target forward over every row's tree (`TargetKV.step_inputs`: `OneRowKV` for one unpadded prompt,
   `RaggedKV` for a batch), each drafted row's path picked by the verifier; a root-only row is a plain ``generate``
   step (its token the target's own choice; rows of equal length share the processors and stopping criteria);
3. commit: the cache keeps each row's accepted rows, the policy and the sizing observe the step, each drafter takes
   its path and the target features along it (the sizing learns from the step once its host tail ended, when the
   next step begins: a step costs its whole wall time, not only its draft and verify phases);
4. emit: the accepted tokens join each row's output, every stopping criterion sees every prefix; finished rows
   leave the batch (their output padded with ``pad_token_id`` as plain ``generate`` pads it).

Timing is observed, not threaded through: the loop notifies a `LoopTimer` at the phase boundaries.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..attention import check_tree_attention
from ..compat import CACHE_KWARG
from ..compiled.host_threads import HostThreads
from ..drafters.base import TargetFeatures
from ..kv.target_kv import target_kv
from ..kv.tree_kv import to_device
from ..kv.window import prepare
from ..step_context import DecodingSetup, StepContext, StepOutcome, sampling_params
from ..tree import host_longs
from .components import (
    TreeSpecGenerateOutput, check_decoder_only, check_empty_cache, check_drafter, check_text_only, resolve,
    returns_outside_inference_mode,
)
from .draft_source import WarpedDraftSource
from .drafting import DraftRound, draft_trees
from .processors import NodeRows, process_tree_logits, processors_for_rows, run_processors
from .rows import (
    RowState, RowVerdict, Verification, append_chunk, attention_mask_of, check_batch_inputs, fork_drafter, pad_token,
    padded_sequences, stack_steps,
)
from .sizing import TreeSizing
from .target import TargetForward, compiled_for_generation
from .timer import LoopTimer


@returns_outside_inference_mode
def tree_speculative_decoding(model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                              stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                              streamer=None, assistant_model=None, **model_kwargs):
    """The tree-speculative decoding loop (``generate``'s decoding-method inputs and outputs; entry: ``tree_generate``)."""
    check_decoder_only(model)
    check_text_only(model_kwargs)
    if input_ids.shape[1] == 0:
        raise ValueError("tree speculation needs a non-empty prompt.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not available with tree_policy: tree forwards mix "
            "rejected branches into those tensors. Drop tree_policy to get them."
        )
    loop = TreeDecodingLoop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                            assistant_model, model_kwargs.get("attention_mask"), model_kwargs.get(CACHE_KWARG))
    return loop.run()


class TreeDecodingLoop:
    """One ``generate`` call's decoding: the setup, then `run` (prefill, then draft -> verify -> commit -> emit)."""

    def __init__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                 assistant_model, attention_mask, cache):
        check_tree_attention(model, role="target model")  # the target first: the drafter may be the same model
        drafter = check_drafter(model, assistant_model)
        self.policy, self.verifier = resolve(generation_config, drafter)  # refuses beams before the batch checks
        self.prompt_mask = check_batch_inputs(input_ids, attention_mask, streamer)
        if cache is None:
            raise ValueError("tree speculation needs use_cache=True.")
        check_empty_cache(cache, "tree speculation")
        self.batch = input_ids.shape[0]
        self.cache, self.input_ids, self.device = cache, input_ids, input_ids.device
        self.windows = prepare(model, cache, role="target model")  # sliding layers full-length; windows in the masks
        self.needs = self.policy.context_needs
        self.layers = tuple(drafter.target_layers or ())
        # the target's pre-norm last state is captured (after the drafter's layers) only for policies that read it
        captured = self.layers + ((-1,) if "target_hidden" in self.needs else ())
        compiled = compiled_for_generation(model, cache, generation_config, sliding=self.windows is not None,
                                           batch=self.batch, layers=captured)
        self.temperature, self.top_p = sampling_params(generation_config)
        setup = DecodingSetup(model, drafter, self.temperature, self.top_p, batch=self.batch, compiled=compiled)
        self.policy.setup(setup)
        self.sizing = TreeSizing.for_generation(self.policy, setup)  # None: the policy's own numeric budget
        pads = (~self.prompt_mask).sum(-1).tolist()
        self.rows = [RowState(i, input_ids[i : i + 1], drafter if i == 0 else fork_drafter(drafter, assistant_model, model),
                              processors_for_rows(logits_processor, i), pads=pads[i]) for i in range(self.batch)]
        # an engine's drafter stays eager: the drafter converted to OpenVINO too measured no faster beside the
        # target's engine (docs/results/compiled/openvino-step)
        if compiled is not None and not getattr(compiled, "owns_cache", False):
            for row in self.rows:
                row.drafter.use_compiled(compiled.settings, batch=self.batch)
        self.logits_processor, self.stopping_criteria, self.streamer = logits_processor, stopping_criteria, streamer
        self.pad_id = pad_token(generation_config)
        self.do_sample = generation_config.do_sample
        self.want_dict = generation_config.return_dict_in_generate
        self.want_scores = self.want_dict and generation_config.output_scores
        self.want_logits = self.want_dict and generation_config.output_logits
        self.mask_dtype = model.dtype  # read once: the property walks the parameters
        # the path's rows are kept past the verdict only for returned scores / logits or a policy reading p; without
        # them only the verifier reads a step's logits, at the nodes it visits: the forward's own logits go to it
        # (greedy: a bf16 model's cast exactly to fp32 has the same maxima; sampling: `target_probs` casts each row it
        # reads, and generate's processors see each row they process cast to fp32), not the rows x vocabulary cast to
        # fp32 (0.25-0.35 ms a tree step, bf16, 2-core EPYC)
        self.keeps_rows = self.want_scores or self.want_logits or "target_probs" in self.needs
        self.kv = target_kv(cache, self.prompt_mask, self.windows, engine=compiled)
        # the clock syncs the device only when someone reads its numbers: the caller (return_dict_in_generate), the
        # sizing (auto budgets learn from measured time) or the policy ("latencies" in its context_needs)
        timing = self.want_dict or self.sizing is not None or "latencies" in self.needs
        self.timer = LoopTimer(self.device, enabled=timing, latencies="latencies" in self.needs)
        self.target = TargetForward(model, cache, captured, compiled)
        self.threads = HostThreads(self.target.engine)  # draft-free steps on an engine: one torch thread
        self.root_only = torch.zeros(1, dtype=torch.long)  # the accepted path of a root-only tree
        self.draft_forwards = 0
        self.active: list[RowState] = []

    def run(self):
        """The whole decoding: what ``generate`` returns (the sequences, or a `TreeSpecGenerateOutput`)."""
        self.prefill()  # 0. the prompt: every row's first token, chosen as plain generate chooses it
        with self.threads:
            while self.active:
                drafted = self.draft()  # 1. a tree per active row
                verification = self.verify(drafted)  # 2. one target forward, each row's accepted path
                self.commit(drafted, verification)  # 3. policy and drafters take the step
                self.emit(verification)  # 4. tokens out, finished rows leave
        if self.sizing is not None:
            self.timer.finished()
            self.sizing.step_ended(self.timer.step_other)
        return self.output()

    def prefill(self) -> None:
        """0. The prompt forward; every row's first token, its drafter started on the prompt, its first context."""
        mask, device = self.prompt_mask, self.device
        inputs = {"input_ids": self.input_ids, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}
        if not bool(mask.all()):
            inputs["attention_mask"] = mask.long()
        logits, states = self.target.prefill(**inputs, logits_to_keep=1)
        logits = logits[:, -1].float()
        processed = run_processors(self.logits_processor, self.input_ids, logits)
        first = self.verifier.target_choices(processed)  # as a draft-free row's token is chosen
        roots = first.tolist()
        self.timer.drafting()
        joined = self.joined(states)
        for slot, row in enumerate(self.rows):
            real = slice(None) if row.pads == 0 else mask[slot].nonzero().squeeze(-1).to(device)
            row.drafter.start(row.ids[0, real], self.features(joined, slot, real))
        self.timer.drafted(0)
        done = []
        for slot, row in enumerate(self.rows):
            done.append(self.append(row, first[slot : slot + 1], processed[slot : slot + 1], logits[slot : slot + 1])[0])
            self.stream(row, 1)
            row.context = self.step_context(row, states, slot, -1, processed[slot : slot + 1], roots[slot])
        self.kv.retire(~torch.tensor(done))
        self.active = [row for row, stop in zip(self.rows, done) if not stop]

    def draft(self) -> DraftRound:
        """1. Every active row's tree; with auto sizing, one check for the batch: when no tree could pay at any row's
        context, no row's policy runs and every row takes a plain step; else each row grows by its own budget."""
        self.timer.drafting()
        contexts = [row.context for row in self.active]
        sizing = self.sizing
        if sizing is not None:  # the previous step's cost is complete: its host tail (commit, emit) ended now
            sizing.step_ended(self.timer.step_other)
        if sizing is None or sizing.may_draft(min(context.context_length for context in contexts)):
            if sizing is not None:
                contexts = [sizing.budget(context) for context in contexts]
            self.threads.widen()
            sources = [WarpedDraftSource(row.drafter, row.processors, row.ids) for row in self.active]
            drafted = draft_trees(self.policy, sources, contexts)
        else:
            self.threads.narrow()
            drafted = DraftRound.draft_free(contexts)
        self.draft_forwards += drafted.rounds
        self.timer.drafted(drafted.rounds)
        return drafted

    def verify(self, drafted: DraftRound) -> Verification:
        """2. One target forward over every row's tree; the verifier's path per drafted row, the target's own choice
        per root-only row; the cache keeps the accepted rows."""
        trees = drafted.trees
        ids, positions, mask = self.kv.step_inputs(trees, self.mask_dtype, self.device, self.target.explicit_masks)
        step_logits, states = self.target.step(ids, positions, mask)
        self.timer.target_ran()
        logits = step_logits.float() if self.keeps_rows else step_logits
        plain = [slot for slot, tree in enumerate(trees) if tree.num_nodes == 1 and not self.want_scores]
        verdicts = self.plain_rows(plain, logits)
        drafted_slots, processed = [], {}
        for slot, (row, tree) in enumerate(zip(self.active, trees)):
            if slot in verdicts:
                continue
            raw = logits[slot, : tree.num_nodes]
            if tree.num_nodes > 1 and self.verifier.reads_visited_rows and len(row.processors):
                processed[slot] = NodeRows(row.processors, row.ids, tree, raw)  # the walk's rows, when it reads them
            else:
                processed[slot] = process_tree_logits(row.processors, row.ids, tree, torch.arange(tree.num_nodes),
                                                      raw)
            if tree.num_nodes == 1:  # a root-only row whose scores are kept: the target's own choice
                token = torch.tensor([self.verifier.target_choice(processed[slot][0])])
                verdicts[slot] = RowVerdict(self.root_only, token, raw, processed[slot],
                                            device_tokens=to_device(self.device, token)[0])
            else:
                drafted_slots.append(slot)
        results = self.verifier.verify_rows([trees[s] for s in drafted_slots], [processed[s] for s in drafted_slots])
        for slot, result in zip(drafted_slots, results):
            accepted = result.accepted.cpu()
            drafts = trees[slot].tokens.tolist()  # the path's tokens from host lists: one tensor, not four ops
            tokens = host_longs([drafts[node] for node in accepted.tolist()[1:]] + [int(result.next_token)])
            # the path's node indices and tokens reach the device in one copy (they pick the path's logits rows and
            # drafter features; emit appends the tokens)
            path, device_tokens = to_device(self.device, accepted, tokens)
            rows = processed[slot]  # the path's processed rows: NodeRows reads host indices (no device sync)
            kept = ((logits[slot, path], rows[accepted if isinstance(rows, NodeRows) else path]) if self.keeps_rows
                    else (None, None))
            verdicts[slot] = RowVerdict(accepted, tokens, *kept, path, device_tokens)
        ordered = [verdicts[slot] for slot in range(len(trees))]
        self.kv.commit([verdict.accepted for verdict in ordered])
        self.timer.verified()
        return Verification(ordered, states, int(ids.shape[1]))

    def plain_rows(self, slots: list[int], logits: torch.Tensor) -> dict[int, RowVerdict]:
        """Root-only rows, decoded as plain batched ``generate`` decodes its batch: rows of equal length share one
        call of the logits processors and one of the stopping criteria; their tokens are appended here."""
        groups: dict[int, list[int]] = {}
        for slot in slots:
            groups.setdefault(self.active[slot].ids.shape[1], []).append(slot)
        verdicts = {}
        for group in groups.values():
            rows = [self.active[slot] for slot in group]
            contiguous = group == list(range(group[0], group[-1] + 1))
            index = slice(group[0], group[-1] + 1) if contiguous else torch.tensor(group, device=self.device)
            raw = logits[index, 0]
            ids = rows[0].ids if len(rows) == 1 else torch.cat([row.ids for row in rows])
            processors = (self.logits_processor if len(group) == self.batch
                          else processors_for_rows(self.logits_processor, [row.index for row in rows]))
            # processors see fp32 scores, as in generate (a copy where the raw row is returned: they may write in place)
            processed = raw
            if len(processors):
                processed = run_processors(processors, ids, raw.clone() if self.want_logits else raw.float())
            # plain generate's argmax (first maximum on ties), or one vectorised draw per row when sampling
            tokens = self.verifier.target_choices(processed).cpu()
            extended = torch.cat([ids, tokens[:, None].to(self.device)], dim=1)
            stopped = self.stopping_criteria(extended, None).cpu().tolist()
            # each row's one-row views, made by one split per tensor (not four slices per row)
            for slot, row, ids, token, row_raw, row_processed, stop in zip(
                    group, rows, extended.split(1), tokens.split(1), raw.split(1), processed.split(1), stopped):
                row.ids = ids
                verdicts[slot] = RowVerdict(self.root_only, token, row_raw, row_processed, stopped=bool(stop))
        return verdicts

    def commit(self, drafted: DraftRound, verification: Verification) -> None:
        """3. The policy observes the step; each row's drafter takes its accepted path and the target's features."""
        verdicts, timer = verification.verdicts, self.timer
        outcome = StepOutcome(
            trees=drafted.trees, accepted=[v.accepted for v in verdicts], contexts=[row.context for row in self.active],
            width=verification.width, context_length=sum(row.context_length for row in self.active) // len(self.active),
            draft_seconds=timer.step_draft, verify_seconds=timer.step_verify, draft_rounds=drafted.rounds,
            shapes=drafted.shapes, forward_seconds=timer.step_forward,
        )
        self.policy.observe(outcome)
        if self.sizing is not None:
            self.sizing.observe(outcome)
        joined = self.joined(verification.states)
        for slot, (row, tree, verdict) in enumerate(zip(self.active, drafted.trees, verdicts)):
            row.tree_sizes.append(tree.num_nodes - 1)
            path = slice(0, 1) if verdict.path is None else verdict.path
            row.drafter.commit(tree, verdict.accepted, self.features(joined, slot, path))

    def emit(self, verification: Verification) -> None:
        """4. Each row's tokens join its output; finished rows leave the batch and the cache."""
        done = []
        for slot, (row, verdict) in enumerate(zip(self.active, verification.verdicts)):
            if verdict.stopped is None:
                stopped, count = self.append(row, verdict.device_tokens, verdict.processed, verdict.raw)
            else:  # a plain row: its token is in row.ids already
                stopped, count = verdict.stopped, 1
                if self.want_logits:
                    row.logits.append(verdict.raw)
            self.stream(row, count)
            row.accepted_lengths.append(count)
            done.append(stopped)
            if not stopped:
                row.context = self.step_context(row, verification.states, slot, int(verdict.accepted[-1]),
                                                verdict.processed, int(verdict.tokens[count - 1]))
        if any(done):
            self.kv.retire(~torch.tensor(done))
            self.active = [row for row, stop in zip(self.active, done) if not stop]

    def append(self, row: RowState, tokens: torch.Tensor, processed: torch.Tensor, raw: torch.Tensor
               ) -> tuple[bool, int]:
        return append_chunk(row, tokens, processed, raw, self.stopping_criteria, self.want_scores, self.want_logits)

    def stream(self, row: RowState, count: int) -> None:
        """The row's last ``count`` tokens to the streamer (a batch of one only: `check_batch_inputs`)."""
        if self.streamer is not None:
            self.streamer.put(row.ids[:, -count:].cpu())

    def step_context(self, row: RowState, states, slot: int, position: int, processed: torch.Tensor | None,
                     root: int) -> StepContext:
        """What the row's next policy call sees: the target at the root's parent (``position`` in ``slot`` of the
        last forward; p from the last of the ``processed`` rows); ``root`` (the last committed token) from a host
        copy, never read back from the ids."""
        return StepContext(
            root_token=root, device=self.device, context_length=row.context_length,
            temperature=self.temperature, top_p=self.top_p,
            target_probs=processed[-1].softmax(-1) if "target_probs" in self.needs else None,
            target_hidden=states.parts[-1][slot, position] if "target_hidden" in self.needs else None,
            draft_seconds=self.timer.draft_mean.value, target_seconds=self.timer.target_mean.value,
        )

    def joined(self, states) -> torch.Tensor | None:
        """The drafter's target features of a forward, ``[B, T, F]``: joined once per forward, read per row."""
        return states.joined(len(self.layers)) if self.layers else None

    @staticmethod
    def features(joined: torch.Tensor | None, slot: int, positions) -> TargetFeatures | None:
        return TargetFeatures(joined[slot, positions]) if joined is not None else None

    def output(self):
        sequences, lengths = padded_sequences(self.rows, self.pad_id)
        self.kv.finish(lengths)  # the cache as plain generate leaves it: the rows of sequences[:, :-1]
        if self.windows is not None:
            self.windows.restore(self.cache)
        if self.streamer is not None:
            self.streamer.end()
        if not self.want_dict:
            return sequences
        rows = self.rows
        return TreeSpecGenerateOutput(
            sequences=sequences,
            scores=stack_steps([row.scores for row in rows]) if self.want_scores else None,
            logits=stack_steps([row.logits for row in rows]) if self.want_logits else None,
            **{CACHE_KWARG: self.cache},
            accepted_lengths=[n for row in rows for n in row.accepted_lengths],
            tree_sizes=[n for row in rows for n in row.tree_sizes],
            draft_forwards=self.draft_forwards,
            draft_seconds=self.timer.draft_seconds,
            verify_seconds=self.timer.verify_seconds,
            total_seconds=self.timer.total_seconds,
            drafted_steps=sum(size > 0 for row in rows for size in row.tree_sizes),
            row_accepted_lengths=[row.accepted_lengths for row in rows],
            attention_mask=attention_mask_of(sequences, self.prompt_mask, lengths.to(self.device)),
        )
