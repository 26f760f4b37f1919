"""EAGLE checkpoints in and out: import public EAGLE-1 / EAGLE-3 draft heads into :class:`TreeSpecDrafterModel`, and
export ours to the EAGLE-3 layout (the one vLLM and SGLang read; tested here against speculators' converter and
model, not in those servers).

What is supported, precisely:

EAGLE-1 (SafeAILab ``cnets1``): ``config.json`` with Llama fields; weights ``fc.weight`` ``[H, 2H]`` (+ ``fc.bias``),
    ``layers.{i}.*`` Llama decoder layers where layer 0 has no ``input_layernorm``, optional ``embed_tokens.weight``.
    EAGLE-1 reads the target's *post*-final-norm last hidden state and scores its output with the target's LM head
    directly (no drafter norm). Imported as ``input_mode="fc"``, ``target_layers=[-1]``, a feature RMSNorm holding a
    copy of the target's final-norm weights (pre-norm capture -> post-norm feature, exactly), ``final_norm=False`` and
    the target's LM head shared. The target model is therefore required to import one.
EAGLE-3 (SafeAILab ``traineagle3``; vLLM ``Eagle3LlamaForCausalLM``; SGLang ``LlamaForCausalLMEagle3``):
    ``fc.weight`` ``[H, 3 * H_target]`` (no bias), ``midlayer.*`` (q/k/v over ``2H``, ``hidden_norm``,
    ``input_layernorm``, ``post_attention_layernorm``, MLP), ``norm.weight``, ``lm_head.weight``
    ``[draft_vocab_size, H]``, ``d2t`` (offsets: target id = i + d2t[i]), ``t2d`` (bool over the target vocabulary),
    optional ``embed_tokens.weight``. One decoder layer only (SGLang and vLLM disagree on how further layers are
    normalised). Imported as ``input_mode="eagle3"`` with ``fc`` as the feature projection and no feature norm.
    Target layers: ``eagle_aux_hidden_state_layer_ids`` from the config when present, else EAGLE-3's default for
    the target's depth. Those ids count the *inputs* of decoder layers (id j = output of layer j - 1, 0 = the
    embeddings), whereas our ``target_layers`` are layer outputs, so ours = ids - 1.
Export (``to_eagle3``): drafters with ``input_mode="eagle3"``, one layer and a final norm; a shared target LM head is
    written out as its draft-vocabulary rows; shared embeddings are left out (both servers then use the target's).
    ``-1`` (pre-norm final state) has no EAGLE-3 aux-layer id and is refused. A feature norm (an RMSNorm over the
    concatenated target states before ``fc``, our default: SmolLM2's states have outlier dimensions) is written as
    the ``norm_before_fc`` extension of the EAGLE-3 layout (config ``norm_before_fc: true``), which speculators'
    ``Eagle3DraftModel`` reads. Its weight is folded into ``fc`` (``fc(g * x / rms(x)) = (fc * g)(x / rms(x))``), so
    ``input_norm.weight`` is all ones and a converter that drops it (speculators 0.9.0's does) loses nothing; a loader
    of the plain layout that ignores the flag would run the head without its norm (still lossless, fewer accepted
    tokens). Imports read the same extension back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from ..features import final_norm as target_final_norm
from .feature import TreeSpecDrafterConfig, TreeSpecDrafterModel, vocab_mask

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"

# Llama config fields carried over from an EAGLE config.json (anything else there is EAGLE bookkeeping).
_LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "mlp_bias", "pad_token_id", "bos_token_id", "eos_token_id",
)


# ------------------------------------------------------------------------------------------------------ reading
def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config dict, state dict)`` of an EAGLE checkpoint folder (``*.safetensors`` or ``pytorch_model*.bin``)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; point at a downloaded EAGLE checkpoint folder.")
    config = json.loads(config_file.read_text())
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        for file in files:
            state.update(load_file(str(file)))
    else:
        files = sorted(path.glob("pytorch_model*.bin"))
        for file in files:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors or pytorch_model*.bin weights.")
    return config, state


def eagle_version(state_dict: dict[str, torch.Tensor]) -> int:
    """1 or 3, from the weight names (EAGLE-3 has a ``midlayer``; EAGLE-1 ``layers.N`` behind an ``fc``)."""
    if any(key.startswith("midlayer.") for key in state_dict):
        return 3
    if "fc.weight" in state_dict and any(key.startswith("layers.") for key in state_dict):
        return 1
    raise ValueError(
        "not an EAGLE checkpoint: expected EAGLE-3 weights (midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, "
        "t2d) or EAGLE-1 weights (fc.weight, layers.N.*)."
    )


def eagle3_default_target_layers(num_target_layers: int) -> list[int]:
    """EAGLE-3's default low / mid / high capture for a target of that depth, in our layer-output convention.

    EAGLE-3 and vLLM read the inputs of layers (2, L // 2, L - 3), i.e. the outputs of layers (1, L // 2 - 1, L - 4).
    """
    layers = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    if num_target_layers < 6 or len(set(layers)) != 3:
        raise ValueError(f"EAGLE-3's default target layers need a target of at least 6 layers, got "
                         f"{num_target_layers}; pass target_layers= explicitly.")
    return layers


def _aux_layer_ids(config: dict[str, Any]) -> list[int] | None:
    eagle_config = config.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def _llama_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in _LLAMA_FIELDS if config.get(key) is not None}


def _load_into(model: TreeSpecDrafterModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load with one readable error listing every missing / unexpected / mis-shaped tensor."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
              for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"cannot load this {source} checkpoint into a TreeSpecDrafterModel: missing {missing}, "
                         f"unexpected {unexpected}, shape mismatches {shapes}.")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def _layer_count(state: dict[str, torch.Tensor], prefix: str) -> int:
    found = {int(m.group(1)) for key in state if (m := re.match(rf"{re.escape(prefix)}(\d+)\.", key))}
    if found != set(range(len(found))) or not found:
        raise ValueError(f"decoder layers {sorted(found)} under {prefix!r} are not numbered 0..N-1.")
    return len(found)


# ------------------------------------------------------------------------------------------------- importers
def _import_eagle1(config, state, target, target_layers, dtype) -> TreeSpecDrafterModel:
    if target is None:
        raise ValueError("an EAGLE-1 head reads the target's post-norm hidden state and uses the target's LM head: "
                         "pass target_model= to from_eagle.")
    if target_layers not in (None, [-1], (-1,)):
        raise ValueError(f"EAGLE-1 reads the last target layer only (target_layers=[-1]), got {target_layers}.")
    hidden = state["fc.weight"].shape[0]
    if tuple(state["fc.weight"].shape) != (hidden, 2 * hidden):
        raise ValueError(f"EAGLE-1 fc.weight must be [H, 2H], got {tuple(state['fc.weight'].shape)}.")
    final_norm = target_final_norm(target)
    eps = getattr(final_norm, "variance_epsilon", getattr(final_norm, "eps", None))
    drafter_config = TreeSpecDrafterConfig(
        **_llama_fields(config),
        num_hidden_layers=_layer_count(state, "layers."),
        target_layers=[-1],
        target_hidden_size=hidden,
        input_mode="fc",
        feature_norm=True,
        feature_norm_eps=eps,
        feature_projection=False,
        fc_bias="fc.bias" in state,
        first_layer_input_norm="layers.0.input_layernorm.weight" in state,
        final_norm=False,
        share_target_embeddings="embed_tokens.weight" not in state,
        share_target_lm_head=True,
    )
    model = TreeSpecDrafterModel(drafter_config)
    ours = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    ours["feature_norm.weight"] = final_norm.weight.detach().float().cpu()
    ours["d2t"], ours["t2d"] = model.d2t.clone(), model.t2d.clone()
    _load_into(model, ours, "EAGLE-1")
    model.tie_to_target(target)
    return model.to(dtype) if dtype is not None else model


def _import_eagle3(config, state, target, target_layers, dtype) -> TreeSpecDrafterModel:
    if "fc.bias" in state:
        raise ValueError("EAGLE-3 checkpoints with an fc bias are not supported (vLLM loads fc without one).")
    extra_layers = sorted({k.split(".")[0] for k in state if k.startswith(("layers.", "midlayers.", "additional"))})
    if extra_layers or int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError("only single-layer EAGLE-3 heads (one midlayer) are supported.")
    hidden = int(config["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    if target_layers is None:
        ids = _aux_layer_ids(config)
        if ids is not None:
            if min(ids) < 1:
                raise ValueError(f"aux layer id 0 (the target's embeddings) cannot be captured; got ids {ids}.")
            target_layers = [i - 1 for i in ids]
        elif target is not None:
            target_layers = eagle3_default_target_layers(target.config.get_text_config().num_hidden_layers)
        else:
            raise ValueError("this EAGLE-3 config names no eagle_aux_hidden_state_layer_ids: pass target_model= (to "
                             "use EAGLE-3's default layers for its depth) or target_layers=.")
    target_layers = [int(i) for i in target_layers]
    fc = state.get("fc.weight")
    feature_size = fc.shape[1] if fc is not None else hidden
    if feature_size != len(target_layers) * target_hidden:
        raise ValueError(f"fc.weight reads {feature_size} features, but {len(target_layers)} target layer(s) of width "
                         f"{target_hidden} make {len(target_layers) * target_hidden}.")
    vocab = int(config["vocab_size"])
    head = state.get("lm_head.weight")
    draft_vocab = int(config.get("draft_vocab_size") or (head.shape[0] if head is not None else vocab))
    drafter_config = TreeSpecDrafterConfig(
        **_llama_fields(config),
        num_hidden_layers=1,
        target_layers=target_layers,
        target_hidden_size=target_hidden,
        draft_vocab_size=draft_vocab,
        input_mode="eagle3",
        feature_norm="input_norm.weight" in state,  # the norm_before_fc extension (speculators' gpt-oss heads)
        feature_projection=fc is not None,
        final_norm=True,
        share_target_embeddings="embed_tokens.weight" not in state,
        share_target_lm_head=head is None,
    )
    model = TreeSpecDrafterModel(drafter_config)
    ours: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in ("d2t", "t2d") or key.endswith("rotary_emb.inv_freq"):
            continue
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer."):]
        elif key == "fc.weight":
            key = "feature_proj.weight"
        elif key == "input_norm.weight":
            key = "feature_norm.weight"
        ours[key] = value
    if "d2t" in state:
        d2t = state["d2t"].long() + torch.arange(state["d2t"].numel())
    elif draft_vocab == vocab:
        d2t = torch.arange(vocab)
    else:
        raise ValueError("a reduced draft vocabulary needs the d2t map in the checkpoint.")
    if d2t.numel() != draft_vocab:
        raise ValueError(f"d2t has {d2t.numel()} entries for draft_vocab_size={draft_vocab}.")
    t2d = vocab_mask(d2t, vocab)
    if "t2d" in state and not torch.equal(state["t2d"].bool(), t2d):
        raise ValueError("the checkpoint's t2d does not mark exactly the target ids listed by d2t.")
    ours["d2t"], ours["t2d"] = d2t, t2d
    _load_into(model, ours, "EAGLE-3")
    if target is not None and (drafter_config.share_target_embeddings or drafter_config.share_target_lm_head):
        model.tie_to_target(target)
    return model.to(dtype) if dtype is not None else model


_IMPORTERS: dict[int, Callable[..., TreeSpecDrafterModel]] = {1: _import_eagle1, 3: _import_eagle3}


def from_eagle(
    path: str | Path | None = None,
    *,
    config: dict[str, Any] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    target_model: torch.nn.Module | None = None,
    target_layers: list[int] | None = None,
    dtype: torch.dtype | None = None,
) -> TreeSpecDrafterModel:
    """Imports an EAGLE-1 or EAGLE-3 draft head (a downloaded folder, or ``config`` + ``state_dict``).

    ``target_model`` is required for EAGLE-1 and for heads that lack their embeddings / LM head (it is attached with
    ``tie_to_target``); ``target_layers`` overrides the layers an EAGLE-3 head reads. The result behaves like any
    TreeSpec drafter: ``save_pretrained``, ``generate(..., assistant_model=drafter, tree_policy=...)``.
    """
    if (path is None) == (config is None or state_dict is None):
        raise ValueError("pass either path= (a checkpoint folder) or both config= and state_dict=.")
    if path is not None:
        config, state_dict = read_checkpoint(path)
    return _IMPORTERS[eagle_version(state_dict)](config, state_dict, target_model, target_layers, dtype)


# ----------------------------------------------------------------------------------------------------- export
def _export_problems(config: TreeSpecDrafterConfig) -> list[str]:
    problems = []
    if config.input_mode != "eagle3":
        problems.append("input_mode must be 'eagle3' (the 'fc' layout has no EAGLE-3 equivalent)")
    if config.feature_norm and config.feature_norm_eps != config.rms_norm_eps:
        problems.append(f"the feature norm's eps ({config.feature_norm_eps}) must equal rms_norm_eps "
                        f"({config.rms_norm_eps}): norm_before_fc uses the layer's eps")
    if config.num_hidden_layers != 1:
        problems.append("exactly one decoder layer is supported")
    if not config.final_norm:
        problems.append("final_norm must be True")
    if -1 in config.target_layers:
        problems.append("target layer -1 (pre-norm final state) has no EAGLE-3 aux-layer id; use layer outputs")
    return problems


def eagle3_config(model: TreeSpecDrafterModel, target_num_layers: int | None = None) -> dict[str, Any]:
    """The ``config.json`` vLLM / SGLang expect for an EAGLE-3 head (``LlamaForCausalLMEagle3``)."""
    config = model.config
    layers = list(config.target_layers)
    if any(i < 0 for i in layers):
        if target_num_layers is None:
            raise ValueError(f"negative target layers {layers} need target_num_layers= to become aux-layer ids.")
        layers = [i % target_num_layers for i in layers]
    ids = [i + 1 for i in layers]
    rope = dict(config.rope_parameters or {})
    rope_theta = rope.pop("rope_theta", 10000.0)
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
    aux = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": bool(config.feature_projection)}
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "bias": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": str(model.dtype).removeprefix("torch."),
        "eagle_config": aux,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_fc": bool(config.feature_norm),
    }


def eagle3_state_dict(model: TreeSpecDrafterModel) -> dict[str, torch.Tensor]:
    """Our weights under the EAGLE-3 names (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` offsets, ``t2d``)."""
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key in ("d2t", "t2d"):
            continue
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        elif key == "feature_proj.weight":
            key = "fc.weight"
        elif key == "feature_norm.weight":
            key, value = "input_norm.weight", torch.ones_like(value)  # norm_before_fc; its weight goes into fc
        state[key] = value.detach().cpu().contiguous()
    if model.feature_norm is not None:
        gain = model.feature_norm.weight.detach().float().cpu()
        state["fc.weight"] = (state["fc.weight"].float() * gain[None, :]).to(state["fc.weight"].dtype).contiguous()
    if "lm_head.weight" not in state:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError("this drafter shares the target's LM head: call drafter.tie_to_target(target) before "
                             "exporting, so the draft-vocabulary rows can be written.")
        rows = head.weight.detach().index_select(0, model.d2t.to(head.weight.device))
        state["lm_head.weight"] = rows.to(model.dtype).cpu().contiguous()
    d2t = model.d2t.detach().cpu().long()
    state["d2t"] = d2t - torch.arange(d2t.numel())
    state["t2d"] = model.t2d.detach().cpu().bool()
    return state


def to_eagle3(
    model: TreeSpecDrafterModel, save_directory: str | Path, *, target_num_layers: int | None = None
) -> Path:
    """Writes ``config.json`` + ``model.safetensors`` in the EAGLE-3 layout vLLM and SGLang load; returns the folder."""
    problems = _export_problems(model.config)
    if problems:
        raise ValueError("this drafter cannot be written as an EAGLE-3 head: " + "; ".join(problems) + ".")
    config = eagle3_config(model, target_num_layers)
    state = eagle3_state_dict(model)
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
