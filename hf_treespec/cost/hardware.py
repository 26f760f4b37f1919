"""What machine are we on, and which dtype is it fast at.

A 135M target verifies a 16-node tree for ~1.2 one-token steps in bf16 on a CPU with native bf16 matmuls
(avx512_bf16 / AMX), but for ~6.8 on an avx2-only CPU, where fp32 is the fast dtype. The benchmark and the latency
cache key on what this module reports, so results and calibrations from different machines never mix.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

#: CPU flags that decide the fast dtype / matter for matmul speed (shown in the benchmark header)
RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "fma")
#: flags meaning "native bf16 matmuls": bf16 is then the fast dtype on this CPU
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
#: ``--dtype`` names the command lines accept, besides ``auto`` (= :func:`fast_dtype`)
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, *DTYPES)
#: what ``--dtype auto`` means, for the commands' help
AUTO_DTYPE_HELP = "auto: the machine's fast dtype (bf16 on a GPU or a CPU with avx512_bf16 / AMX, else fp32)"
DEVICE_HELP = "auto (CUDA when available, else the CPU), cpu, cuda or cuda:N"


@dataclass(frozen=True)
class Hardware:
    """The device a model runs on, as the cost model and the benchmark report it."""

    device_type: str  # "cpu" / "cuda" / "mps" ...
    name: str  # CPU model name or GPU name
    flags: tuple[str, ...] = field(default_factory=tuple)  # relevant CPU flags present (empty on accelerators)
    threads: int = 1

    @property
    def fast_dtype(self) -> torch.dtype:
        """bf16 on accelerators and on CPUs with native bf16 matmuls, else fp32 (emulated bf16 loses to fp32)."""
        if self.device_type != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if any(f in self.flags for f in BF16_CPU_FLAGS) else torch.float32

    def describe(self) -> str:
        """One line for table headers: ``AMD EPYC 7B13 (avx2, fma; 2 threads)`` or ``NVIDIA H100 (cuda)``."""
        if self.device_type == "cpu":
            flags = ", ".join(self.flags) if self.flags else "no avx2"
            return f"{self.name} ({flags}; {self.threads} threads)"
        return f"{self.name} ({self.device_type})"

    def as_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags), "fast_dtype": str(self.fast_dtype).removeprefix("torch.")}


def _read_cpuinfo(path: str | Path) -> tuple[str, tuple[str, ...]] | None:
    """(model name, every flag in the order reported) of the first processor in ``path``; None if unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    name, flags = "", ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = tuple(value.split())
    return name, flags


def cpu_info(path: str | Path = "/proc/cpuinfo") -> tuple[str, tuple[str, ...]]:
    """(model name, relevant flags) from ``/proc/cpuinfo``; ``platform.processor()`` and no flags elsewhere."""
    read = _read_cpuinfo(path)
    if read is None:
        return platform.processor() or platform.machine(), ()
    name, flags = read
    return name or platform.processor() or platform.machine(), tuple(f for f in RELEVANT_CPU_FLAGS if f in flags)


def cpu_flags(path: str | Path = "/proc/cpuinfo") -> tuple[str, ...]:
    """Every flag the CPU reports (code built with ``-march=native`` may use any of them); empty elsewhere."""
    read = _read_cpuinfo(path)
    return read[1] if read is not None else ()


def detect(device: torch.device | str = "cpu", cpuinfo: str | Path = "/proc/cpuinfo") -> Hardware:
    """The hardware behind ``device`` (the GPU's name for CUDA, the CPU's model and flags otherwise)."""
    device = torch.device(device)
    if device.type == "cuda":
        return Hardware("cuda", torch.cuda.get_device_name(device))
    if device.type != "cpu":
        return Hardware(device.type, device.type)
    name, flags = cpu_info(cpuinfo)
    return Hardware("cpu", name, flags, torch.get_num_threads())


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``--device`` as a torch device: ``auto`` is CUDA when available, else the CPU; a device this machine lacks is
    refused by name (rather than failing at the first tensor moved there)."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r} ({error}).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this machine has no CUDA device; use 'cpu' or 'auto'.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here.")
    return device


def fast_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The dtype this machine runs a model fastest in: CUDA if available (or ``device``) -> bf16; CPU -> see
    :attr:`Hardware.fast_dtype`."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return detect(device).fast_dtype


def resolve_dtype_name(name: str, device: torch.device | str | None = None) -> str:
    """``--dtype`` as a concrete name: ``auto`` becomes the fast dtype of ``device`` (default: CUDA if available, else
    this CPU), so a command run on an avx2-only CPU does not silently take emulated bf16 (several times slower)."""
    if name == AUTO_DTYPE:
        return {v: k for k, v in DTYPES.items()}[fast_dtype(device)]
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {name!r}.")
    return name
