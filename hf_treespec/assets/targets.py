"""Target models by short name: a GGUF inside a wheel, dequantised once into a cached safetensors folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..paths import default_cache_dir
from .packaged import TARGETS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


_PROVENANCE_FILE = "hf_treespec_conversion.json"


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
        # some transformers releases read the GGUF tokenizer's eos differently from its model metadata; the model's
        # (the chat turn end) is the one generation must stop at, and the tokenizer is told so
        token = tokenizer.convert_ids_to_tokens(int(config.eos_token_id))
        if token is None:
            raise ValueError(f"Model eos_token_id {config.eos_token_id} is not in the tokenizer's vocabulary")
        logger.warning("The converted tokenizer's eos %s disagrees with the model's eos_token_id %s (%r); using the "
                       "model's.", eos_id, config.eos_token_id, token)
        tokenizer.eos_token = token
        eos_id = int(config.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return generation_config_cls(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False
    )
