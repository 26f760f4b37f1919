"""The NDE data set on disk: ``generate_nde_data`` writes the rows :mod:`.nde_data` estimates in resumable chunks
(each renamed into place when complete) with ``nde_data.json`` beside them, and ``load_nde_data`` reads one or more
such folders back, checking that they agree."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from hf_treespec.api import as_drafter, SCALAR_FEATURES, Action

from ..evaluation.latency import LatencyModel, measure_latency
from .nde_data import EXTRA_PREFIX, NDEDataConfig, draft_hidden_size, prompt_rows

META_FILE = "nde_data.json"
CHUNK_PREFIX = "chunk-"


# ------------------------------------------------------------------------------------------------ dataset
def _features(hidden_size: int, num_actions: int, draft_size: int, extra_verifiers: Sequence[str] = ()):
    from datasets import Features, Sequence as Seq, Value

    return Features({
        **{f"{EXTRA_PREFIX}{name}": Seq(Value("float32"), length=num_actions) for name in extra_verifiers},
        "prompt": Value("int32"), "position": Value("int32"), "context_length": Value("int32"),
        "root_token": Value("int32"), "target_hidden": Seq(Value("float32"), length=hidden_size),
        "draft_hidden": Seq(Value("float32"), length=draft_size),
        "scalars": Seq(Value("float32"), length=len(SCALAR_FEATURES)),
        "block_efficiency": Seq(Value("float32"), length=num_actions),
        "seconds": Seq(Value("float32"), length=num_actions), "tree_nodes": Seq(Value("float32"), length=num_actions),
        "temperature": Value("float32"), "top_p": Value("float32"),
    })


def _meta(config: NDEDataConfig, hidden_size: int, draft_size: int, latency: LatencyModel) -> dict[str, Any]:
    return {"actions": [list(a) for a in config.actions], "scalar_features": list(SCALAR_FEATURES),
            "hidden_size": hidden_size, "draft_hidden_size": draft_size, "verifier": config.verifier,
            "extra_verifiers": list(config.extra_verifiers),
            "latency": asdict(latency), "config": asdict(config)}


def generate_nde_data(
    model, drafter_model, prompts: Sequence[torch.Tensor], output: str | Path, config: NDEDataConfig,
    latency: LatencyModel | None = None, progress: bool = True,
) -> Path:
    """Writes the NDE training data of ``prompts`` (``[1, L]`` token tensors) to ``output`` (resumable).

    ``latency``: the timing model of Equation 11; measured with :func:`measure_latency` when None (and reused from
    ``nde_data.json`` when resuming, so every chunk shares one timing model).
    """
    from datasets import Dataset

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    drafter = as_drafter(drafter_model)
    vocab = int(model.config.get_text_config().vocab_size)
    if drafter.vocab_size != vocab:
        raise ValueError(f"the drafter's vocabulary ({drafter.vocab_size}) differs from the target's ({vocab}).")
    hidden_size = int(model.config.get_text_config().hidden_size)
    draft_size = draft_hidden_size(drafter)
    meta_path = output / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if (meta["config"] != asdict(config) or meta["hidden_size"] != hidden_size
                or meta["scalar_features"] != list(SCALAR_FEATURES) or meta.get("draft_hidden_size") != draft_size):
            raise ValueError(f"{output} holds NDE data made with other settings ({meta['config']}); use another "
                             "--output or the same settings to resume.")
        latency = LatencyModel(**meta["latency"])
    else:
        latency = latency or measure_latency(model, drafter_model)
        meta_path.write_text(json.dumps(_meta(config, hidden_size, draft_size, latency), indent=2) + "\n")
    features = _features(hidden_size, len(config.actions), draft_size, config.extra_verifiers)
    bar = tqdm(total=len(prompts), desc="nde-data", unit="prompt", disable=not progress)
    roots = 0
    for chunk, start in enumerate(range(0, len(prompts), config.chunk_size)):
        folder = output / f"{CHUNK_PREFIX}{chunk:05d}"
        batch = prompts[start : start + config.chunk_size]
        if folder.is_dir():
            bar.update(len(batch))
            continue
        rows = []
        for offset, prompt in enumerate(batch):
            rows += prompt_rows(model, drafter, prompt, config, latency, start + offset)
            bar.update(1)
            bar.set_postfix(roots=roots + len(rows))
        roots += len(rows)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        columns = {name: [row[name] for row in rows] for name in features}
        Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
        tmp.rename(folder)
    bar.close()
    return output


@dataclass
class NDEData:
    """The rows of one or more ``nde-data`` folders and their shared metadata."""

    dataset: Any
    meta: dict[str, Any]

    @property
    def actions(self) -> list[Action]:
        return [Action(*a) for a in self.meta["actions"]]

    def __len__(self) -> int:
        return len(self.dataset)


def load_nde_data(paths: str | Path | Iterable[str | Path], verifier: str | None = None) -> NDEData:
    """Concatenates the finished chunks of one or more folders (e.g. several temperatures); their actions, features,
    verifier and target hidden size must agree. ``verifier``: read that verifier's block efficiency (the folder's own,
    or one of its ``extra_verifiers``) as ``block_efficiency``."""
    from datasets import concatenate_datasets, load_from_disk

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    parts, meta = [], None
    for path in map(Path, paths):
        if not (path / META_FILE).is_file():
            raise ValueError(f"{path} is not an nde-data folder (no {META_FILE}); make one with "
                             "`hf-treespec train nde-data`.")
        this = json.loads((path / META_FILE).read_text())
        extras = list(this.get("extra_verifiers", []))
        wanted = verifier or this["verifier"]
        if wanted != this["verifier"] and wanted not in extras:
            raise ValueError(f"{path} has block efficiencies for {[this['verifier'], *extras]}, not {wanted!r}.")
        this = dict(this, verifier=wanted, extra_verifiers=[])
        if meta is not None:
            for key in ("actions", "scalar_features", "hidden_size", "verifier", "draft_hidden_size"):
                if this.get(key) != meta.get(key):
                    raise ValueError(f"{path} has other {key} than {paths[0]}; NDE data folders must share it.")
        meta = meta or this
        for chunk in sorted(path.glob(f"{CHUNK_PREFIX}*")):
            if not chunk.is_dir() or chunk.name.endswith(".tmp"):
                continue
            part = load_from_disk(str(chunk))
            if wanted in extras:
                part = part.remove_columns("block_efficiency").rename_column(f"{EXTRA_PREFIX}{wanted}",
                                                                             "block_efficiency")
            parts.append(part.remove_columns([c for c in part.column_names if c.startswith(EXTRA_PREFIX)]))
    if not parts:
        raise ValueError(f"no finished chunk in {', '.join(map(str, paths))}.")
    return NDEData(dataset=concatenate_datasets(parts) if len(parts) > 1 else parts[0], meta=meta)
