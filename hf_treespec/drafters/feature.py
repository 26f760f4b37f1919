"""The TreeSpec feature drafter: an EAGLE-style draft head over target hidden states, as a transformers model.

One decoding position of the drafter reads a token and a *feature*: the target's hidden state at the previous
position for committed tokens, or the drafter's own output feature at the parent node for tree nodes. That is what lets
one small decoder layer predict several tokens ahead (EAGLE). Two input layouts, chosen by ``config.input_mode``:

``"fc"`` (default; EAGLE-1 layout)
    ``x = fc([embed(token); feature])`` -> ``LlamaDecoderLayer`` x N -> RMSNorm -> LM head.
``"eagle3"`` (EAGLE-3 layout, exportable to vLLM / SGLang)
    the first layer's attention reads ``[input_layernorm(embed(token)); hidden_norm(feature)]`` (2 x hidden) and its
    residual stream starts from the feature; further layers are plain ``LlamaDecoderLayer``.

Target features ``[*, len(target_layers) * target_hidden_size]`` enter through ``project_features``: an optional
RMSNorm over the concatenated layers (SmolLM2's pre-norm states have outlier dimensions up to ~4700, which make
unnormalised training unstable) and an optional linear projection to ``hidden_size``. The drafter's output feature
(``hidden_states`` of the output, after the layers and before the final norm) lives in the same space, which is why it
can be fed back for the next depth.

A reduced draft vocabulary (EAGLE-3) keeps the LM head at ``draft_vocab_size`` rows; the ``d2t`` buffer maps draft
index -> target token id and ``t2d`` marks the target ids inside the draft vocabulary. ``config.vocab_size`` is always
the *target's* vocabulary.

The classes are registered with ``AutoConfig`` / ``AutoModel`` when ``hf_treespec`` is imported, so
``AutoModel.from_pretrained(path)`` returns a :class:`TreeSpecDrafterModel`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from ..compat import CACHE_KWARG

INPUT_MODES = ("fc", "eagle3")

# Architecture fields copied from the target by `TreeSpecDrafterConfig.for_target` (same tokenizer, same geometry).
_TARGET_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias", "pad_token_id",
    "bos_token_id", "eos_token_id",
)


class TreeSpecDrafterConfig(PretrainedConfig):
    r"""Configuration of a :class:`TreeSpecDrafterModel`.

    Llama fields (``hidden_size``, ``num_attention_heads``, ``rope_parameters`` ...) describe the drafter's decoder
    layer(s). The drafter-specific fields:

    Args:
        vocab_size: the **target's** vocabulary size (what generate's assistant checks compare).
        target_layers: target layers whose hidden states are read, concatenated in this order. ``-1`` = the
            pre-norm input of the target's final norm (EAGLE-1); other indices = outputs of decoder layer ``i``
            (EAGLE-3 uses three, e.g. low / mid / high).
        target_hidden_size: hidden size of the target (defaults to ``hidden_size``).
        draft_vocab_size: rows of the LM head (defaults to ``vocab_size``); see ``build_draft_vocab``.
        input_mode: ``"fc"`` (fc over ``[embed; feature]``) or ``"eagle3"`` (2 x hidden attention input).
        feature_norm: RMSNorm over the concatenated target features before the projection.
        feature_norm_eps: epsilon of that norm (defaults to ``rms_norm_eps``).
        feature_projection: a bias-free linear map from the target features to ``hidden_size``; without it the
            features must already be ``hidden_size`` wide.
        fc_bias: bias of the ``fc`` input layer (``input_mode="fc"``; EAGLE-1 checkpoints have one).
        first_layer_input_norm: keep the first layer's ``input_layernorm`` (EAGLE-1 drops it).
        final_norm: RMSNorm before the LM head (EAGLE-1 has none: its features are post-norm already).
        share_target_embeddings / share_target_lm_head: the token embedding / LM head are the target's, attached
            with ``model.tie_to_target(target)`` after loading and never saved with the drafter.
    """

    model_type = "treespec_drafter"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 1
    num_attention_heads: int = 9
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True
    target_layers: list[int] | None = None
    target_hidden_size: int | None = None
    draft_vocab_size: int | None = None
    input_mode: str = "fc"
    feature_norm: bool = True
    feature_norm_eps: float | None = None
    feature_projection: bool = True
    fc_bias: bool = False
    first_layer_input_norm: bool = True
    final_norm: bool = True
    share_target_embeddings: bool = False
    share_target_lm_head: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.target_layers = [int(i) for i in (self.target_layers if self.target_layers is not None else [-1])]
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.feature_norm_eps is None:
            self.feature_norm_eps = self.rms_norm_eps
        if self.rope_parameters is None and "rope_theta" not in kwargs and "rope_scaling" not in kwargs:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        super().__post_init__(**kwargs)
        self._check_drafter_fields()

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features the drafter reads."""
        return len(self.target_layers) * self.target_hidden_size

    def _check_drafter_fields(self) -> None:
        if self.input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {self.input_mode!r}.")
        if not self.target_layers or len(set(self.target_layers)) != len(self.target_layers):
            raise ValueError(f"target_layers must be a non-empty list of distinct layer indices, got "
                             f"{self.target_layers}.")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be between 1 and vocab_size={self.vocab_size}, got "
                             f"{self.draft_vocab_size}.")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}.")
        if not self.feature_projection and self.feature_size != self.hidden_size:
            raise ValueError(
                f"feature_projection=False needs target features as wide as hidden_size ({self.hidden_size}), but "
                f"{len(self.target_layers)} layer(s) x target_hidden_size {self.target_hidden_size} = "
                f"{self.feature_size}. Set feature_projection=True."
            )
        if (self.share_target_embeddings or self.share_target_lm_head) and self.target_hidden_size != self.hidden_size:
            raise ValueError(
                f"sharing the target's embeddings / LM head needs hidden_size == target_hidden_size "
                f"({self.hidden_size} != {self.target_hidden_size})."
            )
        if self.input_mode == "eagle3" and not self.first_layer_input_norm:
            raise ValueError("input_mode='eagle3' normalises the token embedding with input_layernorm; "
                             "first_layer_input_norm=False is only for input_mode='fc'.")

    @classmethod
    def for_target(cls, target_config: PretrainedConfig, **overrides: Any) -> "TreeSpecDrafterConfig":
        """A drafter config with the target's vocabulary, geometry and RoPE (one decoder layer), then ``overrides``.

        The drafter's layer is Llama-style whatever the target's family: fields the target's config does not name
        keep the drafter's defaults, except the MLP width (4 x hidden, the GPT-2 / OPT ratio, when the target has
        no ``intermediate_size``); a RoPE given per layer type (Gemma 3) is the full-attention layers' one."""
        if getattr(target_config, "is_encoder_decoder", False):
            raise ValueError(
                f"{type(target_config).__name__} describes an encoder-decoder model: feature drafters read a "
                "decoder-only causal LM's hidden states."
            )
        text = target_config.get_text_config()
        fields = {name: copy.deepcopy(getattr(text, name)) for name in _TARGET_FIELDS if hasattr(text, name)}
        rope = copy.deepcopy(getattr(text, "rope_parameters", None))
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            rope = rope["full_attention"]
        fields["rope_parameters"] = rope
        if fields.get("intermediate_size") is None:
            fields["intermediate_size"] = 4 * int(text.hidden_size)
        fields["target_hidden_size"] = text.hidden_size
        fields["num_hidden_layers"] = 1
        fields.update(overrides)
        return cls(**fields)


@dataclass
class TreeSpecDrafterOutput(ModelOutput):
    """Output of :class:`TreeSpecDrafterModel`.

    Attributes:
        loss: cross-entropy over the draft vocabulary when ``labels`` were given.
        logits: ``[B, T, draft_vocab_size]`` (the last ``logits_to_keep`` positions when that was set).
        hidden_states: ``[B, T, hidden_size]`` drafter features after the decoder layers, before the final norm;
            feed them back through ``features=`` for the next depth.
        cache: the KV cache, when ``use_cache`` (named as transformers names it from 5.24 on, in every release).
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None
    cache: Cache | None = None


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """transformers' ``LlamaDecoderLayer`` with EAGLE-3's first-layer input: attention over the concatenation of the
    normalised token embedding and the normalised feature (q/k/v take 2 x hidden), residual stream = the feature."""

    def __init__(self, config: TreeSpecDrafterConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        attn = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * config.hidden_size, old.out_features, bias=old.bias is not None))
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """``kwargs`` reach the attention as they do in ``LlamaDecoderLayer`` (the cache under
        :data:`~hf_treespec.compat.CACHE_KWARG`)."""
        residual = hidden_states
        attn_input = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden_states)], dim=-1)
        attn_output, _ = self.self_attn(
            hidden_states=attn_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def vocab_mask(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``t2d``: ``[vocab_size]`` bool, True for the target ids listed in ``d2t``."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    mask[d2t] = True
    return mask


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent target tokens as a draft vocabulary: ``(d2t, t2d)``.

    ``token_counts`` is ``[vocab_size]`` (e.g. a bincount of the target's next tokens over training data). ``d2t`` is
    ascending (EAGLE-3 convention); ties go to the lower token id, so the result is deterministic.
    """
    counts = torch.as_tensor(token_counts)
    if counts.ndim != 1 or counts.numel() == 0:
        raise ValueError(f"token_counts must be a 1-D [vocab_size] tensor, got shape {tuple(counts.shape)}.")
    if not 1 <= size <= counts.numel():
        raise ValueError(f"size must be between 1 and the vocabulary size {counts.numel()}, got {size}.")
    order = torch.sort(counts.double(), descending=True, stable=True).indices[:size]
    d2t = order.sort().values.long()
    return d2t, vocab_mask(d2t, counts.numel())


class TreeSpecDrafterModel(PreTrainedModel):
    """EAGLE-style feature drafter (see the module docstring). Train with ``forward``; draft with ``generate(...,
    assistant_model=drafter, tree_policy=...)`` (the :class:`~hf_treespec.drafters.FeatureDrafter` adapter)."""

    config_class = TreeSpecDrafterConfig
    config: TreeSpecDrafterConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaDecoderLayer", "Eagle3DecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: TreeSpecDrafterConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.embed_tokens = (
            None if config.share_target_embeddings
            else nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        )
        self.feature_norm = (
            LlamaRMSNorm(config.feature_size, eps=config.feature_norm_eps) if config.feature_norm else None
        )
        self.feature_proj = nn.Linear(config.feature_size, hidden, bias=False) if config.feature_projection else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias) if config.input_mode == "fc" else None
        first = Eagle3DecoderLayer(config, 0) if config.input_mode == "eagle3" else LlamaDecoderLayer(config, 0)
        if not config.first_layer_input_norm:
            first.input_layernorm = nn.Identity()
        rest = [LlamaDecoderLayer(config, i) for i in range(1, config.num_hidden_layers)]
        self.layers = nn.ModuleList([first, *rest])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps) if config.final_norm else None
        self.lm_head = (
            None if config.share_target_lm_head else nn.Linear(hidden, config.draft_vocab_size, bias=False)
        )
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        d2t = torch.arange(config.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", vocab_mask(d2t, config.vocab_size))
        # target modules shared by `tie_to_target`: a plain dict, so they are neither saved nor moved with the drafter
        self._attached: dict[str, Any] = {}
        self._memo: dict[str, Any] = {}  # derived tensors keyed on the versions of what they derive from
        self.gradient_checkpointing = False
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, TreeSpecDrafterModel):
            d2t = torch.arange(module.config.draft_vocab_size)
            init.copy_(module.d2t, d2t)
            init.copy_(module.t2d, vocab_mask(d2t, module.config.vocab_size))

    # ------------------------------------------------------------------------------------------ target sharing
    def tie_to_target(
        self, target: PreTrainedModel, *, embeddings: bool | None = None, lm_head: bool | None = None
    ) -> "TreeSpecDrafterModel":
        """Uses the target's token embedding / LM head instead of storing them (defaults: what the config records).

        Passing ``embeddings=True`` / ``lm_head=True`` on a drafter that stores its own drops them and records the
        sharing in the config, so ``save_pretrained`` writes a smaller checkpoint. Returns ``self``.
        """
        embeddings = self.config.share_target_embeddings if embeddings is None else embeddings
        lm_head = self.config.share_target_lm_head if lm_head is None else lm_head
        for wanted, flag, name in ((embeddings, "share_target_embeddings", "embeddings"),
                                   (lm_head, "share_target_lm_head", "LM head")):
            if not wanted and getattr(self.config, flag):
                raise ValueError(f"this drafter was saved without its {name} ({flag}=True): it must share the "
                                 "target's.")
        if (embeddings or lm_head) and self.config.target_hidden_size != self.config.hidden_size:
            raise ValueError("sharing the target's embeddings / LM head needs hidden_size == target_hidden_size.")
        expected = (self.config.vocab_size, self.config.hidden_size)
        if embeddings:
            module = target.get_input_embeddings()
            self._check_shared(module, expected, "input embeddings")
            self.embed_tokens = None
            self.config.share_target_embeddings = True
            self._attached["embed_tokens"] = module
        if lm_head:
            module = target.get_output_embeddings()
            self._check_shared(module, expected, "LM head")
            if getattr(module, "bias", None) is not None:
                raise ValueError("cannot share a target LM head with a bias.")
            self.lm_head = None
            self.config.share_target_lm_head = True
            self._attached["lm_head"] = module
        return self

    @staticmethod
    def _check_shared(module: nn.Module | None, expected: tuple[int, int], name: str) -> None:
        weight = getattr(module, "weight", None)
        if weight is None or tuple(weight.shape) != expected:
            got = None if weight is None else tuple(weight.shape)
            raise ValueError(f"the target's {name} has shape {got}; this drafter needs {expected} "
                             "(vocab_size, hidden_size). Is it the drafter's target model?")

    @property
    def is_attached(self) -> bool:
        """Whether every module the config says is shared has been attached with ``tie_to_target``."""
        return (self.embed_tokens is not None or "embed_tokens" in self._attached) and \
            (self.lm_head is not None or "lm_head" in self._attached)

    def _missing_target(self, what: str) -> ValueError:
        return ValueError(
            f"this drafter shares the target's {what} (config.share_target_*), which are not stored with it: call "
            "drafter.tie_to_target(target_model) once after loading."
        )

    def get_input_embeddings(self) -> nn.Module | None:
        return self.embed_tokens if self.embed_tokens is not None else self._attached.get("embed_tokens")

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head if self.lm_head is not None else self._attached.get("lm_head")

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    # --------------------------------------------------------------------------------------- draft vocabulary
    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor | Sequence[int]) -> None:
        """Sets the draft vocabulary (``d2t[i]`` = target id of LM-head row i), e.g. from ``build_draft_vocab``.

        Do this before training the head: rows of a trained head are tied to the map they were trained with.
        """
        d2t = torch.as_tensor(d2t).long().flatten()
        size, vocab = self.config.draft_vocab_size, self.config.vocab_size
        if d2t.numel() != size:
            raise ValueError(f"d2t must list draft_vocab_size={size} target ids, got {d2t.numel()}.")
        if bool((d2t < 0).any()) or bool((d2t >= vocab).any()):
            raise ValueError(f"d2t must hold target ids in [0, {vocab}).")
        if torch.unique(d2t).numel() != size:
            raise ValueError("d2t must not repeat a target id.")
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(vocab_mask(self.d2t, vocab))

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target token ids -> LM-head rows; -100 for ignored labels and tokens outside the draft vocabulary."""
        lookup = torch.full((self.config.vocab_size,), -100, dtype=torch.long, device=labels.device)
        lookup[self.d2t.to(labels.device)] = torch.arange(self.config.draft_vocab_size, device=labels.device)
        return torch.where(labels >= 0, lookup[labels.clamp(min=0)], torch.full_like(labels, -100))

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., draft_vocab_size]`` -> ``[..., vocab_size]``, -inf outside the draft vocabulary."""
        if self._identity_vocab():
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.d2t.to(logits.device)] = logits
        return out

    def _identity_vocab(self) -> bool:
        """Whether draft index i is target id i for every id (full vocabulary, natural order); memoised per d2t."""
        key = (self.d2t.data_ptr(), self.d2t._version)
        cached = self._memo.get("identity")
        if cached is None or cached[0] != key:
            full = self.config.draft_vocab_size == self.config.vocab_size
            identity = full and bool((self.d2t == torch.arange(self.d2t.numel(), device=self.d2t.device)).all())
            cached = self._memo["identity"] = (key, identity)
        return cached[1]

    # ------------------------------------------------------------------------------------------------ forward
    def project_features(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """Target hidden states ``[..., feature_size]`` -> drafter features ``[..., hidden_size]``."""
        if target_hidden_states.shape[-1] != self.config.feature_size:
            raise ValueError(
                f"target hidden states have width {target_hidden_states.shape[-1]}, but this drafter reads "
                f"{len(self.config.target_layers)} layer(s) {self.config.target_layers} of width "
                f"{self.config.target_hidden_size} = {self.config.feature_size}."
            )
        x = target_hidden_states.to(self.dtype)
        if self.feature_norm is not None:
            x = self.feature_norm(x)
        if self.feature_proj is not None:
            x = self.feature_proj(x)
        return x

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        module = self.get_input_embeddings()
        if module is None:
            raise self._missing_target("input embeddings")
        return module(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """LM head over the draft vocabulary (hidden states after the final norm)."""
        if self.lm_head is not None:
            return self.lm_head(hidden_states)
        head = self._attached.get("lm_head")
        if head is None:
            raise self._missing_target("LM head")
        weight = head.weight
        if not self._identity_vocab() or weight.dtype != hidden_states.dtype:
            weight = self._shared_head_weight(weight, hidden_states.dtype)
        return F.linear(hidden_states, weight)

    def _shared_head_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``d2t`` of a shared target head in ``dtype``; cached while neither tensor changes (gathering or
        casting 8k-49k x 576 per draft step would cost as much as the drafter's own layer)."""
        if torch.is_grad_enabled() and weight.requires_grad:
            return weight.index_select(0, self.d2t.to(weight.device)).to(dtype)
        key = (weight.data_ptr(), weight._version, self.d2t.data_ptr(), self.d2t._version, dtype)
        cached = self._memo.get("head_weight")
        if cached is None or cached[0] != key:
            rows = weight.detach() if self._identity_vocab() else weight.detach().index_select(
                0, self.d2t.to(weight.device))
            cached = self._memo["head_weight"] = (key, rows.to(dtype))
        return cached[1]

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool = False,
        labels: torch.LongTensor | None = None,
        features: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> TreeSpecDrafterOutput:
        r"""One drafter pass.

        Args:
            input_ids: ``[B, T]`` tokens. Position t pairs token ``x_t`` with the feature of position ``t - 1``: for
                a training sequence ``x_0..x_L`` with target hidden states ``h_0..h_L``, pass ``input_ids = x[1:]``
                and ``target_hidden_states = h[:-1]``.
            target_hidden_states: ``[B, T, feature_size]`` raw target features (projected here).
            features: ``[B, T, hidden_size]`` already projected features instead (e.g. mixing
                ``project_features(...)`` rows with fed-back ``hidden_states`` of an earlier pass). Exactly one of
                the two.
            attention_mask: 2D padding mask, or a 4D float mask ``[B, 1, T, past + T]`` (0 / finfo.min) for tree
                attention, used as given.
            position_ids: ``[B, T]``; defaults to ``past_len + arange(T)``. Tree nodes take ``root + depth``.
            cache: the drafter's KV cache (a new ``DynamicCache`` when ``use_cache`` and none is given);
                ``past_key_values=`` is accepted too, the name before transformers 5.24.
            labels: target token ids, shifted inside as in causal LMs (position t is scored on ``labels[t + 1]``);
                -100 and tokens outside the draft vocabulary are ignored.
            logits_to_keep: compute logits for the last ``logits_to_keep`` positions only (0 = all).
        """
        if (target_hidden_states is None) == (features is None):
            raise ValueError("pass exactly one of target_hidden_states= (raw target features) or features= "
                             "(already projected drafter features).")
        if features is None:
            features = self.project_features(target_hidden_states)
        if features.shape[-1] != self.config.hidden_size:
            raise ValueError(f"features must have width hidden_size={self.config.hidden_size}, got "
                             f"{features.shape[-1]}.")
        if tuple(features.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(f"features {tuple(features.shape[:2])} and input_ids {tuple(input_ids.shape)} must "
                             "cover the same [batch, positions].")
        embeds = self.embed(input_ids).to(features.dtype)
        old_name = kwargs.pop("past_key_values", None)  # the name callers used before transformers 5.24
        if old_name is not None:
            if cache is not None:
                raise ValueError("pass the drafter's cache once: cache= (past_key_values= is its old name).")
            cache = old_name
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
            **{CACHE_KWARG: cache},
        )
        position_embeddings = self.rotary_emb(embeds, position_ids=position_ids)
        layer_kwargs = dict(attention_mask=mask, position_ids=position_ids, use_cache=use_cache,
                            position_embeddings=position_embeddings, **{CACHE_KWARG: cache}, **kwargs)
        if self.config.input_mode == "eagle3":
            hidden = self.layers[0](features, embeds, **layer_kwargs)
            rest = self.layers[1:]
        else:
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
            rest = self.layers
        for layer in rest:
            hidden = layer(hidden, **layer_kwargs)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        logits = self.compute_logits(self.norm(kept) if self.norm is not None else kept)
        loss = None
        if labels is not None:
            if logits_to_keep:
                raise ValueError("labels need logits for every position; leave logits_to_keep at 0.")
            targets = self.draft_labels(labels[:, 1:])
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100)
        return TreeSpecDrafterOutput(
            loss=loss, logits=logits, hidden_states=hidden, cache=cache if use_cache else None
        )


AutoConfig.register(TreeSpecDrafterConfig.model_type, TreeSpecDrafterConfig, exist_ok=True)
AutoModel.register(TreeSpecDrafterConfig, TreeSpecDrafterModel, exist_ok=True)
