"""Compile once per machine: a `CompiledForward`'s graphs exported by ``torch.export`` and compiled ahead of time by
AOTInductor into package files under ``<compiled cache>/compiled-steps/<key>/``, loaded by every later process.

Why: inductor's own cross-process cache skips graphs whose frozen weights are oneDNN-packed, so ``torch.compile``
spent 4-5 minutes in every process on the three graphs of the 135M target (2-core EPYC). A package holds the
compiled code and the frozen weights of one graph; loading it takes about a second, and its calls skip dynamo (no
guards, no cache lookup). The key covers the weights, config and dtype, the library versions, this CPU, the thread
count (autotuning chose kernels for it), the compile options, the graph and the package's own source.

What is exported: one step of the `CompiledForward` over KV buffers given as tensors and written in place at the
step's slots (`PreallocatedLayer`), returning the forward's output and the decoder layers' outputs its hooks
capture; the dimensions that vary between steps are dynamic, as ``torch.compile`` marks them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .disk_cache import cached_artifact, discard, model_key
from .preallocated import PreallocatedLayer, WriteSlots

logger = logging.getLogger(__name__)

#: the cache folder of these packages, and the package file in each
KIND = "compiled-steps"
PACKAGE_FILE = "step.pt2"


def _source_digest() -> str:
    """A digest of the package's Python source: the exported graph is what this code traces."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def package_key(compiled, graph: str) -> dict:
    """What the package of ``compiled``'s graph ``graph`` is valid for."""
    from ..cost.hardware import cpu_info

    name, flags = cpu_info()
    return model_key(
        compiled.model, f"{compiled.role} step", graph=graph, options=compiled.settings.describe(),
        attention=str(getattr(compiled.model.config, "_attn_implementation", "")),
        few_rows_linear=compiled.linears is not None, source=_source_digest(),
        cpu=name, cpu_flags=" ".join(flags), machine=platform.machine(), threads=torch.get_num_threads(),
        isa_cap=os.environ.get("ATEN_CPU_CAPABILITY", ""),
    )


def buffers_as_cache(config, slots: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A ``DynamicCache`` of `PreallocatedLayer` s over the given buffers, writing a step's rows at ``slots``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    write = WriteSlots()
    write.index = slots
    for index, (key_buffer, value_buffer) in enumerate(zip(keys, values)):
        layer = PreallocatedLayer(key_buffer.shape[2], write)
        layer.key_buffer, layer.value_buffer = key_buffer, value_buffer
        layer.view_rows(0)
        layer.is_initialized = True
        cache.layers[index] = layer
    return cache


class _ExportedStep(nn.Module):
    """One step of a `CompiledForward` over its cache given as buffers: ``(output, captured layer outputs)``."""

    def __init__(self, compiled):
        super().__init__()
        self.model = compiled.model
        self._compiled = (compiled,)  # not a submodule: its model is the one above

    def forward(self, input_ids, position_ids, mask, slots, keys, values, extra):
        compiled = self._compiled[0]
        if compiled.lean:  # lean attention reads the mask's rows, fewer than the buffer holds (`reserve`)
            torch._check(mask.shape[-1] < keys[0].shape[2])
        cache = buffers_as_cache(self.model.config, slots, keys, values)
        compiled.clear()
        out = compiled._forward(input_ids, position_ids, mask, cache, **extra)
        return out, tuple(compiled._parts)


def _step_inputs(input_ids, position_ids, mask, cache, extra: dict) -> tuple:
    layers = cache.layers
    return (input_ids, position_ids, mask, layers[0].slots.index, [layer.key_buffer for layer in layers],
            [layer.value_buffer for layer in layers], extra)


#: the dimensions of a step's inputs that vary between steps: batch and rows of its tokens and positions (and of an
#: extra input ``[batch, rows, ...]``: a drafter's features), batch, rows and length of its 4D mask, the slots it
#: writes, batch and capacity of the KV buffers; a symbolic head count or head size would cost the kernels their
#: fixed shapes
TOKEN_DIMS, MASK_DIMS, SLOT_DIMS, BUFFER_DIMS = (0, 1), (0, 2, 3), (0,), (0, 2)


def varying_dims(inputs: tuple) -> tuple:
    """Per input of a step (`_step_inputs`' structure), the dimensions that vary between steps, sizes of 1 left out
    (torch specialises them). ``torch.compile``'s marks (`forward._mark_varying`) and export's dynamic shapes both
    come from here."""
    input_ids, position_ids, mask, slots, keys, values, extra = inputs

    def varying(tensor: torch.Tensor, dims: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(dim for dim in dims if tensor.shape[dim] > 1)

    return (varying(input_ids, TOKEN_DIMS), varying(position_ids, TOKEN_DIMS), varying(mask, MASK_DIMS),
            varying(slots, SLOT_DIMS), [varying(key, BUFFER_DIMS) for key in keys],
            [varying(value, BUFFER_DIMS) for value in values],
            {name: varying(tensor, TOKEN_DIMS) for name, tensor in extra.items()})


def _dynamic_shapes(inputs: tuple) -> tuple:
    """The step's `varying_dims` as export's dynamic shapes."""
    from torch.export import Dim

    input_ids, position_ids, mask, slots, keys, values, extra = varying_dims(inputs)

    def auto(dims: tuple[int, ...]) -> dict:
        return {dim: Dim.AUTO for dim in dims}

    return (auto(input_ids), auto(position_ids), auto(mask), auto(slots), [auto(dims) for dims in keys],
            [auto(dims) for dims in values], {name: auto(dims) for name, dims in extra.items()})


def _detached(inputs: tuple) -> tuple:
    """Copies of a step's inputs outside inference mode (export traces ordinary tensors), so the real cache is not
    written by the trace."""
    input_ids, position_ids, mask, slots, keys, values, extra = inputs
    with torch.inference_mode(False):
        return (input_ids.clone(), position_ids.clone(), mask.clone(), slots.clone(), [key.clone() for key in keys],
                [value.clone() for value in values], {name: tensor.clone() for name, tensor in extra.items()})


@dataclass(eq=False)
class PackagedGraph:
    """One graph's package, loaded: called like the compiled function it stands for.

    The loaded model's own call parses its input and output specs from JSON and flattens the step's nested inputs
    (60 KV buffers) on every call: 0.1-0.3 ms a call, two calls a tree step. Once the first call has checked that
    the step's structure is the one exported (`FlatCall`), later calls hand the package's runner the flat tensors."""

    runner: Any
    path: Path
    flat: "FlatCall | None" = None
    checked: bool = False

    def __call__(self, compiled, input_ids, position_ids, mask, cache, extra: dict):
        inputs = _step_inputs(input_ids, position_ids, mask, cache, extra)
        if not self.checked:
            self.flat, self.checked = FlatCall.of(self.runner, inputs), True
        if self.flat is None:
            out, parts = self.runner(*inputs)
        else:
            out, parts = self.flat(inputs)
        compiled._parts[:] = parts
        return out


@dataclass(frozen=True)
class FlatCall:
    """The package's runner called with a step's tensors in the order export flattened them (`_step_inputs`:
    tokens, positions, mask, slots, keys, values, extra by name); its outputs rebuilt by the spec parsed once."""

    run: Any
    out_spec: Any
    extra_names: tuple[str, ...]

    @classmethod
    def of(cls, runner, inputs: tuple) -> "FlatCall | None":
        """The flat call of ``runner`` for steps shaped as ``inputs``, or None where the package was exported for
        another structure (or the runner does not expose its specs): the runner's own call is kept."""
        loader = getattr(runner, "loader", None)
        if loader is None or not hasattr(loader, "boxed_run") or not hasattr(loader, "get_call_spec"):
            return None
        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        if in_spec != pytree.tree_structure((inputs, {})):
            return None
        return cls(loader.boxed_run, out_spec, tuple(inputs[-1]))

    def __call__(self, inputs: tuple):
        input_ids, position_ids, mask, slots, keys, values, extra = inputs
        flat = [input_ids, position_ids, mask, slots, *keys, *values, *(extra[name] for name in self.extra_names)]
        return pytree.tree_unflatten(self.run(flat), self.out_spec)


def _check_dynamic(exported, shapes: tuple) -> None:
    """Refuses a graph in which export fixed a dimension that varies between steps: the package would not check
    its inputs' sizes, and a step of another size would read past its tensors."""
    signature = exported.graph_signature
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    traced = [placeholders[spec.arg.name].meta["val"] for spec in signature.input_specs
              if spec.kind.name == "USER_INPUT"]
    input_ids, position_ids, mask, slots, keys, values, extra = shapes
    marks = [input_ids, position_ids, mask, slots, *keys, *values, *extra.values()]  # the order export flattens
    if len(traced) != len(marks):
        raise RuntimeError(f"the exported step takes {len(traced)} tensors, {len(marks)} expected")
    for index, (value, dims) in enumerate(zip(traced, marks)):
        fixed = [dim for dim in dims if not isinstance(value.shape[dim], torch.SymInt)]
        if fixed:
            raise RuntimeError(f"export fixed dimension(s) {fixed} of input {index} ({tuple(value.shape)}), which "
                               "vary between steps")


def _build(compiled, graph: str, inputs: tuple, folder: Path) -> None:
    from torch.export import export

    shapes = _dynamic_shapes(inputs)
    with torch.no_grad(), compiled._routing(graph):
        exported = export(_ExportedStep(compiled), _detached(inputs), dynamic_shapes=shapes, strict=False)
    _check_dynamic(exported, shapes)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(folder / PACKAGE_FILE),
                                             inductor_configs=dict(compiled.settings.options))


def packaged_graph(compiled, graph: str, input_ids, position_ids, mask, cache, extra: dict
                   ) -> tuple[PackagedGraph, float | None]:
    """The package of ``compiled``'s graph ``graph``, loaded from this machine's cache, or built there first (traced
    on this step's inputs; the seconds the build took, else None). A package that does not load is built again."""
    inputs = _step_inputs(input_ids, position_ids, mask, cache, extra)
    key = package_key(compiled, graph)

    def announce(folder: Path) -> None:
        logger.warning("hf_treespec: compiling the %s's forward for a %s (%s) into a package, once per machine "
                       "(%s): minutes on a small CPU; later processes load it in seconds.", compiled.role, graph,
                       compiled.settings.describe(), folder)

    def build(out: Path) -> None:
        _build(compiled, graph, inputs, out)

    folder, seconds = cached_artifact(KIND, key, build, announce)
    try:
        runner = torch._inductor.aoti_load_package(str(folder / PACKAGE_FILE))
    except Exception as error:  # a truncated or foreign file: build it again, once
        discard(folder, logger, f"{type(error).__name__}: {error}")
        folder, seconds = cached_artifact(KIND, key, build, announce)
        runner = torch._inductor.aoti_load_package(str(folder / PACKAGE_FILE))
    return PackagedGraph(runner, folder / PACKAGE_FILE), seconds
