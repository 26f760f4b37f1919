"""The compiled target path: the target's forward compiled over a preallocated KV cache (once per machine into
AOTInductor packages with the recommended CPU settings, `packaged`), or run by OpenVINO (`openvino_step`) with its
KV cache kept in the engine.

Opt in per call with ``generate(..., compile_config=CompileConfig())`` (inductor) or
``CompileConfig(backend="openvino")`` (or on ``model.generation_config``); ``disable_compile=True`` turns it off.
`hf_treespec.plain_generate` is plain decoding through the same forward: the baseline a compiled tree run is
measured against.
"""

from .forward import (
    CompiledDrafterForward, CompiledForward, CompileSettings, compiled_forward_for, release,
    settings_from_generation_config,
)
from .preallocated import PreallocatedLayer, preallocate, reserve

__all__ = [
    "CompileSettings", "CompiledDrafterForward", "CompiledForward", "PreallocatedLayer", "compiled_forward_for",
    "preallocate", "release", "reserve", "settings_from_generation_config",
]
