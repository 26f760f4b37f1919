"""Configuration of the TreeSpec feature drafter (:class:`~.feature.TreeSpecDrafterModel`): its geometry, which target
layers it reads, its input layout and draft vocabulary, and the fields it copies from a target's config."""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

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
