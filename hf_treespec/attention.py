"""Tree attention: the 4D float mask and the attention-implementation checks that make it legal.

Measured on transformers 5.23: a 4D *float* mask ``[B, 1, q, kv]`` (0 = attend, finfo.min = masked) with explicit
``position_ids`` works with ``sdpa`` and ``eager``; a bool mask with eager is silently wrong; flash-attention-2 cannot
express tree masks and flex-attention needs a BlockMask. So we always build float masks and refuse the others.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

#: attention implementations that take a 4D float mask: transformers' own, and the compiled steps' lean stand-ins for
#: them (`hf_treespec.compiled.attention`)
TREE_MASK_ATTENTION = ("sdpa", "eager", "treespec_lean_sdpa", "treespec_lean_eager", "treespec_lean_in_place_sdpa",
                       "treespec_lean_in_place_eager")


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility of any shape -> the additive float mask of that shape in ``dtype`` (0 where visible, the
    dtype's lowest value elsewhere)."""
    return visible.new_zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)


def float_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[q, kv]`` bool visibility -> ``[1, 1, q, kv]`` additive float mask in ``dtype``."""
    return additive_mask(visible, dtype)[None, None]


def causal_row_mask(rows: int, keys: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``[1, 1, rows, keys]`` additive mask of the last ``rows`` of a causal forward over ``keys`` columns (the cache
    then the new rows): what a plain step attends to, spelled out for a compiled forward, which takes every step's
    mask explicitly."""
    visible = torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)
    return float_mask(visible, dtype)


def prompt_visibility(prompt_mask: torch.Tensor | None, batch: int, length: int,
                      device: torch.device | str) -> torch.Tensor:
    """``[batch, length, length]`` bool: what each prompt row of a prefill sees, causally; with a left-padded
    ``prompt_mask`` ``[batch, length]``, a padding row sees only itself and is seen by nothing (a row that sees nothing
    would turn its softmax into NaN)."""
    visible = torch.ones(length, length, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)
    if prompt_mask is None:
        return visible
    return (visible & prompt_mask.bool().to(device)[:, None, :]) | torch.eye(length, dtype=torch.bool, device=device)


def check_tree_positions(model: torch.nn.Module, role: str = "model") -> None:
    """Tree nodes sit at their depth's position, not at their cache column: a model must take ``position_ids``, and
    one whose positions come from the mask instead (ALiBi: Bloom, MPT, Falcon with ``alibi``) is refused by name."""
    if not isinstance(model, PreTrainedModel):
        return
    text = model.config.get_text_config(decoder=True)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # the transformers module, even wrapped
    takes_positions = "position_ids" in inspect.signature(decoder.forward).parameters
    if not takes_positions or getattr(text, "alibi", False):
        why = "uses ALiBi" if takes_positions else "takes no position_ids"
        raise ValueError(
            f"The {role} ({type(model).__name__}) {why}: it derives token positions from a 2D attention mask, so "
            "a tree's nodes cannot be placed at their depth. Decode it without tree_policy."
        )


def check_tree_attention(model: torch.nn.Module, role: str = "model") -> None:
    """Switches a model whose attention cannot take a 4D float mask to sdpa, or refuses with advice; refuses models
    that cannot take tree positions (`check_tree_positions`)."""
    check_mask_attention(model, role)
    check_tree_positions(model, role)


def check_mask_attention(model: torch.nn.Module, role: str = "model") -> None:
    """Switches a model whose attention cannot take a 4D float mask to sdpa, or refuses with advice."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or impl in TREE_MASK_ATTENTION:
        return
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("sdpa")
            return
        except Exception as err:  # pragma: no cover - depends on the architecture
            raise ValueError(
                f"The {role} uses attn_implementation={impl!r}, which cannot express tree attention masks, and "
                f"switching it to 'sdpa' failed ({err}). Load it with attn_implementation='sdpa' or 'eager'."
            ) from err
    raise ValueError(
        f"The {role} uses attn_implementation={impl!r}, which cannot express tree attention masks; load it with "
        "attn_implementation='sdpa' or 'eager'."
    )
