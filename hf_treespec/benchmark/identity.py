"""Where a method's greedy output parts from plain ``generate``'s, and how close plain's two best tokens were there (a
near-tie decided by rounding in bf16, or a real divergence)."""

from __future__ import annotations

import warnings
from typing import Any

import torch


def _plain_logits(model, prompt, gen_kwargs, plain_tokens, backend: str | None = None) -> torch.Tensor:
    """Plain greedy generate's raw logits ``[n, V]`` (untimed; only needed where a method diverged); with a compile
    ``backend`` (``"inductor"``: ``CompileConfig()``; ``"openvino"``: the OpenVINO step), plain decoding's through
    that target forward (`plain_generate`)."""
    if backend is not None:
        from ..generation.plain import plain_generate
        from .methods import compile_config_for

        gen_kwargs = {**gen_kwargs, "custom_generate": plain_generate, "compile_config": compile_config_for(backend)}
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kwargs, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, prompt.shape[1]:].cpu()
    if not torch.equal(tokens, plain_tokens):
        warnings.warn("plain greedy generate gave different tokens on a second call (non-deterministic kernels?); "
                      "logit gaps at divergences refer to the second call.", stacklevel=2)
    return torch.cat(out.logits, dim=0).float().cpu()


def divergence(plain: torch.Tensor, other: torch.Tensor, plain_logits: torch.Tensor) -> dict[str, Any]:
    """Where ``other`` first leaves ``plain`` and how close plain's choice was there.

    ``top2_gap``: plain's top-1 minus top-2 logit at that position; ``chosen_gap``: plain's top-1 logit minus its
    logit for the token the method emitted. Near-zero gaps mean a bf16 rounding tie, not a verification bug.
    """
    n = min(plain.numel(), other.numel())
    mismatch = (plain[:n] != other[:n]).nonzero()
    position = int(mismatch[0]) if mismatch.numel() else n
    info: dict[str, Any] = {"position": position, "plain_token": None, "method_token": None,
                            "top2_gap": None, "chosen_gap": None}
    if position < plain.numel():
        info["plain_token"] = int(plain[position])
    if position < other.numel():
        info["method_token"] = int(other[position])
    if position < plain_logits.shape[0]:
        row = plain_logits[position]
        top = row.topk(2).values
        info["top2_gap"] = float(top[0] - top[1])
        if info["method_token"] is not None:
            info["chosen_gap"] = float(top[0] - row[info["method_token"]])
    return info
