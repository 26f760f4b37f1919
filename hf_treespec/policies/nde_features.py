"""Inputs of the NDE delay selector: the named feature sets, the scalar features of a root and the drafter's hidden
state captured during drafting (shared by the policy at inference and by ``hf-treespec train nde-data`` offline, so
both compute the same numbers). See :mod:`.nde` for what each feature set holds and why."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from ..step_context import StepContext

if TYPE_CHECKING:
    from ..drafters.base import Drafter

#: scalar root features, in the order :func:`root_features` returns them
SCALAR_FEATURES: tuple[str, ...] = (
    "target_entropy", "target_top1", "root_target_logprob",
    "draft_entropy", "draft_top1", "draft_top2", "draft_top3", "draft_top4",
    "log_context_length", "temperature", "top_p", "log_draft_seconds", "log_target_seconds",
    "kl_target_draft", "kl_draft_target", "l1_target_draft",
)
#: the measured-latency features: hardware-aware, but on one machine they vary only with the context length
LATENCY_FEATURES: tuple[str, ...] = ("log_draft_seconds", "log_target_seconds")
#: p / q divergences at the root's parent (they need q there: see the module docstring)
DIVERGENCE_FEATURES: tuple[str, ...] = ("kl_target_draft", "kl_draft_target", "l1_target_draft")
#: hidden-state inputs the policy can provide
HIDDEN_FEATURES: tuple[str, ...] = ("target_hidden", "draft_hidden")
_LOG_FLOOR = -30.0
_PROB_FLOOR = 1e-10  # q floor inside the KL: warping (top-p) zeroes tokens the other side still has


@dataclass(frozen=True)
class FeatureSet:
    """A named choice of selector inputs: scalar features (from :data:`SCALAR_FEATURES`) and hidden-state blocks
    (from :data:`HIDDEN_FEATURES`)."""

    name: str
    scalars: tuple[str, ...]
    hidden: tuple[str, ...]


_ROOT_SCALARS = tuple(n for n in SCALAR_FEATURES if n not in LATENCY_FEATURES + DIVERGENCE_FEATURES)
#: ``root``: ours (no draft hidden state, no divergences, latencies opt-in); ``paper``: Appendix E's list
FEATURE_SETS: dict[str, FeatureSet] = {
    "root": FeatureSet("root", _ROOT_SCALARS, ("target_hidden",)),
    "paper": FeatureSet("paper", _ROOT_SCALARS + DIVERGENCE_FEATURES + LATENCY_FEATURES,
                        ("target_hidden", "draft_hidden")),
}


# ---------------------------------------------------------------------------------------------------- features
def _entropy(probs: torch.Tensor) -> float:
    logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return float(-(probs * logp).sum())


def _log(value: float | None) -> float:
    return math.log(value) if value is not None and value > 0 else math.nan


def divergences(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """``[3]``: KL(p || q), KL(q || p) and sum |p - q| of two ``[V]`` distributions at one position (the other side
    floored at 1e-10 inside each KL, as warping zeroes different tokens on each side); NaN without ``draft_probs``."""
    if draft_probs is None:
        return torch.full((3,), math.nan)
    p, q = target_probs.detach().float(), draft_probs.detach().float().to(target_probs.device)
    log_p, log_q = p.clamp(min=_PROB_FLOOR).log(), q.clamp(min=_PROB_FLOOR).log()
    kl_pq = torch.where(p > 0, p * (log_p - log_q), 0.0).sum()
    kl_qp = torch.where(q > 0, q * (log_q - log_p), 0.0).sum()
    return torch.stack([kl_pq, kl_qp, (p - q).abs().sum()]).cpu()


def root_features(
    target_probs: torch.Tensor, root_token: int, draft_probs: torch.Tensor, context_length: int, temperature: float,
    top_p: float, draft_seconds: float | None, target_seconds: float | None,
    draft_parent_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[len(SCALAR_FEATURES)]`` float32 scalar features of one root (``target_probs``: p at the root's parent;
    ``draft_probs``: q at the root; ``draft_parent_probs``: q at the parent, for the divergences). Unknown latencies
    and divergences are NaN (the selector replaces them by its training mean)."""
    p = target_probs.detach().float()
    q = draft_probs.detach().float()
    top = q.topk(min(4, q.numel())).values.tolist()
    top += [0.0] * (4 - len(top))
    p_root = float(p[int(root_token)])
    values = [
        _entropy(p), float(p.max()), max(math.log(p_root), _LOG_FLOOR) if p_root > 0 else _LOG_FLOOR,
        _entropy(q), *top,
        math.log(max(int(context_length), 1)), float(temperature), float(top_p),
        _log(draft_seconds), _log(target_seconds),
    ]
    return torch.cat([torch.tensor(values, dtype=torch.float32), divergences(p, draft_parent_probs)])


def context_features(context: StepContext, draft_probs: torch.Tensor,
                     draft_parent_probs: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`root_features` of a decoding step."""
    return root_features(context.target_probs, context.root_token, draft_probs, context.context_length,
                         context.temperature, context.top_p, context.draft_seconds, context.target_seconds,
                         draft_parent_probs)


def drafter_last_layer(drafter: "Drafter") -> nn.Module:
    """The last decoder block of a drafter's model (its output is the drafter's pre-norm last hidden state)."""
    from ..features import decoder_layers

    model = getattr(drafter, "model", None)
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers[-1]
    try:
        return decoder_layers(model)[-1]
    except (ValueError, AttributeError, TypeError) as error:
        raise ValueError(f"the delay selector reads the drafter's hidden state, but {type(drafter).__name__} has no "
                         "decoder layers to read it from (use a selector trained with feature_set='root').") from error


@contextmanager
def capture_draft_hidden(drafter: "Drafter") -> Iterator[list[torch.Tensor]]:
    """Within the block, each drafter forward appends its last block's output at the last input row (the node just
    expanded when one node is expanded at a time) to the yielded list."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        seen.append(out.reshape(-1, out.shape[-1])[-1].detach().float())

    handle = drafter_last_layer(drafter).register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()
