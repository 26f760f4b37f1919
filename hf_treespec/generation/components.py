"""What the decoding loops (the tree loop, plain decoding) share: the output type, the policy / verifier pair, the
input checks and the ``inference_mode`` wrapper."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..drafters.base import Drafter, as_drafter
from ..policies import POLICIES, TreePolicy
from ..verifiers import VERIFIERS, Verifier
from .config import TreeSpecSettings


@dataclass
class TreeSpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus what a speculative run costs and gains.

    Attributes:
        accepted_lengths: tokens committed per target forward after the prefill (accepted drafts + 1, fewer when a
            stopping criterion cut the chunk), so their mean is tau.
        tree_sizes: draft nodes verified per step.
        draft_forwards: drafter forwards run (for a batch, one forward drafts every row in a round).
        draft_seconds / verify_seconds / total_seconds: wall-clock split (verify = target forward + verification).
        drafted_steps: steps that verified at least one draft node; the others ran the target alone (one token, a
            plain ``generate`` step), which ``tree_budget="auto"`` chooses where no tree pays on this hardware.
        row_accepted_lengths: for a batch, ``accepted_lengths`` of each row (``accepted_lengths`` and ``tree_sizes``
            then hold every row's steps, row after row, so their mean is still tau).
        attention_mask: for a batch, ``[B, width]`` 1 where ``sequences`` holds a prompt or generated token, 0 at left
            padding and after a row finished: with the returned cache it continues plain ``generate`` for every row.
    """

    accepted_lengths: list[int] | None = None
    tree_sizes: list[int] | None = None
    draft_forwards: int | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    total_seconds: float | None = None
    drafted_steps: int | None = None
    row_accepted_lengths: list[list[int]] | None = None
    attention_mask: torch.LongTensor | None = None


def check_no_beams(generation_config: GenerationConfig) -> None:
    """Refuses beam search: generate would expand the prompt into beams and silently drop them for a decoding method."""
    beams = getattr(generation_config, "num_beams", None) or 1
    if beams > 1:
        raise ValueError(
            f"tree_policy cannot be combined with num_beams={beams}: tree speculation decodes one sequence (greedy "
            "or sampled), and generate would silently drop beam search. Use num_beams=1 with tree_policy, or drop "
            "tree_policy to run beam search."
        )


def resolve(generation_config: GenerationConfig, drafter: Drafter | None = None) -> tuple[TreePolicy, Verifier]:
    """Builds the policy and verifier named in the generation config, refusing pairs that would not be lossless.
    Kwargs left unset may be filled from what ships with ``drafter`` (``TreePolicy.defaults_from_drafter``)."""
    settings = TreeSpecSettings.from_generation_config(generation_config)
    check_no_beams(generation_config)
    policy_cls = POLICIES.get(settings.policy)
    params = {k: v for k, v in settings.policy_params.items() if k in policy_cls.defaults and v is not None}
    if drafter is not None:
        params = {**policy_cls.defaults_from_drafter(drafter), **params}
    ignored = [k for k, v in settings.policy_params.items() if v is not None and k not in policy_cls.defaults]
    if ignored:
        raise ValueError(
            f"tree_policy={settings.policy!r} does not use {ignored}; it takes {sorted(policy_cls.defaults)}."
        )
    policy = policy_cls(do_sample=settings.do_sample, **params)
    verifier_name = settings.verifier or ("greedy" if not settings.do_sample else policy.default_verifier)
    verifier_cls = VERIFIERS.get(verifier_name)
    verifier_cls.check_compatible(
        policy.regime_for(), is_chain=policy.is_chain, do_sample=settings.do_sample, policy=settings.policy
    )
    return policy, verifier_cls()


def check_decoder_only(model: torch.nn.Module) -> None:
    """Tree speculation feeds the tree through the model's own causal cache; an encoder-decoder model's generate
    state (encoder outputs, cross-attention cache) is not that, so it is refused by name."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model: tree speculation needs a decoder-only causal LM "
            "(AutoModelForCausalLM). Drop tree_policy for this model."
        )


# what generate hands a decoding loop for a text prompt (both cache names: the keyword moved in transformers 5.24)
TEXT_MODEL_KWARGS = frozenset(
    {"attention_mask", "cache", "past_key_values", "cache_position", "logits_to_keep", "position_ids", "use_cache"}
)


def check_text_only(model_kwargs: dict) -> None:
    """The loops feed token ids and tree positions only: any other model input (a multimodal model's images or
    audio, token types, input embeddings) would be silently dropped, so it is refused by name."""
    extra = sorted(key for key, value in model_kwargs.items() if _given(value) and key not in TEXT_MODEL_KWARGS)
    if extra:
        raise ValueError(
            f"tree speculation feeds token ids only; the model inputs {extra} would be ignored by its forwards. "
            "Decode inputs with images, audio or embeddings without tree_policy (a multimodal model's text-only "
            "prompts are supported)."
        )


def _given(value) -> bool:
    """Whether a model input carries something: not None, and not an empty container (generate passes a text-only
    prompt's multimodal encoder outputs as ``{}`` from 5.24 on)."""
    if isinstance(value, dict):
        return any(_given(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_given(v) for v in value)
    return value is not None


def check_drafter(target: torch.nn.Module, assistant: torch.nn.Module | None) -> Drafter:
    if assistant is None:
        raise ValueError(
            "tree_policy needs a drafter: pass assistant_model= (hf_treespec.drafters.prompt_lookup(model) drafts from "
            "the prompt with no model; a trained TreeSpecDrafterModel, e.g. hf_treespec.assets.default_drafter(model) "
            "for SmolLM2 or one from `hf-treespec train`; or a small AutoModelForCausalLM sharing the vocabulary)."
        )
    drafter = as_drafter(assistant, target=target)
    target_vocab = int(target.config.get_text_config().vocab_size)
    if drafter.vocab_size != target_vocab:
        raise ValueError(
            f"The drafter's vocabulary ({drafter.vocab_size} tokens) does not match the target's ({target_vocab}). "
            "Tree speculation verifies draft token ids directly, so both must share one tokenizer; pick a drafter "
            "trained on the target's tokenizer (transformers' universal assisted decoding, without tree_policy, "
            "handles different tokenizers)."
        )
    return drafter


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


def check_empty_cache(cache, what: str) -> None:
    """A decoding loop starts from an empty cache: it feeds the whole prompt. A ``past_key_values`` that already
    holds tokens would be fed them twice."""
    if cache.get_seq_length() != 0:
        raise ValueError(
            f"{what} starts from an empty cache, but past_key_values already holds {cache.get_seq_length()} tokens. "
            "Pass the whole conversation as input_ids without past_key_values."
        )
