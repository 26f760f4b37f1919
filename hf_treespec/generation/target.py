"""`TargetForward`: the target's forwards of one decoding loop (prefill, then steps), eager or compiled.

Both return ``(logits, states)``: the logits of every fed row and the decoder-layer outputs the drafter and policy
read (None when none are read). With a `CompiledForward` the prefill (through the several-rows graph, in chunks)
and every step run through the compiled graphs over a `PreallocatedLayer` cache; else eagerly. A compiled step is
always given an explicit 4D mask, so a draft-free step and a tree step differ only in their row count.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from ..attention import additive_mask, prompt_visibility
from ..compat import CACHE_KWARG
from ..compiled import CompiledForward, compiled_forward_for, preallocate, settings_from_generation_config
from ..compiled.openvino_export import INSTALL_HINT as OPENVINO_INSTALL_HINT
from ..compiled.openvino_export import openvino_installed
from ..compiled.openvino_step import BACKEND as OPENVINO
from ..compiled.openvino_step import OpenVINOStep, openvino_step_for
from ..features import capture_hidden_states

logger = logging.getLogger(__name__)

#: rows a compiled run's cache holds beyond ``generation_config.max_length`` before it must grow (one large tree)
TREE_HEADROOM = 128


def compiled_for_generation(model, cache, generation_config, sliding: bool, batch: int = 1,
                            layers: tuple[int, ...] = ()):
    """The compiled forward a ``generate`` call asks for (``compile_config``; `settings_from_generation_config`),
    with ``cache`` preallocated for it, or the `OpenVINOStep` that ``CompileConfig(backend="openvino")`` asks for
    (capturing decoder layers ``layers``); None: eager. A sliding-window target stays eager (its windows live in
    per-layer-type masks), with a warning, as does a model whose compilation failed (in this call or earlier in this
    process)."""
    device = next(model.parameters()).device
    settings = settings_from_generation_config(generation_config, device)
    if settings is None:
        return None
    if sliding:
        logger.warning("hf_treespec: compile_config is ignored for a sliding-window target (its tree masks are one "
                       "per layer type); decoding with the eager forward.")
        return None
    if settings.backend == OPENVINO:
        return openvino_for_generation(model, settings, device, layers)
    compiled = compiled_forward_for(model, settings)
    compiled.warm_up(batch)  # compiles what this batch shape has not compiled yet, in a fixed order (see warm_up)
    if compiled.failure is not None:
        return None
    preallocate(cache, int(generation_config.max_length or 0) + TREE_HEADROOM)
    return compiled


def openvino_for_generation(model, settings, device, layers: tuple[int, ...]) -> OpenVINOStep | None:
    """The `OpenVINOStep` of ``model``, or None (eager) with a warning that says why: OpenVINO not installed, a
    model not on the CPU, or (warned once, by the engine) an export or compilation that failed."""
    reason = None
    if not openvino_installed():
        reason = f"OpenVINO is not installed ({OPENVINO_INSTALL_HINT})"
    elif torch.device(device).type != "cpu":
        reason = f"the model is on {device}, and the OpenVINO step runs on the CPU"
    if reason is None:  # a failed export or compile warned once, when it failed; later calls decode eagerly
        step = openvino_step_for(model, settings, layers)
        return step if step.failure is None else None
    logger.warning("hf_treespec: compile_config backend %r is not used: %s. Decoding with the eager forward.",
                   OPENVINO, reason)
    return None


class TargetForward:
    """The target ``model``'s forwards over ``cache``, capturing decoder layers ``layers`` (``-1``: the last)."""

    def __init__(self, model, cache, layers: tuple[int, ...], compiled: CompiledForward | None = None):
        self.model = model
        self.cache = cache
        self.layers = tuple(layers)
        self.compiled = compiled

    @property
    def explicit_masks(self) -> bool:
        """Whether every step must pass its 4D mask (compiled steps do: one graph for every step of a row count)."""
        return self.compiled is not None and self.compiled.failure is None

    @property
    def engine(self) -> OpenVINOStep | None:
        """The engine that holds the target's cache (the OpenVINO step), or None (the cache is ``self.cache``)."""
        return self.compiled if isinstance(self.compiled, OpenVINOStep) else None

    def prefill(self, **inputs) -> tuple[torch.Tensor, object]:
        """The prompt forward (``inputs``: what the model takes besides the cache): eager, or the engine's first
        forward of new sequences (a left-padded prompt's padding sees only itself and is seen by nothing)."""
        engine = self.engine
        if engine is None:
            if self.explicit_masks:  # the compiled graphs, where they can take it
                compiled = self.compiled.prefill(inputs["input_ids"], inputs["position_ids"],
                                                 inputs.get("attention_mask"), self.cache, self.layers)
                if compiled is not None:
                    return compiled
            return self._eager(inputs)
        ids = inputs["input_ids"].cpu()
        batch, length = ids.shape
        engine.reset(batch)
        visible = prompt_visibility(inputs.get("attention_mask"), batch, length, "cpu")
        positions = inputs.get("position_ids")
        positions = torch.arange(length)[None].expand(batch, -1) if positions is None else positions.cpu()
        logits = engine(ids, positions, additive_mask(visible, torch.float32)[:, None], last_only=True)
        return logits, engine.states(self.layers)

    def step(self, input_ids, position_ids, attention_mask=None) -> tuple[torch.Tensor, object]:
        """One step's forward: ``input_ids`` / ``position_ids`` ``[B, q]``, ``attention_mask`` 4D (or None: causal,
        eager only)."""
        if not self.explicit_masks:
            inputs = {"input_ids": input_ids, "position_ids": position_ids}
            if attention_mask is not None:
                inputs["attention_mask"] = attention_mask
            return self._eager(inputs)
        if self.engine is not None:
            return self.engine(input_ids, position_ids, attention_mask), self.engine.states(self.layers)
        logits = self.compiled(input_ids, position_ids, attention_mask, self.cache)
        return logits, self.compiled.states(self.layers)

    def _eager(self, inputs: dict) -> tuple[torch.Tensor, object]:
        if self.compiled is not None:  # its hooks capture every layer, eager forwards included
            self.compiled.clear()
            out = self.model(**inputs, use_cache=True, **{CACHE_KWARG: self.cache})
            return out.logits, self.compiled.states(self.layers)
        capture = capture_hidden_states(self.model, self.layers) if self.layers else nullcontext(None)
        with capture as states:
            out = self.model(**inputs, use_cache=True, **{CACHE_KWARG: self.cache})
        return out.logits, states
