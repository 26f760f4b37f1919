"""Lean attention for compiled steps, through transformers' public `AttentionInterface`.

A compiled step's cache is a `PreallocatedLayer` whose buffers hold ``capacity`` rows, of which the step uses the
first ``mask.shape[-1]``. Transformers' ``sdpa`` attention would attend over every buffer row, and with a mask it
repeats each KV head for its query heads (a copy of the whole cache per layer, per step). Under compilation the
functions registered here instead

- attend over the used rows only: the rows the step's 4D mask covers (its last dimension, dynamic in the graph);
- group the query heads of each KV head (``[B, kv_heads, groups x rows, head_dim]``), so the keys and values are
  read in place, never repeated.

On a CPU the steps read the buffers in place through a small C++ op (`cache_attention`: one query row, or the
few rows of a tree step, without copying the rows they read; a prompt's chunk through two ``bmm``), where it builds.
Every other forward (eager ones: the prefill, a fallback, plain decoding; a mask as long as the keys) runs exactly
the attention they wrap, so eager decoding gives the tokens it always gave. `use_lean_attention` switches a model
to them (``sdpa`` and ``eager`` models; others keep theirs).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from .cache_attention import load_cache_attention

#: the implementation each lean function stands in for, and the mask builder the model uses with it
BASES = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}
PREFIX = "treespec_lean_"
#: the part of a lean implementation's name that says its steps read the cache in place
IN_PLACE = "in_place_"


#: attention arguments that change the arithmetic beyond a mask and a scale: with any of them set, the wrapped
#: implementation runs
ALTERING = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias", "head_mask", "attention_bias")


def _plain(kwargs: dict) -> bool:
    """Whether the call uses nothing beyond a mask and a scale (no soft-capping, sinks, windows, biases ...)."""
    return all(kwargs.get(name) is None for name in ALTERING)


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """Attention of ``query`` ``[B, H, q, D]`` over the first ``mask.shape[-1]`` rows of ``key`` / ``value``
    ``[B, H_kv, capacity, D]`` under the additive ``mask`` ``[B, 1, q, L]``, each KV head read once for its ``H /
    H_kv`` query heads; returns ``[B, q, H, D]`` as transformers' attention functions do. Scores and softmax in
    fp32."""
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], mask.shape[-1]
    groups = heads // kv_heads
    key, value = key[:, :, :length], value[:, :, :length]
    grouped = query.reshape(batch, kv_heads, groups * rows, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling
    scores = scores.view(batch, kv_heads, groups, rows, length) + mask.float()[:, :, None]
    probs = scores.softmax(-1).to(value.dtype).view(batch, kv_heads, groups * rows, length)
    out = torch.matmul(probs, value).view(batch, heads, rows, dim)
    return out.transpose(1, 2).contiguous()


def _lean(base, in_place=None):
    """The lean stand-in of ``base``; ``in_place``: the op for steps on the CPU (`cache_attention`), else
    `grouped_attention` serves them."""
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        # a compiled step hands the whole buffers with a mask over the used rows only (traced, or run eagerly by a
        # dynamo past its recompile limit: the same arithmetic either way); every other forward is the base's
        lean = (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype != torch.bool
                and attention_mask.shape[-1] < key.shape[-2] and dropout == 0.0 and _plain(kwargs)
                and query.shape[1] % key.shape[1] == 0)
        if not lean:
            return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if in_place is not None and query.device.type == "cpu":
            return in_place(query, key, value, attention_mask, scale), None
        return grouped_attention(query, key, value, attention_mask, scale), None

    return attention


for _name, _base in BASES.items():
    AttentionInterface.register(PREFIX + _name, _lean(_base))
    AttentionMaskInterface.register(PREFIX + _name, MASKS[_name])  # masks built exactly as for the base


def _in_place_name(base: str) -> str | None:
    """The lean stand-in of ``base`` whose steps read the cache in place (registered once the op is built); None
    where it cannot be built."""
    op = load_cache_attention()
    if op is None:
        return None
    name = PREFIX + IN_PLACE + base
    AttentionInterface.register(name, _lean(BASES[base], in_place=op))
    AttentionMaskInterface.register(name, MASKS[base])
    return name


def use_lean_attention(model: torch.nn.Module) -> bool:
    """Switches ``model`` to the lean stand-in of its attention (``set_attn_implementation``, public); True when it
    runs one (already, or now), False for an implementation without one (flash, flex ...: the model is unchanged).
    On a CPU the stand-in's steps read the cache in place (`cache_attention`) where that op builds."""
    current = getattr(model.config, "_attn_implementation", None)
    if isinstance(current, str) and current.startswith(PREFIX):
        return True
    if current not in BASES:
        return False
    on_cpu = next(model.parameters()).device.type == "cpu"
    name = (_in_place_name(current) if on_cpu else None) or PREFIX + current
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError):
        return False
    return getattr(model.config, "_attn_implementation", None) == name
