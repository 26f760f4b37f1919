"""The TreeSpec feature drafter: an EAGLE-style draft head over target hidden states, as a transformers model.

One decoding position of the drafter reads a token and a *feature*: the target's hidden state at the previous
position for committed tokens, or the drafter's own output feature at the parent node for tree nodes. That is what lets
one small decoder layer predict several tokens ahead (EAGLE). Two input layouts, chosen by ``config.input_mode``:

``"fc"`` (default; EAGLE-1 layout)
    ``x = fc([embed(token); feature])`` -> ``LlamaDecoderLayer`` x N -> RMSNorm -> LM head.
``"eagle3"`` (EAGLE-3 layout, exportable as an EAGLE-3 head: see `eagle_io`)
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

The configuration lives in `feature_config.py` (as transformers keeps ``configuration_*`` beside ``modeling_*``).
The classes are registered with ``AutoConfig`` / ``AutoModel`` when ``hf_treespec`` is imported, so
``AutoModel.from_pretrained(path)`` returns a :class:`TreeSpecDrafterModel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, DynamicCache, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from ..compat import CACHE_KWARG

from .feature_config import INPUT_MODES, TreeSpecDrafterConfig  # noqa: F401  (re-exported)


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
        if self.has_identity_vocab():
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.d2t.to(logits.device)] = logits
        return out

    def draft_columns(self) -> torch.Tensor | None:
        """The target ids of the draft vocabulary, sorted (the columns `target_logits` fills), or None for a full
        vocabulary; memoised per d2t."""
        if self.config.draft_vocab_size == self.config.vocab_size:
            return None
        return self._memoised("columns", self._d2t_key(), lambda: self.d2t.sort().values)

    def has_identity_vocab(self) -> bool:
        """Whether draft index i is target id i for every id (full vocabulary, natural order); memoised per d2t."""
        def identity() -> bool:
            full = self.config.draft_vocab_size == self.config.vocab_size
            return full and bool((self.d2t == torch.arange(self.d2t.numel(), device=self.d2t.device)).all())

        return self._memoised("identity", self._d2t_key(), identity)

    def _d2t_key(self) -> tuple:
        return (self.d2t.data_ptr(), self.d2t._version)

    def _memoised(self, name: str, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``, kept in ``_memo`` under ``name`` while ``key`` (the versions of its inputs) holds."""
        cached = self._memo.get(name)
        if cached is None or cached[0] != key:
            cached = self._memo[name] = (key, compute())
        return cached[1]

    # ---------------------------------------------------------------------------------------------------- depth
    @torch.no_grad()
    def add_layers(self, num_hidden_layers: int) -> "TreeSpecDrafterModel":
        """Deepens a trained drafter to ``num_hidden_layers`` decoder layers without changing what it computes.

        The new ``LlamaDecoderLayer`` s start with zero output projections (``o_proj``, ``down_proj``), so each is an
        identity on the residual stream until training moves it: training on from a drafter with more layers starts
        from that drafter's acceptance instead of a random deeper one. Returns ``self``.
        """
        have = self.config.num_hidden_layers
        if num_hidden_layers < have:
            raise ValueError(f"this drafter has {have} decoder layer(s); add_layers cannot remove layers "
                             f"(asked for {num_hidden_layers}).")
        reference = next(self.layers[0].parameters())
        for index in range(have, num_hidden_layers):
            layer = LlamaDecoderLayer(self.config, index)
            layer.apply(self._init_weights)  # the model's own init (normal weights, zero biases, unit norms), then
            layer.self_attn.o_proj.weight.zero_()  # the residual branches' outputs zeroed
            layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer.to(device=reference.device, dtype=reference.dtype))
        self.config.num_hidden_layers = num_hidden_layers
        return self

    # ------------------------------------------------------------------------------------------------ forward
    def project_features(self, target_hidden_states: torch.Tensor, linear=None) -> torch.Tensor:
        """Target hidden states ``[..., feature_size]`` -> drafter features ``[..., hidden_size]``. ``linear(module,
        x)``: how the projection's linear runs (``module(x)`` by default; a compiled drafter hands its few-rows op)."""
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
            x = self.feature_proj(x) if linear is None else linear(self.feature_proj, x)
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
        if torch.compiler.is_compiling():  # no memo to trace (it compares data pointers): the rows are gathered in
            # the graph, where frozen weights fold the gather and the cast into one constant
            return F.linear(hidden_states, weight.index_select(0, self.d2t).to(hidden_states.dtype))
        if not self.has_identity_vocab() or weight.dtype != hidden_states.dtype:
            weight = self._shared_head_weight(weight, hidden_states.dtype)
        return F.linear(hidden_states, weight)

    def _shared_head_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``d2t`` of a shared target head in ``dtype``; cached while neither tensor changes (gathering or
        casting 8k-49k x 576 per draft step would cost as much as the drafter's own layer)."""
        if torch.is_grad_enabled() and weight.requires_grad:
            return weight.index_select(0, self.d2t.to(weight.device)).to(dtype)
        def rows() -> torch.Tensor:
            kept = weight.detach() if self.has_identity_vocab() else weight.detach().index_select(
                0, self.d2t.to(weight.device))
            return kept.to(dtype)

        return self._memoised("head_weight", (weight.data_ptr(), weight._version, *self._d2t_key(), dtype), rows)

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
