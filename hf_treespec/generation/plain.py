"""`plain_generate`: plain decoding (one token per target forward) through `TargetForward`, as a ``custom_generate``.

With ``compile_config`` it runs every step through the same compiled forward as a compiled tree run (the same graphs,
the same eager prefill, the same explicit masks), so it is the baseline a compiled tree run is measured against:
transformers' own compile switch does not fire on a CPU. Without it, it is an eager plain loop. Greedy or sampled
as ``generate``'s ``_sample`` chooses tokens (argmax, or one draw from the processed scores' softmax: the same law,
drawn by `categorical_rows` without the exponential per vocabulary entry that ``torch.multinomial`` draws), left
padded batches included.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..attention import additive_mask
from ..compat import CACHE_KWARG
from ..compiled.host_threads import HostThreads
from ..kv.stateful_kv import hand_back
from ..randomness import categorical_rows
from .config import GENERATE_ONLY_KWARGS
from .components import check_empty_cache, returns_outside_inference_mode
from .processors import run_processors
from .target import TargetForward, compiled_for_generation


@returns_outside_inference_mode
def plain_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer=None,
    **model_kwargs,
):
    """Plain decoding loop (``generate``'s decoding-method inputs and outputs); entry: `plain_generate`."""
    cache = model_kwargs.get(CACHE_KWARG)
    if cache is None:
        raise ValueError("plain_generate needs use_cache=True.")
    check_empty_cache(cache, "plain_generate")
    device = input_ids.device
    batch = input_ids.shape[0]
    prompt_mask = model_kwargs.get("attention_mask")
    if prompt_mask is None:
        prompt_mask = torch.ones_like(input_ids)
    sliding = any(getattr(layer, "is_sliding", False) for layer in cache.layers)
    compiled = compiled_for_generation(model, cache, generation_config, sliding, batch)
    target = TargetForward(model, cache, (), compiled)
    want_dict = generation_config.return_dict_in_generate
    scores = () if (want_dict and generation_config.output_scores) else None
    raw_logits = () if (want_dict and generation_config.output_logits) else None
    pad = generation_config.pad_token_id

    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits, _ = target.prefill(input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions,
                               logits_to_keep=1)
    columns = prompt_mask.bool()  # [B, n]: the cache columns each row attends to
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    position = positions[:, -1:]
    with HostThreads(target.engine) as threads:  # an engine's steps: its own threads get the cores
        threads.narrow()
        while True:
            raw = logits[:, -1].float()
            processed = run_processors(logits_processor, input_ids, raw)
            if scores is not None:
                scores += (processed,)
            if raw_logits is not None:
                raw_logits += (raw,)
            if generation_config.do_sample:
                tokens = categorical_rows(processed.softmax(-1))
            else:
                tokens = processed.argmax(-1)
            if pad is not None:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(tokens.cpu())
            unfinished = unfinished * (~stopping_criteria(input_ids, processed)).long()
            if not bool(unfinished.any()):
                break
            columns = torch.cat([columns, torch.ones(batch, 1, dtype=torch.bool, device=device)], dim=-1)
            position = position + 1
            # [B, n] columns a one-token step attends to: its [B, 1, 1, n] additive mask when compiled
            mask = additive_mask(columns, model.dtype)[:, None, None, :] if target.explicit_masks else columns.long()
            logits, _ = target.step(tokens[:, None], position, mask)
    if target.engine is not None:  # the cache as eager decoding leaves it: every fed row (read when first used)
        hand_back(target.engine, cache, torch.arange(target.engine.held))
    if streamer is not None:
        streamer.end()
    if not want_dict:
        return input_ids
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits,
                                     **{CACHE_KWARG: cache})


def plain_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                   **kwargs):
    """Plain decoding for ``generate(custom_generate=plain_generate, ...)``; with ``compile_config=CompileConfig()``
    the steps run through the compiled target forward."""
    for unused in (*GENERATE_ONLY_KWARGS, "assistant_model"):
        kwargs.pop(unused, None)
    return plain_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                          streamer=streamer, **kwargs)
