"""Building the package's small C++ ops for this machine (torch's ``load_inline``), shared by every op.

Each op is built once per machine with ``-march=native`` (within ATen's ISA cap, see `compiler_flags`) under a name that
carries its source, the flags, torch's version and the CPU, so a later process only loads the built library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

from .failures import failure_reason

FLAGS = ["-O3", "-march=native", "-ffast-math"]
#: ATen's ``parallel_for`` runs its OpenMP loop only in code built with OpenMP: without the flag (``load_inline``
#: adds none) every op here ran its work on one thread, the step's other threads idle
OPENMP = ["-fopenmp"]
#: ATen's vector ISA cap (``ATEN_CPU_CAPABILITY``, which inductor's kernels follow too) -> the flags that keep an op
#: within it: a capped run stands in for a CPU without the instructions the cap leaves out
ISA_CAPS = {"avx2": ["-mno-avx512f"], "default": ["-mno-avx"]}


def compiler_flags() -> list[str]:
    """The compiler flags: `FLAGS` (this CPU's instructions), OpenMP where torch runs its threads with it (Linux
    builds), within ATen's ISA cap when one is set."""
    openmp = OPENMP if torch.backends.openmp.is_available() and platform.system() == "Linux" else []
    return FLAGS + openmp + ISA_CAPS.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower(), [])


def isa_capped_below_avx512() -> bool:
    """Whether ATen's ISA cap leaves out avx512 (an op that needs it must not be built)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ISA_CAPS


def library_name(prefix: str, source: str, flags: list[str]) -> str:
    """An op's library name: ``prefix`` and a hash of the source, the flags, torch's version and this CPU."""
    from ..cost.hardware import cpu_flags

    machine = " ".join(cpu_flags()) or platform.processor()
    key = "\n".join([source, " ".join(flags), torch.__version__, platform.machine(), machine])
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def has_compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def build(name: str, source: str, flags: list[str], what: str, logger: logging.Logger) -> str | None:
    """Builds (or loads, when this machine built it before) the library ``name`` from ``source``, whose
    ``TORCH_LIBRARY_FRAGMENT`` registers its ops; returns None on success, else why it failed (``what`` names the op
    in the one log line a first build prints)."""
    from torch.utils.cpp_extension import get_default_build_root, load_inline

    built = list(Path(get_default_build_root()).glob(f"**/{name}/*.so"))  # torch builds under a version folder
    if not built:
        logger.warning("hf_treespec: building %s for this machine (under a minute, once; %s).", what, name)
    try:
        load_inline(name, cpp_sources=source, functions=None, is_python_module=False, extra_cflags=flags)
    except Exception as error:  # any build failure: the caller keeps its fallback
        return failure_reason(error)
    return None
