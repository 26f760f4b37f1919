"""Where the package keeps what it derives on a machine (converted checkpoints, measured cost curves)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$HF_TREESPEC_CACHE`` if set, else ``~/.cache/hf_treespec``."""
    env = os.environ.get("HF_TREESPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_treespec"
