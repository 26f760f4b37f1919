"""`OpenVINOStep`: the target's forward run by OpenVINO's CPU runtime, its KV cache kept in place inside the engine.

``compile_config=CompileConfig(backend="openvino")`` selects it. Why an engine of its own rather than a
``torch.compile`` backend: OpenVINO's fast decoding keeps the KV cache inside the compiled model (a *stateful* model:
each forward appends its rows to the cache, and the attention reads it where it lies), which a graph that takes the
cache as an input cannot do (it copies the whole cache in every step). What this module does:

- converts ``model`` once per machine (`ov.convert_model` over a wrapper that takes ``input_ids``, ``position_ids``, a
  4D additive mask and the past KV, and returns the logits, the new KV and the outputs of the decoder layers a
  drafter reads), makes it stateful (past KV inputs tied to the new KV outputs), and saves the IR under
  ``<cache>/openvino-steps/<key>``; the key covers the weights, the config, the captured layers and the versions of
  torch, transformers and OpenVINO. A later process reads the IR and compiles it for this CPU in seconds.
- takes every step's mask explicitly, over every row the engine's cache holds: a tree step appends all its rows, and
  the rows the verifier rejects stay in the cache, masked out of every later step (`hf_treespec.kv.stateful_kv`),
  until they outnumber the live rows and one copy drops them (`compact`).

A batch rides on the same engine: its cache holds every sequence of the batch, all with the same number of rows
(each step appends the widest tree's row count to every sequence; a smaller tree's padding rows are dead at once,
and so is a left-padded prompt's padding). A sequence that finishes stays in the engine until the batch ends (its
rows are the cache handed back), fed dead padding rows: removing it would copy its rows out first. Eager decoding is
the fallback, with a warning, where OpenVINO is not installed, or where the conversion fails
(`hf_treespec.generation.target`).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..features import CapturedStates, decoder_layers
from .failures import failure_reason
from .forward import CompileSettings
from .openvino_export import (
    IR_FILE, cached_ir, compile_ir, export_key, fp32_copy, from_numpy_as, half_output, to_torch,
)

logger = logging.getLogger(__name__)

#: the ``CompileConfig.backend`` name that selects this engine
BACKEND = "openvino"
#: where a model instance keeps its engines (one per captured-layer tuple)
_STORE = "_treespec_openvino_steps"


def _layer_outputs(model: torch.nn.Module, layers: tuple[int, ...]) -> list[int]:
    count = len(decoder_layers(model))
    return [layer % count for layer in layers]


class _StepGraph(torch.nn.Module):
    """What is converted: one forward over a cache given as tensors, returning the logits, each layer's new KV and
    the captured decoder-layer outputs (hooks registered for the trace only)."""

    def __init__(self, model: torch.nn.Module, layers: list[int]):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, position_ids, attention_mask, logit_rows, past):
        from transformers import DynamicCache

        from ..compat import CACHE_KWARG

        cache = DynamicCache(config=self.model.config)
        for layer, (keys, values) in zip(cache.layers, past):
            # filled directly: ``cache.update`` would not trace to a cache input
            layer.keys, layer.values, layer.dtype, layer.device = keys, values, keys.dtype, keys.device
            layer.is_initialized = True
        captured: dict[int, torch.Tensor] = {}
        blocks = decoder_layers(self.model)

        def store(module, args, output, layer: int) -> None:
            captured[layer] = output[0] if isinstance(output, tuple) else output

        hooks = [blocks[i].register_forward_hook(partial(store, layer=i)) for i in set(self.layers)]
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             logits_to_keep=logit_rows, use_cache=True, **{CACHE_KWARG: cache})
        finally:
            for hook in hooks:
                hook.remove()
        present = tuple((layer.keys, layer.values) for layer in cache.layers)
        return out.logits, tuple(captured[i] for i in self.layers), present


def _export(model: torch.nn.Module, layers: list[int], folder: Path) -> None:
    """Converts ``model`` (an fp32 copy: OpenVINO chooses its own inference precision) and saves the stateful IR."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    config = model.config.get_text_config()
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    count = len(decoder_layers(model))
    past_len, rows = 5, 3
    example = {
        "input_ids": torch.zeros(1, rows, dtype=torch.long),
        "position_ids": torch.arange(past_len, past_len + rows)[None],
        "attention_mask": torch.zeros(1, 1, rows, past_len + rows),
        "logit_rows": torch.arange(rows),
        "past": tuple((torch.randn(1, kv_heads, past_len, head_dim), torch.randn(1, kv_heads, past_len, head_dim))
                      for _ in range(count)),
    }
    fp32 = fp32_copy(model)
    with torch.no_grad():
        converted = ov.convert_model(_StepGraph(fp32, layers), example_input=example)
    del fp32
    inputs, outputs = converted.inputs, converted.outputs
    for i in range(count):
        for j, kind in enumerate(("key", "value")):
            inputs[4 + 2 * i + j].get_tensor().set_names({f"past_{kind}_{i}"})
            outputs[1 + len(layers) + 2 * i + j].get_tensor().set_names({f"present_{kind}_{i}"})
    outputs[0].get_tensor().set_names({"logits"})
    for slot in range(len(layers)):
        outputs[1 + slot].get_tensor().set_names({f"layer_{slot}"})
        half_output(outputs[1 + slot].get_node(), model.dtype)  # captured layers leave in the model's dtype
    apply_make_stateful_transformation(
        converted, {f"past_{kind}_{i}": f"present_{kind}_{i}" for i in range(count) for kind in ("key", "value")})
    # an empty cache of the batch's size to start from, and a beam index on every cache read: the CPU runtime
    # fuses this pattern (cache read, gather, concat, attention) into attention over the cache in place
    batch = ops.gather(ops.shape_of(converted.input("input_ids"), output_type="i64"),
                       ops.constant(np.array([0], np.int64)), ops.constant(np.int64(0)))
    beam = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    converted.add_parameters([beam])
    for op in converted.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        shape = ops.concat([batch, ops.constant(np.array([kv_heads, 0, head_dim], np.int64))], 0)
        op.set_arguments([ops.broadcast(ops.constant(np.float32(0)), shape)])
        readers = list(op.output(0).get_target_inputs())
        gathered = ops.gather(op.output(0), beam.output(0), ops.constant(np.int64(0)))
        for reader in readers:
            reader.replace_source_output(gathered.output(0))
    converted.validate_nodes_and_infer_types()
    folder.mkdir(parents=True, exist_ok=True)
    ov.save_model(converted, folder / IR_FILE, compress_to_fp16=False)


@dataclass(eq=False)
class OpenVINOStep:
    """The target's forwards through OpenVINO for a batch of sequences, their KV cache inside the engine.

    ``__call__`` appends a step's rows to the cache and returns their logits; `states` reads the captured layers.
    Attributes mirror `hf_treespec.compiled.CompiledForward`'s: ``failure`` (why the engine is not used) and
    ``compile_seconds``.
    """

    model: torch.nn.Module
    settings: object
    layers: tuple[int, ...] = ()
    failure: str | None = None
    compile_seconds: dict[str, float] = field(default_factory=dict)
    #: the engine holds the target's KV cache itself: the loop feeds it masks over the rows it holds
    owns_cache = True
    #: the forward runs on OpenVINO's own threads: draft-free steps leave them the cores (`HostThreads`)
    own_threads = True

    def __post_init__(self) -> None:
        self._request = None
        #: returned caches whose rows are still in the engine (weakly held: a cache nobody holds is never copied)
        self.pending_copies: weakref.WeakSet = weakref.WeakSet()
        self._parts: list[torch.Tensor | None] = [None] * len(self.layers)
        self.held = 0  # rows in the engine's cache, the same for every sequence
        self.sequences = 1  # sequences in the engine's cache (the batch of its prefill)
        self.active = torch.arange(1)  # the sequences still decoding, in the caller's row order
        try:
            self._compile()
        except Exception as error:  # any export or compile failure: the loop decodes eagerly
            self.failure = failure_reason(error)
            logger.warning("hf_treespec: the OpenVINO target step is not available (%s); decoding with the eager "
                           "forward instead.", self.failure)

    def _compile(self) -> None:
        layers = _layer_outputs(self.model, self.layers)
        key = export_key(self.model, "stateful target step", layers=layers)
        folder, exported = cached_ir(key, lambda out: _export(self.model, layers, out), "target's forward")
        if exported is not None:
            self.compile_seconds["export"] = exported
        start = time.perf_counter()
        self._request = compile_ir(folder, self.model.dtype).create_infer_request()
        self.compile_seconds["compile"] = time.perf_counter() - start
        self.folder = folder

    def _copy_out_pending(self) -> None:
        """Copies out the rows a returned cache still waits for (`hf_treespec.kv.stateful_kv.EngineRows`), before
        the engine's cache changes under it."""
        for pending in list(self.pending_copies):
            pending.load()

    def reset(self, sequences: int = 1) -> None:
        """Empties the engine's cache for ``sequences`` new sequences (a batch's prefill comes next)."""
        self._copy_out_pending()
        self._request.reset_state()
        self.held, self.sequences = 0, sequences
        self.active = torch.arange(sequences)

    def retire(self, keep: torch.Tensor) -> None:
        """The active sequences not in ``keep`` (bool, one per active sequence) are done: later forwards feed them
        dead rows and return nothing for them; their rows stay until the next `reset`."""
        self.active = self.active[keep]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 last_only: bool = False) -> torch.Tensor:
        """One forward of ``input_ids`` ``[B, q]`` (B: the active sequences) at ``position_ids``;
        ``attention_mask`` ``[B, 1, q, held + q]`` (additive) covers every row the cache holds, then the new ones.
        Returns the logits ``[B, q, V]`` (``[B, 1, V]``, the last row's, with ``last_only``: a prompt's)."""
        batch, rows = input_ids.shape
        if batch != len(self.active) or tuple(attention_mask.shape) != (batch, 1, rows, self.held + rows):
            raise ValueError(f"this OpenVINO step takes the {len(self.active)} active sequences and a mask "
                             f"[{len(self.active)}, 1, {rows}, {self.held + rows}] over the {self.held} held rows and "
                             f"the {rows} new ones; got input_ids {tuple(input_ids.shape)}, mask "
                             f"{tuple(attention_mask.shape)}.")
        finished = batch < self.sequences
        if finished:  # the finished sequences' slots: dead rows that see only themselves
            input_ids, position_ids, attention_mask = self._with_finished(input_ids, position_ids, attention_mask)
        request = self._request
        request.infer({"input_ids": input_ids.numpy(), "position_ids": position_ids.numpy(),
                       "attention_mask": attention_mask.float().numpy(),
                       "beam_idx": np.arange(self.sequences, dtype=np.int32),
                       "logit_rows": np.arange(rows - 1 if last_only else 0, rows, dtype=np.int64)})
        self.held += rows
        # the output buffers are reused by the next inference: copied out
        active = self.active if finished else slice(None)
        for slot in range(len(self.layers)):
            self._parts[slot] = to_torch(request.get_tensor(f"layer_{slot}"))[active]
        return to_torch(request.get_tensor("logits"))[active]

    def _with_finished(self, input_ids, position_ids, attention_mask):
        rows = input_ids.shape[1]
        ids = input_ids.new_zeros(self.sequences, rows)
        positions = position_ids.new_zeros(self.sequences, rows)
        mask = attention_mask.new_full((self.sequences, 1, rows, self.held + rows), torch.finfo(torch.float32).min)
        mask[:, 0, :, self.held:].diagonal(dim1=-2, dim2=-1).fill_(0)
        ids[self.active], positions[self.active], mask[self.active] = input_ids, position_ids, attention_mask
        return ids, positions, mask

    def states(self, layers: tuple[int, ...]) -> CapturedStates | None:
        """The captured decoder-layer outputs of the last forward (``layers`` must be the engine's)."""
        if not layers:
            return None
        if tuple(layers) != self.layers:
            raise ValueError(f"this OpenVINO step captures layers {self.layers}, not {tuple(layers)}.")
        states = CapturedStates(len(layers))
        states.parts = list(self._parts)
        return states

    def _caches(self):
        """Each layer's ``(key, value)`` OpenVINO state, in layer order."""
        # the stateful transformation names each cache after its input and output: past_key_3present_key_3
        states = {state.name: state for state in self._request.query_state()}
        return [tuple(states[f"past_{kind}_{i}present_{kind}_{i}"] for kind in ("key", "value"))
                for i in range(len(states) // 2)]

    def cache_rows(self, keep: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(keys, values)`` at the held rows ``keep``, in the model's dtype: the cache as plain
        decoding leaves it. ``keep``: indices, the same for every sequence, or ``[sequences, width]`` per sequence,
        ``-1`` where a shorter sequence has a hole (zeros come back there)."""
        return [tuple(_rows(to_torch(state.state), keep).to(self.model.dtype) for state in pair)
                for pair in self._caches()]

    def compact(self, keep: torch.Tensor) -> None:
        """Keeps only the held rows ``keep`` (as in `cache_rows`; in order) in the engine's cache: one copy of the
        cache, so that rejected rows stop costing attention (wide trees leave many)."""
        self._copy_out_pending()
        for pair in self._caches():
            for state in pair:
                current = state.state
                data = current.data  # gathered as integers of the element's width: bf16 has no numpy type
                rows = _rows(torch.from_numpy(data.view(f"i{data.itemsize}")), keep).numpy().view(data.dtype)
                state.state = from_numpy_as(np.ascontiguousarray(rows), current.element_type)
        self.held = int(keep.shape[-1])


def _rows(cache: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``cache`` ``[S, H, held, D]`` at rows ``keep`` (see `OpenVINOStep.cache_rows`)."""
    if keep.dim() == 1:
        return cache[:, :, keep]
    index = keep.clamp(min=0)[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[-1])
    return cache.gather(2, index).masked_fill((keep < 0)[:, None, :, None], 0)


def openvino_step_for(model: torch.nn.Module, settings, layers: tuple[int, ...]) -> OpenVINOStep:
    """The `OpenVINOStep` of ``model`` capturing ``layers``, kept on the model instance (one export and compile
    per process at most)."""
    store = model.__dict__.setdefault(_STORE, {})
    if tuple(layers) not in store:
        store[tuple(layers)] = OpenVINOStep(model, settings or CompileSettings(backend=BACKEND), tuple(layers))
    return store[tuple(layers)]
