"""What the OpenVINO engines share: the converted graphs' on-disk cache (keyed by weights, config, dtype and library
versions), the fp32 copy a conversion traces, output precisions, compilation for this CPU, and tensors back to torch.

Nothing here imports OpenVINO at module level: the package runs without it.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path

import numpy as np
import torch

from .disk_cache import cached_artifact, model_key

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "openvino>=2026.4,<2026.5"'
IR_FILE = "model.xml"


def openvino_installed() -> bool:
    try:
        return importlib.util.find_spec("openvino") is not None
    except (ImportError, ValueError):
        return False


def export_key(model: torch.nn.Module, kind: str, **extra) -> dict:
    """What an exported graph of ``model`` (``kind``: what the graph is) is valid for (`model_key` and OpenVINO's
    version)."""
    from importlib.metadata import version

    return {**model_key(model, kind, **extra), "openvino": version("openvino")}


def half_types():
    import openvino as ov

    return {torch.bfloat16: ov.Type.bf16, torch.float16: ov.Type.f16}


def cached_ir(key: dict, export, what: str) -> tuple[Path, float | None]:
    """The IR folder for ``key`` under ``<cache>/openvino-steps``, made by ``export(folder)`` when missing (the
    seconds that took, else None)."""
    def announce(folder: Path) -> None:
        logger.warning("hf_treespec: exporting the %s to OpenVINO (once per machine and model; seconds to a "
                       "minute) into %s.", what, folder)

    return cached_artifact("openvino-steps", key, export, announce)


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of ``model`` to convert (OpenVINO picks its own inference precision), without what processes
    attach to the model (engines, compiled forwards: not copyable, not weights)."""
    attached = {id(value): {} for key, value in vars(model).items() if key.startswith("_treespec_")}
    return copy.deepcopy(model, memo=attached).float().eval().requires_grad_(False)


def half_output(result, dtype: torch.dtype) -> None:
    """Makes an output of the converted graph leave in ``dtype`` (bf16 / fp16; fp32 left alone). An fp32 output
    keeps the residual stream feeding it in fp32: the CPU runtime propagates an output's precision upstream
    (measured on the target: a 4-row step 25 ms instead of 20)."""
    import openvino.opset13 as ops

    types = half_types()
    if dtype in types:
        converted = ops.convert(result.input_value(0), types[dtype])
        result.input(0).replace_source_output(converted.output(0))


def compile_ir(folder: Path, dtype: torch.dtype):
    """The IR in ``folder`` compiled for this CPU at ``dtype``'s precision (inference and KV cache)."""
    import openvino as ov

    core = ov.Core()
    precision = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32")
    config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": precision,
              "KV_CACHE_PRECISION": precision, "PERFORMANCE_HINT": "LATENCY"}
    return core.compile_model(core.read_model(folder / IR_FILE), "CPU", config)


def to_torch(tensor) -> torch.Tensor:
    """A copy of an OpenVINO output tensor (its buffer is reused by the next inference). OpenVINO's numpy view of a
    bf16 tensor is typed float16: its bits are reinterpreted."""
    import openvino as ov

    data = tensor.data
    if tensor.element_type == ov.Type.bf16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def from_numpy_as(array: np.ndarray, element_type):
    """An OpenVINO tensor of ``element_type`` holding ``array``'s bits (a bf16 tensor's numpy view is typed
    float16, see `to_torch`)."""
    import openvino as ov

    tensor = ov.Tensor(element_type, ov.Shape(list(array.shape)))
    tensor.data[...] = array
    return tensor
