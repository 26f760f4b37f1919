"""What the compile-once routes share: a digest of a model's weights, the key an artifact is valid for, and the
folder under the cache that holds it (written to a staging folder and renamed, so a reader never sees half of it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from ..paths import compiled_cache_dir

#: the file in every artifact folder saying what it was made for (written last: its presence means complete)
PROVENANCE_FILE = "hf_treespec_export.json"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the weights: every tensor's name, shape and dtype, and a strided sample of its values (a full
    hash of a large model would cost seconds in every process)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.tobytes())
    return digest.hexdigest()


def model_key(model: torch.nn.Module, kind: str, **extra) -> dict:
    """What an artifact of ``model`` (``kind``: what it is) is valid for: the weights, the config, the dtype and
    the versions of torch and transformers (``extra``: anything else it depends on)."""
    import transformers

    return {
        "kind": kind, **extra,
        "model": getattr(model, "name_or_path", "") or type(model).__name__,
        "config_sha": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "weights": weights_fingerprint(model)[:24],
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }


def artifact_folder(kind: str, key: dict) -> Path:
    """Where the artifact of ``key`` lives: ``<compiled cache>/<kind>/<digest of the key>``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return compiled_cache_dir() / kind / digest


def is_complete(folder: Path) -> bool:
    return (folder / PROVENANCE_FILE).is_file()


def cached_artifact(kind: str, key: dict, make: Callable[[Path], None], announce: Callable[[Path], None]
                    ) -> tuple[Path, float | None]:
    """The folder of ``key`` under ``kind``, made by ``make(folder)`` when missing (``announce(folder)`` first: the
    progress line of a long first build); returns it and the seconds making it took (None: it was there)."""
    folder = artifact_folder(kind, key)
    if is_complete(folder):
        return folder, None
    announce(folder)
    start = time.perf_counter()
    staging = folder.with_name(folder.name + f".tmp{time.time_ns()}")
    staging.mkdir(parents=True)
    try:
        make(staging)
        (staging / PROVENANCE_FILE).write_text(json.dumps(key, indent=1))
        if is_complete(folder):  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder left by an interrupted writer
            staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder, time.perf_counter() - start


def discard(folder: Path, logger: logging.Logger, why: str) -> None:
    """Removes an artifact that cannot be used (``why``), so that it is made again."""
    logger.warning("hf_treespec: %s is unusable (%s); removing it to build it again.", folder, why)
    shutil.rmtree(folder, ignore_errors=True)
