"""The tree-speculative decoding loop: the one place where drafter, policy and verifier are composed."""

from __future__ import annotations

import functools

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..attention import causal_row_mask, check_tree_attention
from ..kv.tree_kv import TreeKV, keep_rows, to_device
from ..compat import CACHE_KWARG
from ..drafters.base import TargetFeatures
from ..step_context import DecodingSetup, StepContext, StepOutcome, sampling_params
from ..cost.timing import Clock, RunningMean
from ..tree import DraftTree
from ..kv.window import prepare, refuse_in_batch, tree_inputs
from .batched import batched_tree_decoding
from .components import (
    TreeSpecGenerateOutput, check_decoder_only, check_drafter, check_no_beams, check_text_only, resolve,
)
from .draft_source import WarpedDraftSource
from .drafting import DraftRound, draft_trees
from .processors import process_tree_logits
from .stopping import tokens_before_stop
from .target import TargetForward, compiled_for_generation


def returns_outside_inference_mode(decode):
    """Runs ``decode`` under ``torch.inference_mode`` (cheaper than ``no_grad``: no view or version tracking on the
    ~100 ops of every layer, a few percent of a small model's step on a CPU) and copies the returned sequences /
    scores / logits out of it, so callers may use them in autograd (scoring the output with gradients, as RL loops
    do)."""

    @functools.wraps(decode)
    def run(*args, **kwargs):
        with torch.inference_mode():
            out = decode(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.clone()
        out.sequences = out.sequences.clone()
        for name in ("scores", "logits"):
            if getattr(out, name) is not None:
                setattr(out, name, tuple(t.clone() for t in getattr(out, name)))
        return out

    return run


@returns_outside_inference_mode
def tree_speculative_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer=None,
    assistant_model=None,
    **model_kwargs,
):
    """The tree-speculative decoding loop (``generate``'s decoding-method inputs and outputs; entry: ``tree_generate``)."""
    check_no_beams(generation_config)  # before the batch check: generate has already expanded the prompt into beams
    check_decoder_only(model)
    check_text_only(model_kwargs)
    if input_ids.shape[1] == 0:
        raise ValueError("tree speculation needs a non-empty prompt.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not available with tree_policy: tree forwards mix "
            "rejected branches into those tensors. Drop tree_policy to get them."
        )
    mask = model_kwargs.get("attention_mask")
    if input_ids.shape[0] != 1 or (mask is not None and not bool(mask.all())):
        refuse_in_batch(model_kwargs.get(CACHE_KWARG))
        return batched_tree_decoding(
            model, input_ids, logits_processor, stopping_criteria, generation_config,
            streamer=streamer, assistant_model=assistant_model, **model_kwargs,
        )
    check_tree_attention(model, role="target model")
    drafter = check_drafter(model, assistant_model)
    policy, verifier = resolve(generation_config, drafter)
    cache = model_kwargs.get(CACHE_KWARG)
    if cache is None:
        raise ValueError("tree speculation needs use_cache=True.")
    windows = prepare(model, cache, role="target model")  # sliding layers made full-length; windows in the masks
    compiled = compiled_for_generation(model, cache, generation_config, sliding=windows is not None)
    if compiled is not None:
        drafter.use_compiled(compiled.settings)
    policy.setup(DecodingSetup(model, drafter, *sampling_params(generation_config), compiled=compiled))

    do_sample = generation_config.do_sample
    want_dict = generation_config.return_dict_in_generate
    scores = () if (want_dict and generation_config.output_scores) else None
    raw_logits = () if (want_dict and generation_config.output_logits) else None
    device = input_ids.device
    mask_dtype = model.dtype  # read once: the property walks the parameters
    target_kv = TreeKV(cache)
    # the clock syncs the device only when someone reads its numbers: the caller (return_dict_in_generate) or the
    # policy (auto sizing, or "latencies" in its context_needs)
    needs = policy.context_needs
    clock = Clock(device, enabled=want_dict or policy.wants_timing)
    t_start = clock.now()

    # prefill: the target's first token, chosen exactly as plain generate chooses it
    prompt_len = input_ids.shape[1]
    layers = tuple(drafter.target_layers or ())
    # the target's pre-norm last state is captured (after the drafter's layers) only for policies that read it
    captured = layers + ((-1,) if "target_hidden" in needs else ())
    target = TargetForward(model, cache, captured, compiled)

    def drafter_features(states, rows) -> TargetFeatures | None:
        return TargetFeatures(states.joined(len(layers))[0, rows]) if layers else None

    temperature, top_p = sampling_params(generation_config)
    draft_mean, target_mean = RunningMean(), RunningMean()

    def step_context(states, probs_row: torch.Tensor, row, root: int) -> StepContext:
        """What the next step's policy sees: the target at the root's parent (``row`` of the last forward); ``root``
        is the last committed token, passed from the host copy rather than read back from ``input_ids``."""
        return StepContext(
            root_token=root, device=device, context_length=input_ids.shape[1],
            temperature=temperature, top_p=top_p,
            target_probs=probs_row.softmax(-1) if "target_probs" in needs else None,
            target_hidden=states.parts[-1][0, row] if "target_hidden" in needs else None,
            draft_seconds=draft_mean.value, target_seconds=target_mean.value,
        )

    prefill_logits, states = target.prefill(
        input_ids=input_ids, position_ids=torch.arange(prompt_len, device=device)[None], logits_to_keep=1
    )
    target_kv.committed = prompt_len
    logits = prefill_logits[:, -1].float()
    processed = logits_processor(input_ids, logits)
    first = torch.multinomial(processed.softmax(-1), 1)[0] if do_sample else processed.argmax(-1)
    t0 = clock.now()
    drafter.start(input_ids[0], drafter_features(states, slice(None)))
    draft_seconds = clock.now() - t0
    verify_seconds = 0.0
    accepted_lengths: list[int] = []
    tree_sizes: list[int] = []
    draft_forwards = 0

    def emit(tokens: torch.Tensor, proc_rows: torch.Tensor, raw_rows: torch.Tensor) -> tuple[bool, int]:
        """Appends the chunk, honouring every stopping criterion inside it as if its tokens came one by one (each
        criterion sees every prefix, as in plain generate); one copy in, one host read of all the verdicts; (done,
        count)."""
        nonlocal input_ids, scores, raw_logits
        start = input_ids.shape[1]
        extended = torch.cat([input_ids, tokens.view(1, -1).to(device)], dim=1)
        step_scores = tuple(proc_rows[i : i + 1] for i in range(tokens.numel())) if scores is not None else None
        done, count = tokens_before_stop(
            stopping_criteria, extended, start, None if scores is None else scores + step_scores
        )
        input_ids = extended[:, : start + count]
        if scores is not None:
            scores += step_scores[:count]
        if raw_logits is not None:
            raw_logits += tuple(raw_rows[i : i + 1] for i in range(count))
        if streamer is not None:
            streamer.put(input_ids[:, -count:].cpu())
        return done, count

    def target_forward(since: float, **inputs):
        """The target's step forward, capturing what the drafter and policy read; the time from ``since`` (the end of
        drafting: building the inputs counts) to its end is the policy's target latency."""
        out = target.step(**inputs)
        if "latencies" in needs:
            target_mean.add(clock.now() - since)
        return out

    def verify_tree(tree: DraftTree, since: float):
        """One target forward over the whole tree (4D tree mask), verified; the cache keeps the accepted path."""
        nodes = torch.arange(tree.num_nodes)  # the tree is host bookkeeping; one copy of the forward's inputs
        ids, positions, mask4d = tree_inputs(target_kv, tree, nodes, mask_dtype, device, windows)
        step_logits, states = target_forward(since, input_ids=ids, position_ids=positions, attention_mask=mask4d)
        target_kv.fed(tree, nodes)
        raw = step_logits[0].float()
        processed = process_tree_logits(logits_processor, input_ids, tree, nodes, raw)
        result = verifier.verify(tree, processed)
        target_kv.commit(tree, result.accepted)
        return states, result.accepted, raw, processed, result.next_token

    root_only = torch.zeros(1, dtype=torch.long)  # the accepted path of a root-only tree

    def target_alone(tree: DraftTree, since: float):
        """A draft-free step is one plain ``generate`` step: the root alone, causally attending to a cache that holds
        exactly the committed tokens (no tree mask to build), and the target's own choice from the processed row
        (the rows returned are the accepted path's already)."""
        ids = tree.tokens[:1].view(1, 1).to(device)
        positions = torch.tensor([[target_kv.committed]], device=device)
        mask = causal_row_mask(1, target_kv.committed + 1, mask_dtype, device) if target.explicit_masks else None
        step_logits, states = target_forward(since, input_ids=ids, position_ids=positions, attention_mask=mask)
        target_kv.append_committed(1)
        raw = step_logits[0].float()  # [1, V]: the root's row is the accepted path's only row, no indexing needed
        processed = logits_processor(input_ids, raw)
        return states, root_only, raw, processed, verifier.target_choice(processed[0])

    finished, _ = emit(first.view(1), processed, logits)
    context = step_context(states, processed[0], -1, int(first))
    while not finished:
        source = WarpedDraftSource(drafter, logits_processor, input_ids)
        t0 = clock.now()
        if policy.may_draft(context.context_length):
            drafts = draft_trees(policy, [source], [context])
        else:
            drafts = DraftRound.draft_free([context])
        tree = drafts.trees[0]
        t1 = clock.now()
        draft_free = tree.num_nodes == 1 and target_kv.holds_only_committed
        states, accepted, raw, processed, next_token = (target_alone if draft_free else verify_tree)(tree, t1)
        new_tokens = torch.cat([tree.tokens[accepted[1:]], torch.tensor([next_token])])
        # the accepted path's node indices and tokens reach the device in one copy (emit appends the tokens; the rows
        # pick the path's raw and processed target logits and the drafter's features)
        rows, device_tokens = to_device(device, accepted, new_tokens)
        if not draft_free:
            raw, processed = raw[rows], processed[rows]
        t2 = clock.now()
        if "latencies" in needs:
            draft_mean.add(t1 - t0, source.num_forwards)
        draft_seconds += t1 - t0
        verify_seconds += t2 - t1
        draft_forwards += source.num_forwards
        tree_sizes.append(tree.num_nodes - 1)
        policy.observe(StepOutcome(
            trees=[tree], accepted=[accepted], contexts=[context], width=tree.num_nodes,
            context_length=input_ids.shape[1], draft_seconds=t1 - t0, verify_seconds=t2 - t1,
            draft_rounds=source.num_forwards, shapes=drafts.shapes,
        ))
        drafter.commit(tree, accepted, drafter_features(states, slice(None) if draft_free else rows))
        finished, count = emit(device_tokens, processed, raw)
        accepted_lengths.append(count)
        context = step_context(states, processed[-1], int(accepted[-1]), int(new_tokens[count - 1]))

    # the cache as plain generate leaves it: the rows of sequences[:, :-1] (an accepted chunk cut by a stopping
    # criterion left rows of tokens that are not in the output)
    keep_rows(cache, input_ids.shape[1] - 1, torch.zeros(0, dtype=torch.long))
    if windows is not None:
        windows.restore(cache)
    if streamer is not None:
        streamer.end()
    if not want_dict:
        return input_ids
    return TreeSpecGenerateOutput(
        sequences=input_ids,
        scores=scores,
        logits=raw_logits,
        **{CACHE_KWARG: cache},
        accepted_lengths=accepted_lengths,
        tree_sizes=tree_sizes,
        draft_forwards=draft_forwards,
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
        total_seconds=clock.now() - t_start,
        drafted_steps=sum(size > 0 for size in tree_sizes),
    )
