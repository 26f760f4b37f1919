"""Soft labels recomputed from stored target states, and the loss terms of EAGLE, HASS and TALF.

Prepared data stores the target's pre-norm last hidden state, not 49k-wide distributions; :class:`TargetHead` turns
it back into the target's log-probs with the target's own final norm and LM head (one matmul, frozen), restricted to
the drafter's vocabulary (EAGLE-3: target logits at the ``d2t`` rows, renormalised there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_treespec.features import final_norm


class TargetHead(nn.Module):
    """The target's final norm + LM head, frozen: ``log_softmax(lm_head(norm(h)))`` over the draft vocabulary."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.requires_grad_(False)

    @classmethod
    def from_target(cls, model: nn.Module) -> "TargetHead":
        norm = final_norm(model)
        head = model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise ValueError("the target needs a bias-free LM head (get_output_embeddings) to recompute soft labels.")
        return cls(norm, head)

    @torch.no_grad()
    def log_probs(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., len(rows)]`` fp32 log-probs (all ``vocab_size`` rows with ``rows=None``), as the target computes
        them (in its dtype)."""
        weight = self.lm_head.weight
        if rows is not None:
            weight = weight.index_select(0, rows.to(weight.device))
        logits = F.linear(self.norm(hidden.to(weight.dtype)), weight)
        return torch.log_softmax(logits.float(), dim=-1)


def soft_cross_entropy(target_logp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """``-sum_v p(v) log q(v)`` per position."""
    return -(target_logp.exp() * torch.log_softmax(draft_logits.float(), dim=-1)).sum(-1)


def topk_distillation(target_logp: torch.Tensor, draft_logits: torch.Tensor, k: int) -> torch.Tensor:
    """HASS's top-K term ``-sum_{v in topK(p)} p(v) log q(v)`` per position."""
    values, ids = target_logp.topk(min(k, target_logp.shape[-1]), dim=-1)
    draft_logq = torch.log_softmax(draft_logits.float(), dim=-1).gather(-1, ids)
    return -(values.exp() * draft_logq).sum(-1)


def feature_regression(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """EAGLE's SmoothL1 feature loss per position (mean over the hidden dimension), in the drafter's normalised and
    projected feature space: raw SmolLM2 states have outlier dimensions (~4700) that would dominate it."""
    return F.smooth_l1_loss(predicted.float(), target.float().detach(), reduction="none").mean(-1)


def top1_agreement(target_logp: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """1.0 where the drafter's argmax is the target's (both over the draft vocabulary)."""
    return (target_logp.argmax(-1) == draft_logits.argmax(-1)).float()
