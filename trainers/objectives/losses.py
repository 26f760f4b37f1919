"""Soft labels recomputed from stored target states, and the loss terms of EAGLE, HASS and TALF.

Prepared data stores the target's pre-norm last hidden state, not 49k-wide distributions; :class:`TargetHead` turns
it back into the target's log-probs with the target's own final norm and LM head (one matmul, frozen), restricted to
the drafter's vocabulary (EAGLE-3: target logits at the ``d2t`` rows, renormalised there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_treespec.api import capture_hidden_states, final_norm


class TargetHead(nn.Module):
    """The target's final norm + LM head, frozen: ``log_softmax(lm_head(norm(h)))`` over the draft vocabulary, with
    the output transform of architectures whose logits are not the LM head's output (``final_logit_softcapping`` of
    Gemma 2 / 3, ``logits_scaling`` of Granite, ``logit_scale`` of Cohere: public config fields, elementwise, so they
    also hold on a draft-vocabulary slice)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None = None, scale: float = 1.0):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.softcap, self.scale = softcap, scale
        self.requires_grad_(False)

    @classmethod
    def from_target(cls, model: nn.Module) -> "TargetHead":
        """The head of ``model``, checked on a short probe against the model's own log-probs: an architecture whose
        logits differ from this head in another way is refused by name rather than trained on wrong labels."""
        norm = final_norm(model)
        head = model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise ValueError("the target needs a bias-free LM head (get_output_embeddings) to recompute soft labels.")
        text = model.config.get_text_config(decoder=True)
        scale = float(getattr(text, "logit_scale", None) or 1.0) / float(getattr(text, "logits_scaling", None) or 1.0)
        made = cls(norm, head, softcap=getattr(text, "final_logit_softcapping", None), scale=scale)
        made._check_against(model)
        return made

    @torch.no_grad()
    def _check_against(self, model: nn.Module) -> None:
        vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        ids = torch.arange(4, device=self.lm_head.weight.device).remainder(vocab)[None]
        training = model.training
        try:
            with capture_hidden_states(model.eval(), [-1]) as states:
                expected = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
        finally:
            model.train(training)
        if not torch.allclose(self.log_probs(states.hidden_states), expected, atol=1e-2, rtol=1e-2):
            raise ValueError(
                f"{type(model).__name__}'s logits are not its LM head over its final norm (with the soft-capping / "
                "scaling its config declares), so soft labels cannot be recomputed from its stored hidden states; "
                "this architecture is not supported for drafter training."
            )

    @torch.no_grad()
    def log_probs(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., len(rows)]`` fp32 log-probs (all ``vocab_size`` rows with ``rows=None``), as the target computes
        them (in its dtype)."""
        weight = self.lm_head.weight
        if rows is not None:
            weight = weight.index_select(0, rows.to(weight.device))
        logits = F.linear(self.norm(hidden.to(weight.dtype)), weight)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
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
