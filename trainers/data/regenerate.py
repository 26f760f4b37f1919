"""Self-distilled training data: the target answers ShareGPT prompts itself (``hf-treespec train regenerate``).

A drafter is scored on what the *target* says next, but ShareGPT's answers were written by another model; training on
the target's own answers (EAGLE / HASS / EAGLE-3 all do) removes that mismatch. The target answers the first user turn
of each ShareGPT *train* record with batched, left-padded ``generate``, once per temperature (``0`` = greedy, e.g.
``0.8`` = a sampled variant), and the answers are written to disk in resumable chunks::

    <output>/regenerate_config.json   settings; a rerun must use the same ones (only --num-prompts may change)
    <output>/chunk-00000.jsonl         one answer per line for chunk_size prompts x temperatures, then a footer line
    <output>/chunk-00001.jsonl ...

A chunk is written to a hidden temporary name and renamed into place when complete, so a crash loses at most the
chunk in progress. A rerun skips every chunk that validates and redoes the others; a chunk that fails validation
(truncated by a full disk or a bad copy) is renamed to ``*.corrupt`` and regenerated, while :func:`read_chunk` (and so
``train prepare``) refuses it with an error naming the file.

Each answer record keeps the exact token ids (``prompt_ids`` = the chat-templated prompt with its generation header,
``output_ids`` = the answer, ending with the EOS token when the target stopped by itself), because re-tokenizing
decoded text need not give back the ids the target produced. ``messages`` holds the same exchange as text for other
tools. ``train prepare --data-file <output>`` reads the folder: the prompt is context, the answer is scored.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from tqdm.auto import tqdm

from hf_treespec.api import (
    AUTO_DTYPE, AUTO_DTYPE_HELP, DTYPE_CHOICES, DTYPES, resolve_dtype_name, ExamplesHelpFormatter, add_options,
    build_config, comma_list, option,
)

from .chunks import CHUNK_PREFIX, ChunkFolder, CorruptChunkError, batched, read_chunk_with_footer, write_chunk

__all__ = ["CHUNK_PREFIX", "CONFIG_FILE", "CorruptChunkError", "RegenerateConfig", "first_turn_prompts",
           "iter_regenerated", "read_chunk", "regenerate"]

CONFIG_FILE = "regenerate_config.json"


@dataclass
class RegenerateConfig:
    """What ``regenerate`` produces. Saved next to the chunks; a rerun must use the same values.

    Args:
        temperatures: one answer per prompt and temperature; ``0`` is greedy, ``> 0`` samples at that temperature
            (no top-k / top-p: the drafter should see the target's own distribution).
        max_new_tokens: answer length cap (answers cut there get ``finish_reason="length"``).
        max_prompt_tokens: prompts whose chat-templated ids are longer are skipped (a rule fixed before any result).
        chunk_size: prompts per chunk file (the unit of resumption).
        batch_size: sequences per ``generate`` call (prompts of similar length are batched together).
        split / skip: ShareGPT split the prompts come from (``train``; ``dev`` only for evaluation data) and records
            skipped at its start.
        seed: sampling seed; each chunk and temperature reseeds from it, so a redone chunk samples the same way.
        target / dtype: recorded for provenance (the model passed in is what runs).
    """

    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.8], metadata=option(
        "comma list: one answer per prompt and temperature (0 = greedy)", flag="--temperature",
        parse=comma_list(float), metavar="T1,T2,.."))
    max_new_tokens: int = field(default=512, metadata=option("answer length cap"))
    max_prompt_tokens: int = field(default=1024, metadata=option("skip prompts longer than this"))
    chunk_size: int = field(default=64, metadata=option("prompts per resumable chunk file"))
    batch_size: int = field(default=16, metadata=option("sequences per generate call"))
    split: str = field(default="train", metadata=option("ShareGPT split of the prompts", choices=("train", "dev")))
    skip: int = field(default=0, metadata=option(
        "skip the first N records of the split (records, usable or not: to continue after a run, pass its summary's "
        "next_skip)"))
    seed: int = field(default=0, metadata=option("sampling seed"))
    target: str = field(default="", metadata=option("recorded: the target that answered", hidden=True))
    dtype: str = field(default="", metadata=option("recorded: its dtype", hidden=True))

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in self.temperatures]
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {self.temperatures}.")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise ValueError(f"temperatures must be distinct, got {self.temperatures}.")
        for name in ("max_new_tokens", "max_prompt_tokens", "chunk_size", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.skip < 0:
            raise ValueError(f"skip must be >= 0, got {self.skip}.")
        if self.split not in ("train", "dev"):
            raise ValueError(f"split must be 'train' or 'dev' (the reserved records are never used), got "
                             f"{self.split!r}.")


@dataclass
class Prompt:
    """One chat-templated first turn: where it came from, its messages and token ids."""

    source_index: int
    source_id: str
    messages: list[dict[str, str]]
    ids: list[int]


# ------------------------------------------------------------------------------------------------------ prompts
def first_turn_prompts(tokenizer, records: Iterable[Mapping[str, Any]], max_prompt_tokens: int,
                       start_index: int = 0) -> Iterator[Prompt]:
    """First user turn of each record (ShareGPT or message list), chat-templated with the generation header; records
    without a user first turn, and prompts longer than ``max_prompt_tokens`` ids, are skipped."""
    from .chat import to_messages

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; regenerate prompts the target through its template.")
    for index, record in enumerate(records, start=start_index):
        messages = to_messages(record, require_answer=False)
        if not messages or messages[0]["role"] == "assistant":
            continue
        first = list(itertools.takewhile(lambda m: m["role"] != "assistant", messages))
        if first[-1]["role"] != "user":
            continue
        text = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or len(ids) > max_prompt_tokens:
            continue
        source_id = str(record.get("id", index)) if isinstance(record, Mapping) else str(index)
        yield Prompt(source_index=index, source_id=source_id, messages=first, ids=list(ids))


# ------------------------------------------------------------------------------------------------------ chunks
COMMAND = "train regenerate"


def _folder(output_dir: Path) -> ChunkFolder:
    return ChunkFolder(Path(output_dir), COMMAND, CONFIG_FILE)


def chunk_path(output_dir: Path, index: int) -> Path:
    return _folder(output_dir).chunk_path(index)


def read_chunk(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The answer records of a finished chunk file; a CorruptChunkError naming the file when it is not complete."""
    return read_chunk_with_footer(Path(path), COMMAND)[0]


def iter_regenerated(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every answer record of a ``regenerate`` folder (chunks in order) or of one chunk file."""
    path = Path(path)
    if path.is_file():
        yield from read_chunk(path)
        return
    yield from _folder(path).iter_records()


# -------------------------------------------------------------------------------------------------- regenerate
@dataclass
class RegenerateStats:
    """What one ``regenerate`` call did: chunks written / skipped / redone and generated tokens per second."""

    written: int = 0
    skipped: int = 0
    redone: list[str] = field(default_factory=list)
    answers: int = 0
    tokens: int = 0
    seconds: float = 0.0
    next_skip: int | None = None  # the ``skip`` that continues after the last prompt covered (records, not prompts)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def regenerate(
    model,
    tokenizer,
    prompts: Iterable[Prompt],
    output_dir: str | os.PathLike,
    config: RegenerateConfig | None = None,
    *,
    num_prompts: int | None = None,
    progress: bool = True,
) -> RegenerateStats:
    """Writes the target's answers to the first ``num_prompts`` prompts (all with None) into ``output_dir`` in
    resumable chunks (see the module docstring) and returns what was done."""
    config = config or RegenerateConfig()
    folder = _folder(Path(output_dir))
    folder.check_or_write_config(asdict(config))
    eos = _eos_ids(model, tokenizer)
    pad = _pad_id(model, tokenizer, eos)
    selected = prompts if num_prompts is None else itertools.islice(prompts, num_prompts)
    total = None if num_prompts is None else num_prompts * len(config.temperatures)
    stats = RegenerateStats()
    bar = tqdm(total=total, desc="regenerate", unit="answer", disable=not progress)
    try:
        for index, chunk in enumerate(batched(selected, config.chunk_size)):
            stats.next_skip = chunk[-1].source_index + 1
            path = folder.chunk_path(index)
            if folder.finished_prompts(path) == len(chunk):
                stats.skipped += 1
                bar.update(len(chunk) * len(config.temperatures))
                continue
            if path.is_file() and (message := folder.set_aside(path)):
                stats.redone.append(path.name)
                tqdm.write(message)
            records = _answer_chunk(model, chunk, index, config, eos, pad, stats, bar)
            write_chunk(path, records, index, len(chunk))
            stats.written += 1
    finally:
        bar.close()
    return stats


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def _pad_id(model, tokenizer, eos: list[int]) -> int:
    for candidate in (getattr(model.generation_config, "pad_token_id", None), tokenizer.pad_token_id):
        if candidate is not None:
            return int(candidate)
    if eos:
        return eos[0]
    raise ValueError("batched generation needs a pad token: the target has neither a pad nor an eos token id.")


def _answer_chunk(model, chunk: list[Prompt], index: int, config: RegenerateConfig, eos: list[int], pad: int,
                  stats: RegenerateStats, bar) -> list[dict[str, Any]]:
    """Every answer of one chunk, in (prompt, temperature) order whatever the batching."""
    answers: dict[tuple[int, int], dict[str, Any]] = {}
    order = sorted(range(len(chunk)), key=lambda i: -len(chunk[i].ids))  # similar lengths share a batch
    for t_index, temperature in enumerate(config.temperatures):
        generator_seed = (config.seed * 1_000_003 + index) * 101 + t_index
        torch.manual_seed(generator_seed)
        for start in range(0, len(order), config.batch_size):
            batch = [chunk[i] for i in order[start : start + config.batch_size]]
            began = time.perf_counter()
            outputs = _generate(model, batch, temperature, config.max_new_tokens, eos, pad)
            stats.seconds += time.perf_counter() - began
            for prompt, (output, finish) in zip(batch, outputs):
                answers[(prompt.source_index, t_index)] = _record(prompt, output, finish, temperature, generator_seed)
                stats.tokens += len(output)
                stats.answers += 1
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats.tokens_per_second:.1f}", chunks=f"{stats.written}+{stats.skipped}")
    return [answers[(prompt.source_index, t)] for prompt in chunk for t in range(len(config.temperatures))]


@torch.no_grad()
def _generate(model, batch: list[Prompt], temperature: float, max_new_tokens: int, eos: list[int],
              pad: int) -> list[tuple[list[int], str]]:
    """Left-padded batched ``generate``; per prompt the answer ids (through the first EOS) and why it ended."""
    device = next(model.parameters()).device
    width = max(len(p.ids) for p in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention = torch.zeros(len(batch), width, dtype=torch.long)
    for row, prompt in enumerate(batch):
        input_ids[row, width - len(prompt.ids):] = torch.tensor(prompt.ids)
        attention[row, width - len(prompt.ids):] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) if temperature > 0 \
        else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                         max_new_tokens=max_new_tokens, min_new_tokens=None, pad_token_id=pad,
                         eos_token_id=eos or None, **sampling)
    results = []
    for row in out[:, width:].tolist():
        stop = next((i for i, token in enumerate(row) if token in eos), None)
        results.append((row[: stop + 1], "eos") if stop is not None else (row, "length"))
    return results


def _record(prompt: Prompt, output: list[int], finish: str, temperature: float, seed: int) -> dict[str, Any]:
    tag = "greedy" if temperature == 0 else f"t{temperature:g}"
    return {
        "id": f"{prompt.source_id}:{tag}", "source_index": prompt.source_index, "source_id": prompt.source_id,
        "turn": 1, "temperature": temperature, "seed": seed, "finish_reason": finish,
        "prompt_ids": prompt.ids, "output_ids": output, "messages": prompt.messages,
    }


# ------------------------------------------------------------------------------------------------- command line
@dataclass
class RegenerateArguments:
    """What ``hf-treespec train regenerate`` needs besides :class:`RegenerateConfig`."""

    target: str = field(default="smollm2-135m-instruct", metadata=option(
        "target model: asset short name, checkpoint folder or .gguf file"))
    dtype: str = field(default=AUTO_DTYPE, metadata=option(f"target dtype; {AUTO_DTYPE_HELP}", choices=DTYPE_CHOICES))
    device: str = field(default="auto", metadata=option("'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1' ..."))
    num_prompts: int = field(default=1000, metadata=option("prompts to answer (0 = the whole split)"))
    output: str = field(default="runs/regen/train", metadata=option(
        "output folder (rerun the same command to resume)"))
    threads: int | None = field(default=None, metadata=option("torch.set_num_threads (default: torch's)"))
    no_progress: bool = field(default=False, metadata=option("hide the progress bar"))


#: ``hf-treespec train regenerate --help``
REGENERATE_DESCRIPTION = """\
The target answers the first user turn of ShareGPT train prompts itself (self-distilled data: a drafter is scored on
what the target says next). Batched, left-padded generate, once per temperature (0 = greedy). Written as

  <output>/regenerate_config.json   the settings; a rerun must use the same ones (only --num-prompts may change)
  <output>/chunk-00000.jsonl ...    one answer per line, then a footer line

A chunk is written under a temporary name and renamed when complete: rerun the same command to resume; a chunk that
fails validation is renamed *.corrupt and regenerated. Feed the folder to `hf-treespec train prepare --data-file`.
"""


def add_regenerate_parser(commands) -> argparse.ArgumentParser:
    """``hf-treespec train regenerate`` (added to the ``train`` subcommands by :mod:`.cli`)."""
    p = commands.add_parser("regenerate", help="the target answers ShareGPT train prompts itself (self-distilled "
                                               "data for `train prepare --data-file`)",
                            description=REGENERATE_DESCRIPTION,
                            formatter_class=ExamplesHelpFormatter)
    add_options(p, RegenerateConfig, RegenerateArguments)
    p.set_defaults(handler=run_regenerate)
    return p


def run_regenerate(args: argparse.Namespace) -> int:
    from hf_treespec.api import iter_sharegpt, load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.num_prompts < 0:
        raise ValueError(f"--num-prompts must be >= 0 (0 = the whole split), got {args.num_prompts}.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    args.dtype = resolve_dtype_name(args.dtype, device)
    config = build_config(RegenerateConfig, args, target=args.target, dtype=args.dtype)
    model, tokenizer = load_target(args.target, dtype=DTYPES[args.dtype])
    model.to(device)
    records = itertools.islice(iter_sharegpt(args.split), args.skip, None)
    prompts = first_turn_prompts(tokenizer, records, args.max_prompt_tokens, start_index=args.skip)
    start = time.perf_counter()
    stats = regenerate(model, tokenizer, prompts, args.output, config, num_prompts=args.num_prompts or None,
                       progress=not args.no_progress)
    summary = {"output": str(args.output), "chunks_written": stats.written, "chunks_skipped": stats.skipped,
               "chunks_redone": stats.redone, "next_skip": stats.next_skip, "answers": stats.answers,
               "new_tokens": stats.tokens,
               "generate_seconds": round(stats.seconds, 3), "tokens_per_s": round(stats.tokens_per_second, 1),
               "seconds": round(time.perf_counter() - start, 1), "device": device, "dtype": args.dtype}
    print(json.dumps(summary))
    return 0
