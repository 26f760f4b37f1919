"""Resumable folders of validated JSONL chunks, shared by the long data jobs (``train regenerate``, ``train c2t-data``).

A job cuts its work into chunks of a fixed number of prompts; each chunk is one JSONL file (a record per line, then a
footer line counting them) written to a hidden temporary name, fsynced and renamed into place, so an interruption loses
at most the chunk in progress. A rerun with the same settings skips every chunk that validates and redoes the others;
a chunk that fails validation is kept aside as ``*.corrupt`` (never silently deleted), and reading it raises a
:class:`CorruptChunkError` naming the file and the command that redoes it. The job's settings are saved beside the
chunks, so a rerun with other settings is refused instead of mixing two datasets.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

CHUNK_PREFIX = "chunk-"
CHUNK_SUFFIX = ".jsonl"
FOOTER_KEY = "chunk_footer"


class CorruptChunkError(ValueError):
    """A chunk file that is not a complete chunk (the message names the file and the fix)."""


@dataclass(frozen=True)
class ChunkFolder:
    """The chunks of one job in ``path``; ``command`` (e.g. ``"train regenerate"``) is what the errors tell the user to
    rerun, ``config_file`` where the job's settings are kept."""

    path: Path
    command: str
    config_file: str

    def chunk_path(self, index: int) -> Path:
        return self.path / f"{CHUNK_PREFIX}{index:05d}{CHUNK_SUFFIX}"

    def chunks(self) -> list[Path]:
        return sorted(self.path.glob(f"{CHUNK_PREFIX}*{CHUNK_SUFFIX}"))

    def read(self, path: Path) -> list[dict[str, Any]]:
        """The records of a finished chunk file; a CorruptChunkError naming the file when it is not complete."""
        return read_chunk_with_footer(path, self.command)[0]

    def finished_prompts(self, path: Path) -> int | None:
        """Prompts a valid finished chunk covers; None when the chunk is missing or invalid."""
        if not path.is_file():
            return None
        try:
            return read_chunk_with_footer(path, self.command)[1].get("prompts")
        except CorruptChunkError:
            return None

    def set_aside(self, path: Path) -> str | None:
        """Before redoing ``path``: a corrupt chunk is renamed ``*.corrupt`` and its error returned; a valid one (cut
        short by an earlier, smaller run) is left to be replaced and None returned."""
        try:
            self.read(path)
        except CorruptChunkError as error:
            aside = path.with_name(path.name + ".corrupt")
            os.replace(path, aside)
            return f"{error} -- redoing it now (the bad file is kept as {aside.name})."
        return None

    def check_or_write_config(self, config: dict[str, Any]) -> None:
        """Saves the job's settings on the first run; refuses a rerun whose settings differ."""
        self.path.mkdir(parents=True, exist_ok=True)
        file = self.path / self.config_file
        current = json.loads(json.dumps(config))
        if file.is_file():
            saved = json.loads(file.read_text())
            if saved != current:
                diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
                raise ValueError(f"{self.path} was written by `{self.command}` with different settings {diff} (saved, "
                                 "now); use another --output or the same settings to resume.")
            return
        file.write_text(json.dumps(current, indent=2) + "\n")

    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Every record of the folder, chunks in order, each chunk validated as it is read."""
        if not (self.path / self.config_file).is_file():
            raise FileNotFoundError(f"{self.path} is not a `hf-treespec {self.command}` folder (no "
                                    f"{self.config_file}).")
        chunks = self.chunks()
        if not chunks:
            raise ValueError(f"{self.path} holds no finished chunks yet; run `hf-treespec {self.command}` first.")
        for chunk in chunks:
            yield from self.read(chunk)


def read_chunk_with_footer(path: Path, command: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(records, footer) of a chunk file, or a CorruptChunkError naming it and saying how to redo it."""
    fix = f"rerun `hf-treespec {command}` with the same --output ({path.parent}) to redo it; finished chunks are kept"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise CorruptChunkError(f"chunk file {path} is not UTF-8 text ({error}); {fix}.") from None
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise CorruptChunkError(f"chunk file {path} is truncated or corrupt: line {number} is not JSON "
                                    f"({error.msg}); {fix}.") from None
    footer = records.pop()[FOOTER_KEY] if records and isinstance(records[-1], dict) and FOOTER_KEY in records[-1] \
        else None
    if footer is None:
        raise CorruptChunkError(f"chunk file {path} is truncated: its footer line is missing; {fix}.")
    if footer.get("records") != len(records):
        raise CorruptChunkError(f"chunk file {path} is truncated or corrupt: its footer counts {footer.get('records')}"
                                f" records, the file holds {len(records)}; {fix}.")
    return records, footer


def write_chunk(path: Path, records: list[dict[str, Any]], index: int, prompts: int) -> None:
    """Writes a complete chunk atomically (temporary name, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    footer = {FOOTER_KEY: {"index": index, "prompts": prompts, "records": len(records)}}
    with tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
        handle.write(json.dumps(footer) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def batched(iterable: Iterable, size: int) -> Iterator[list]:
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
