"""Where the package keeps what it derives on a machine (converted checkpoints, measured cost curves)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$HF_TREESPEC_CACHE`` if set, else ``~/.cache/hf_treespec``."""
    env = os.environ.get("HF_TREESPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_treespec"


def cost_cache_dir() -> Path:
    """Where measured cost curves are cached: ``$HF_TREESPEC_COST_CACHE`` if set, else ``latency/`` in
    `default_cache_dir` (a separate switch, so a fresh set of measurements never means converting checkpoints
    again)."""
    env = os.environ.get("HF_TREESPEC_COST_CACHE")
    return Path(env).expanduser() if env else default_cache_dir() / "latency"


def compiled_cache_dir() -> Path:
    """Where compiled and exported forwards are cached (AOTInductor packages, OpenVINO IRs):
    ``$HF_TREESPEC_COMPILED_CACHE`` if set, else `default_cache_dir` (a separate switch, so that tests or a fresh
    compile never mean converting checkpoints again)."""
    env = os.environ.get("HF_TREESPEC_COMPILED_CACHE")
    return Path(env).expanduser() if env else default_cache_dir()
