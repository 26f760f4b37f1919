"""OpenVINO GenAI's ``LLMPipeline`` as a benchmark peer: the greedy loop a CPU user would pick instead of ours.

The pipeline reads an OpenVINO IR folder. It is exported once per machine by optimum-intel's ``optimum-cli export
openvino`` from the same weights the benchmark loads (the target's checkpoint folder, or an fp32 copy of an in-memory
model), in fp32, and cached under ``<cache>/openvino/<name>-<key>`` where the key covers the weights, the weight
format and the versions of OpenVINO, its tokenizers and the exporter. optimum-intel pins an older transformers than
this package needs, so it runs from a virtual environment of its own (``<cache>/openvino/exporter-<versions>``), made
by the first export with ``python -m venv`` and ``pip`` (a few minutes, then cached).

Nothing here imports OpenVINO at module level: the package runs without the ``[openvino]`` extra, and the benchmark
method that uses this module refuses with :data:`INSTALL_HINT` where the extra is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..paths import default_cache_dir

INSTALL_HINT = 'pip install "hf-treespec[openvino]"'
#: the exporter: optimum-intel at this version, with the transformers it supports (< 5.6, so never this package's)
OPTIMUM_INTEL = "2.2.0"
EXPORT_TRANSFORMERS = "transformers<5.6"
EXPORT_TASK = "text-generation-with-past"
WEIGHT_FORMAT = "fp32"
#: an ``optimum-cli`` to use instead of the exporter environment this module makes (one the user installed)
OPTIMUM_CLI_ENV = "HF_TREESPEC_OPTIMUM_CLI"
#: extra ``pip install`` arguments for the exporter environment (e.g. ``--extra-index-url`` of a CPU torch index)
PIP_ARGS_ENV = "HF_TREESPEC_OPENVINO_PIP_ARGS"
PROVENANCE_FILE = "hf_treespec_openvino.json"
READY_FILE = "hf_treespec_ready.json"
#: what a first export costs, said where it starts (SmolLM2-135M on 2 cores; most of it is the exporter environment)
FIRST_EXPORT_NOTE = ("first use on this machine: ~4 min for the exporter environment, then ~30 s per export of a "
                     "135M model on 2 cores")
WEIGHT_SUFFIXES = (".safetensors", ".bin")

Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"hf-treespec: {line}", file=sys.stderr, flush=True)


def openvino_available() -> bool:
    """Whether the ``[openvino]`` extra (``openvino_genai``) is installed."""
    try:
        return importlib.util.find_spec("openvino_genai") is not None
    except (ImportError, ValueError):
        return False


def require_genai():
    """``openvino_genai``, or a ValueError that says how to install it."""
    try:
        import openvino_genai
    except ImportError as error:
        raise ValueError(f"OpenVINO GenAI is not installed ({error}); install the extra: {INSTALL_HINT}.") from None
    return openvino_genai


def runtime_versions() -> dict[str, str]:
    """The installed openvino, openvino-genai and openvino-tokenizers versions (release numbers, e.g. 2026.4.1)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("openvino", "openvino-genai", "openvino-tokenizers"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            raise ValueError(f"{name} is not installed; install the extra: {INSTALL_HINT}.") from None
    return found


def _release(text: str) -> str:
    """``2026.4.1.0`` -> ``2026.4.1`` (the OpenVINO release the three packages share)."""
    return ".".join(text.split(".")[:3])


# ----------------------------------------------------------------------------------------------------------- weights


@dataclass
class WeightsSource:
    """A checkpoint folder to export and the fingerprint of its weights."""

    folder: Path
    fingerprint: str
    name: str


def _folder_fingerprint(folder: Path) -> str | None:
    """config.json's content plus each weight file's name, size and modification time (cheap: a re-converted or
    re-downloaded checkpoint changes them); None when ``folder`` is no checkpoint folder."""
    config = folder / "config.json"
    weights = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()) \
        if folder.is_dir() else []
    if not config.is_file() or not weights:
        return None
    digest = hashlib.sha256(config.read_bytes())
    for path in weights:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _model_fingerprint(model: torch.nn.Module) -> str:
    """The model's config and every parameter and buffer in fp32 (for a model with no checkpoint folder)."""
    digest = hashlib.sha256(model.config.to_json_string().encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[-60:] or "model"


def weights_source(model: torch.nn.Module) -> tuple[WeightsSource | None, str]:
    """The checkpoint folder ``model`` was loaded from (its ``name_or_path``) when that is a local folder with
    weights, else None; and the weights' fingerprint either way (for a model with no folder, of its tensors)."""
    path = Path(str(getattr(model, "name_or_path", "") or ""))
    fingerprint = _folder_fingerprint(path) if str(path) else None
    if fingerprint is not None:
        return WeightsSource(path, fingerprint, _slug(path.name)), fingerprint
    return None, _model_fingerprint(model)


@contextlib.contextmanager
def _saved_copy(model: torch.nn.Module) -> Iterator[Path]:
    """An fp32 ``save_pretrained`` of ``model`` in a temporary folder (the model itself is left as it is)."""
    with tempfile.TemporaryDirectory(prefix="hf_treespec_ov_src_") as folder:
        state = {k: v.detach().to(torch.float32).cpu() for k, v in model.state_dict().items()}
        model.save_pretrained(folder, state_dict=state)
        yield Path(folder)


# ------------------------------------------------------------------------------------------------------------ caches


def openvino_cache_dir() -> Path:
    return default_cache_dir() / "openvino"


def exporter_key() -> str:
    """What the IR depends on besides the weights: the exporter and the OpenVINO release it writes for."""
    custom = os.environ.get(OPTIMUM_CLI_ENV)
    exporter = f"optimum-cli:{Path(custom).resolve()}" if custom else f"optimum-intel=={OPTIMUM_INTEL}"
    versions = runtime_versions()
    return f"{exporter};openvino=={versions['openvino']};openvino-tokenizers=={versions['openvino-tokenizers']}"


def ir_folder(name: str, fingerprint: str) -> Path:
    """Where the IR of these weights is cached: ``<cache>/openvino/<name>-<key>``."""
    key = hashlib.sha256(json.dumps({"weights": fingerprint, "weight_format": WEIGHT_FORMAT, "task": EXPORT_TASK,
                                     "exporter": exporter_key()}, sort_keys=True).encode()).hexdigest()[:16]
    return openvino_cache_dir() / f"{name}-{WEIGHT_FORMAT}-{key}"


def exporter_env_dir() -> Path:
    versions = runtime_versions()
    return openvino_cache_dir() / f"exporter-optimum-intel{OPTIMUM_INTEL}-ov{_release(versions['openvino'])}"


@contextlib.contextmanager
def _cache_lock(name: str) -> Iterator[None]:
    """An exclusive lock on ``<cache>/openvino/.locks/<name>`` (two benchmarks never build one thing at once)."""
    folder = openvino_cache_dir() / ".locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "w") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: no lock, the atomic renames still keep a finished folder whole
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _isolated_env() -> dict[str, str]:
    """This process's environment without what would mix this environment's packages into the exporter's."""
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def _run_logged(command: list[str], log: Path, what: str) -> None:
    """Runs ``command`` (in :func:`_isolated_env`) with its output appended to ``log``; a failure raises a ValueError
    with the log's tail."""
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=_isolated_env(), check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
        raise ValueError(f"{what} failed (exit {result.returncode}; full log: {log}):\n{tail}")


def _venv_python(env_dir: Path) -> Path:
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _venv_bin(env_dir: Path, name: str) -> Path:
    return env_dir / ("Scripts" if os.name == "nt" else "bin") / (name + (".exe" if os.name == "nt" else ""))


def exporter_requirements() -> list[str]:
    """What the exporter environment installs: this torch release (pip picks the wheel its index serves), the
    transformers optimum-intel supports, optimum-intel, and openvino / openvino-tokenizers at the installed release
    (the tokenizer IR it writes must load in this OpenVINO GenAI)."""
    versions = runtime_versions()
    torch_release = torch.__version__.split("+")[0]
    return [f"torch=={torch_release}", EXPORT_TRANSFORMERS, f"optimum-intel[openvino]=={OPTIMUM_INTEL}",
            f"openvino=={versions['openvino']}", f"openvino-tokenizers=={versions['openvino-tokenizers']}"]


def ensure_exporter(progress: Progress = _stderr) -> Path:
    """The ``optimum-cli`` that exports IRs: ``$HF_TREESPEC_OPTIMUM_CLI`` if set, else the one in the exporter
    environment, which is made here on first use (``python -m venv``; ``pip install`` of
    :func:`exporter_requirements`; torchvision, which optimum-intel pulls in and whose build for this torch breaks
    ``optimum-cli``, removed)."""
    custom = os.environ.get(OPTIMUM_CLI_ENV)
    if custom:
        if not Path(custom).is_file():
            raise ValueError(f"${OPTIMUM_CLI_ENV}={custom} is not a file.")
        return Path(custom)
    env_dir = exporter_env_dir()
    cli = _venv_bin(env_dir, "optimum-cli")
    with _cache_lock(env_dir.name):
        if (env_dir / READY_FILE).is_file() and cli.is_file():
            return cli
        if env_dir.exists():  # an interrupted build: start over
            shutil.rmtree(env_dir)
        requirements = exporter_requirements()
        progress(f"making the OpenVINO exporter environment {env_dir} ({', '.join(requirements)}); "
                 "a few minutes, once per machine")
        start = time.perf_counter()
        log = env_dir.parent / f"{env_dir.name}.log"
        log.write_text("", encoding="utf-8")
        _run_logged([sys.executable, "-m", "venv", str(env_dir)], log, "python -m venv")
        python = str(_venv_python(env_dir))
        pip = [python, "-m", "pip", "--disable-pip-version-check"]
        extra = os.environ.get(PIP_ARGS_ENV, "").split()
        _run_logged([*pip, "install", *extra, *requirements], log, "pip install of the exporter")
        _run_logged([*pip, "uninstall", "-y", "torchvision"], log, "pip uninstall torchvision")
        _run_logged([str(cli), "export", "openvino", "--help"], log, "optimum-cli export openvino --help")
        seconds = time.perf_counter() - start
        (env_dir / READY_FILE).write_text(json.dumps({"requirements": requirements, "seconds": round(seconds, 1)}))
        shutil.move(str(log), str(env_dir / "install.log"))  # a failed build's log stays beside the folder
        progress(f"exporter environment ready in {seconds:.0f} s")
    return cli


# ---------------------------------------------------------------------------------------------------------------- IR


@dataclass
class ExportedIR:
    """An IR folder LLMPipeline reads, with how it was made (``export_seconds`` None: found in the cache)."""

    folder: Path
    provenance: dict[str, Any]
    export_seconds: float | None = None


def export_ir(source: Path, out: Path, progress: Progress = _stderr, provenance: dict[str, Any] | None = None
              ) -> float:
    """``optimum-cli export openvino --model <source> --task text-generation-with-past --weight-format fp32`` into
    ``out`` (written to a temporary folder beside it and renamed when complete). Returns the export's seconds,
    the exporter environment's first build not counted."""
    cli = ensure_exporter(progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    progress(f"exporting {source} to an OpenVINO IR ({WEIGHT_FORMAT}) with {cli} -> {out} (~30 s for a 135M "
             "model on 2 cores)")
    start = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    log = out.parent / f"{out.name}.export.log"  # kept beside the cache when the export fails
    log.write_text("", encoding="utf-8")
    try:
        _run_logged([str(cli), "export", "openvino", "--model", str(source), "--task", EXPORT_TASK,
                     "--weight-format", WEIGHT_FORMAT, str(staging / "ir")], log, "optimum-cli export openvino")
        ir = staging / "ir"
        if not (ir / "openvino_model.xml").is_file():
            raise ValueError(f"optimum-cli wrote no openvino_model.xml (log: {log}).")
        seconds = time.perf_counter() - start
        shutil.move(str(log), str(ir / "export.log"))
        (ir / PROVENANCE_FILE).write_text(json.dumps({**(provenance or {}), "export_seconds": round(seconds, 1)},
                                                     indent=1))
        try:
            os.replace(ir, out)  # atomic: a folder is whole or absent
        except OSError:
            if not (out / PROVENANCE_FILE).is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"exported in {seconds:.0f} s")
    return seconds


def ensure_ir(model: torch.nn.Module, progress: Progress = _stderr) -> ExportedIR:
    """The cached IR of ``model``'s weights, exported first when missing: from the checkpoint folder the model was
    loaded from, or from an fp32 ``save_pretrained`` copy of the model when it has none (injected models)."""
    source, fingerprint = weights_source(model)
    name = source.name if source is not None else _slug(type(model).__name__)
    folder = ir_folder(name, fingerprint)
    provenance = {"source": str(source.folder) if source is not None else "(in-memory model, fp32 copy)",
                  "weights": fingerprint, "weight_format": WEIGHT_FORMAT, "task": EXPORT_TASK,
                  "exporter": exporter_key(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with _cache_lock(folder.name):
        if (folder / PROVENANCE_FILE).is_file():
            return ExportedIR(folder, json.loads((folder / PROVENANCE_FILE).read_text()))
        if not os.environ.get(OPTIMUM_CLI_ENV) and not (exporter_env_dir() / READY_FILE).is_file():
            progress(f"no cached OpenVINO IR of {provenance['source']}; exporting it ({FIRST_EXPORT_NOTE})")
        if source is not None:
            seconds = export_ir(source.folder, folder, progress, provenance)
        else:
            with _saved_copy(model) as copy:
                seconds = export_ir(copy, folder, progress, provenance)
    return ExportedIR(folder, json.loads((folder / PROVENANCE_FILE).read_text()), seconds)


# ---------------------------------------------------------------------------------------------------------- pipeline

#: the bench's dtype -> the CPU plugin's INFERENCE_PRECISION_HINT
PRECISIONS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: a method's own settings (``openvino@kv_cache_precision=u8``) and what each sets
PIPELINE_SETTINGS = {
    "inference_precision": "INFERENCE_PRECISION_HINT (default: the bench's dtype: f32, bf16, f16)",
    "kv_cache_precision": "KV_CACHE_PRECISION (default: the inference precision; OpenVINO's own CPU default is u8)",
    "attention_backend": "ATTENTION_BACKEND: PA (OpenVINO's default on CPU: paged attention, continuous batching) "
                         "or SDPA (the stateful model)",
    "prefix_caching": "reuse the KV cache of an earlier call's prompt (PA only; default false: every call prefills, "
                      "as every other method does; OpenVINO's own default is true)",
}
SIZE_MAX = 2**64 - 1


def pipeline_properties(model: torch.nn.Module, threads: int, settings: dict[str, Any]) -> dict[str, Any]:
    """LLMPipeline's CPU properties: the bench's threads, its dtype as the inference precision and the KV cache in
    that precision too, and the paged-attention scheduler OpenVINO uses for a single latency-bound request
    (unlimited tokens per step) but with prefix caching off, so a repeated prompt is prefilled again like every other
    method's; each overridable by a method setting (:data:`PIPELINE_SETTINGS`)."""
    unknown = set(settings) - set(PIPELINE_SETTINGS)
    if unknown:
        raise ValueError(f"openvino takes no {', '.join(sorted(unknown))}; its settings: "
                         f"{', '.join(PIPELINE_SETTINGS)}.")
    precision = str(settings.get("inference_precision") or PRECISIONS.get(model.dtype, "f32"))
    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": int(threads), "INFERENCE_PRECISION_HINT": precision,
                                  "KV_CACHE_PRECISION": str(settings.get("kv_cache_precision") or precision)}
    backend = str(settings.get("attention_backend") or "PA").upper()
    if backend not in ("PA", "SDPA"):
        raise ValueError(f"openvino@attention_backend must be PA or SDPA, got {backend!r}.")
    properties["ATTENTION_BACKEND"] = backend
    if backend == "PA":  # a scheduler_config would make the pipeline use PA, so SDPA gets none
        properties["scheduler_config"] = {"max_num_batched_tokens": SIZE_MAX,
                                          "enable_prefix_caching": bool(settings.get("prefix_caching", False))}
    elif settings.get("prefix_caching"):
        raise ValueError("openvino@prefix_caching applies to attention_backend=PA only.")
    return properties


def load_pipeline(folder: Path, properties: dict[str, Any]):
    """``openvino_genai.LLMPipeline(folder, "CPU", **properties)`` (the scheduler given as a dict is built here)."""
    genai = require_genai()
    properties = dict(properties)
    if "scheduler_config" in properties:
        scheduler = genai.SchedulerConfig()
        for key, value in properties["scheduler_config"].items():
            setattr(scheduler, key, value)
        properties["scheduler_config"] = scheduler
    return genai.LLMPipeline(str(folder), "CPU", **properties)


def describe_setup(ir: ExportedIR, properties: dict[str, Any], load_seconds: float) -> str:
    """One report line: the engine, the IR and how it was made, the pipeline's properties."""
    versions = runtime_versions()
    made = (f"exported now in {ir.export_seconds:.0f} s" if ir.export_seconds is not None
            else f"cached; its export took {ir.provenance.get('export_seconds', float('nan')):.0f} s")
    shown = {k: v for k, v in properties.items() if k != "scheduler_config"}
    if "scheduler_config" in properties:
        shown["prefix_caching"] = str(properties["scheduler_config"]["enable_prefix_caching"]).lower()
    exporter = str(ir.provenance.get("exporter", "?")).split(";")[0]
    return (f"OpenVINO GenAI {versions['openvino-genai']} `LLMPipeline` on CPU from IR `{ir.folder}` ({exporter}, "
            f"{ir.provenance.get('weight_format', WEIGHT_FORMAT)} weights; {made}), loaded in {load_seconds:.1f} s; "
            + ", ".join(f"{k}={v}" for k, v in shown.items()))


def greedy_config(pipe, model: torch.nn.Module, generate_kwargs: dict[str, Any]):
    """The pipeline's GenerationConfig for one call, greedy and stopped as the bench stops ``generate``: at most
    ``max_new_tokens`` new tokens, ending at any of the target's ``generation_config.eos_token_id`` (the EOS token
    kept, as ``generate`` keeps it); without an EOS token it runs to ``max_new_tokens``."""
    config = pipe.get_generation_config()
    config.do_sample = False
    config.num_return_sequences = 1
    config.max_new_tokens = int(generate_kwargs["max_new_tokens"])
    config.stop_strings = set()
    eos = generate_kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if eos:
        config.ignore_eos = False
        config.eos_token_id = int(eos[0])
        config.stop_token_ids = {int(e) for e in eos}
        config.min_new_tokens = int(generate_kwargs.get("min_new_tokens") or 0)
    else:  # ignore_eos: no token stops it; a valid id is still required where the folder's config has none (-1)
        config.ignore_eos = True
        config.eos_token_id = 0
        config.stop_token_ids = {0}
        config.min_new_tokens = 0
    return config


def greedy_tokens(pipe, input_ids: torch.Tensor, config) -> tuple[torch.Tensor, float]:
    """One timed ``pipe.generate`` on token ids (no tokenizer, no chat template: the prompt the other methods get);
    returns the new tokens and the call's seconds."""
    import numpy as np
    import openvino

    genai = require_genai()
    ids = input_ids.detach().cpu().to(torch.int64).numpy()
    inputs = genai.TokenizedInputs(openvino.Tensor(ids), openvino.Tensor(np.ones_like(ids)))
    start = time.perf_counter()
    result = pipe.generate(inputs, config)
    seconds = time.perf_counter() - start
    return torch.tensor(list(result.tokens[0]), dtype=torch.long), seconds
