"""Every speedup and acceptance length (tau) the documents print comes from a committed run under docs/results/.

Figures: speedups (``1.46x``, a range ``1.94-1.96x``, ``54% faster``) and taus (``tau 2.35``, ``tau = 2.04``,
``τ 1.9``, ``tau 3.98 / 3.94``, ``tau from 1.41 to 1.49``, any other decimal later in a sentence that names tau unless
a unit follows it; in tables, numbers of two or more decimals in a column headed "tau", a row labelled "tau", or any
column of a table whose caption names tau while its header does not).

Also checked: **bare figures** in prose, a decimal of two or more places that no word marks as a speedup or a tau
("static 2.07, dyspec 1.87"; unless a unit follows it, it is a version after "transformers" / "torch" / "Python",
an arXiv number, a setting after "=", or a paper's), which must be a number of any kind in the cited results; and
**rates** ``a/b`` with a <= b, in prose and tables ("7/40 rows identical"), which must be a pair of the cited results
(``identical`` / ``identical_eager`` over ``compared`` in ``.json``, or the same ``a/b`` printed in a ``.md`` or
``.txt`` file). Numbers in inline code (``tree_budget=4``, ``(0.9, 0.95)``) are settings and are not read.

Sources: the result paths a figure's section (heading to next heading) cites, as a path or link ``docs/results/...``
or a declaration ``<!-- results: docs/results/a docs/results/b -->``. The figure must be a number of its kind in
those files at its printed precision (1.46 accepts 1.4612, not 1.47): in ``.json`` a value under a key naming the
kind ("speedup*"; "tau*" / "*accept*"), in ``.md`` what this module reads as that kind, in ``.txt`` logs "1.05x" for
a speedup and the numbers of a line that names tau or a paired "+-" for a tau; per-question ``.jsonl`` logs are not
read. Every cited path must exist and name its machine, date, commit and command (a ``summary.json`` with
``settings``, or a README / commands file in or above it). A failure names ``document:line: figure``.

Not speed results, so not checked: a multiplier followed by a size or cost (``_NOT_A_SPEEDUP``: "10x the data",
"2x cheaper", "1.3x a one-token step", "4x more"; but "0.5x of plain" is a speedup), and what a paper reports (table
columns headed "paper"; figures after "paper:" / "Paper (model, GPU):" up to the sentence's end). Pure text: no
models, runs in seconds. It reads figures by how they are written: a one-decimal bare number ("2.4 nodes") is not
read, so write "tau 2.4" or put it in a tau column when it is a result.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

from hf_treespec.benchmark.summary import MIN_REPEATS  # a speedup is quoted from medians of this many

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "model_cards").glob("*.md")),
             *sorted((ROOT / "hf_treespec" / "assets_data" / "drafters").glob("*/README.md"))]


#: documents whose bare figures and rates are not checked (their speedups and taus are): a log of runs as they were
#: made, many without committed raw outputs; it records what was seen then, it claims nothing about today's code
LOGS = {"docs/history.md"}

_NUMBER = r"\d+(?:\.\d+)?"
SPEEDUP = re.compile(rf"(?<![\w.+])(?:({_NUMBER})\s*-\s*)?({_NUMBER})x(?![\w])")
SPEED_PERCENT = re.compile(rf"(?<![\w.+])({_NUMBER})% (?:faster|slower)\b")
TAU = re.compile(rf"(?:\btau\b|τ)\s*(?:[=:≈~]\s*|(?:of|from|rose to|fell to)\s+)?(?:\*\*)?~?"
                 rf"({_NUMBER}(?:(?:\*\*)?\s*(?:/|->|→|vs\.?|to|against)\s*(?:\*\*)?{_NUMBER}(?![\w%]))*)",
                 re.IGNORECASE)
# The words after a multiplier that make it a size or a cost, not a speed result.
_NOT_A_SPEEDUP = re.compile(
    r"\s*(?:(?:of|the|these|this|today's)\b(?!\s+(?:plain|`?generate|compiled|baseline|speed))|more|fewer|less|"
    r"larger|smaller|longer|shorter|cheaper|dearer|data|tokens?|steps?|rows?|nodes?|training|compute|"
    r"(?:(?:a|one)\s+)?(?:compiled\s+|eager\s+)?one-token|\(paper)\b", re.IGNORECASE)
# "paper: 2.10x / 2.33x" or "Paper (Llama-3.1-8B, A100): tau 3.98": a paper's figures, up to the sentence's end or ";".
_PAPER_BEFORE = re.compile(r"\bpaper(?:'s)?(?: \([^()]*\))?:(?:[^;.]|\.(?=\d))*$", re.IGNORECASE)
_UNIT = r"\s*(?:ms|s\b|%|M\b|k\b|GB|MB|KB|tokens?|nodes?|rows?|steps?|epochs?|x|points?|h\b|min|questions|q\b)"
_DECIMAL = re.compile(rf"(?<![\w.+\-])(\d+\.\d+)(?![\w.%])(?!{_UNIT})")
# A bare figure: a decimal of two or more places, not inside a word, a path, a version or a range's other end.
_BARE = re.compile(r"(?<![\w.+\-/:])(\d+\.\d{2,})(?![\w%/]|\.\w|-\d)")
_NOT_A_FIGURE_BEFORE = re.compile(r"(?:\b(?:transformers|torch|python|version|release)\s*[<>=~]*|arXiv:|[=<]|(?<!-)>|\bv)\s*$",
                                  re.IGNORECASE)
# A rate a/b (a <= b is checked later): not part of a path, a date or a longer fraction.
_RATE = re.compile(r"(?<![\w./\-])(\d+)/(\d+)(?![\w./\-])")
_CODE_SPAN = re.compile(r"`[^`]*`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
DECLARATION = re.compile(r"<!--\s*results:\s*([^>]*?)\s*-->")
CITED = re.compile(r"(?:docs/results/|\]\((?:\.\./)*(?:docs/)?results/)([\w.@=/+-]*[\w@=+-])")
HEADING = re.compile(r"^#{1,6} ")
FENCE = re.compile(r"^\s*```")


@dataclass(frozen=True)
class Figure:
    document: str
    line: int
    kind: str  # "speedup", "tau", "figure" (a bare decimal: any kind) or "rate" (a/b)
    text: str  # as printed, e.g. "1.46"
    sources: tuple[str, ...]  # paths relative to docs/results

    def where(self) -> str:
        return f"{self.document}:{self.line}: {self.kind} {self.text}"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _is_table_rule(line: str) -> bool:
    return bool(re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*", line.strip()))


def _sections(lines: list[str]) -> list[tuple[int, int]]:
    """[start, end) line ranges from one heading to the next (headings inside code fences do not count)."""
    starts, fenced = [0], False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and HEADING.match(line) and i:
            starts.append(i)
    return list(zip(starts, [*starts[1:], len(lines)]))


def _sources(text: str) -> tuple[str, ...]:
    found = [match.group(1) for match in CITED.finditer(text) if text[match.end():match.end() + 1] != "<"]
    for declaration in DECLARATION.finditer(text):
        found += [path.removeprefix("docs/results/").removeprefix("results/").rstrip("/")
                  for path in declaration.group(1).split()]
    return tuple(dict.fromkeys(path.rstrip("/.") for path in found))


def _speedups(line: str, following: str = "") -> list[str]:
    """The speedups of a line; ``following``: the next line of its paragraph (the words after a multiplier may wrap)."""
    figures, paragraph = [], f"{line} {following}"
    for match in SPEEDUP.finditer(line):
        if _NOT_A_SPEEDUP.match(paragraph, match.end()) or _PAPER_BEFORE.search(line[:match.start()]):
            continue
        figures += [number for number in match.groups() if number]
    return figures + [match.group(1) for match in SPEED_PERCENT.finditer(line)]


def _taus(line: str) -> list[str]:
    """``tau 2.35`` and its chains, and every other decimal after "tau" up to the end of its sentence ("tau on 10
    answers (1.35 vs 1.38)") unless a unit follows it (ms, %, tokens, nodes...)."""
    found = {}
    for match in TAU.finditer(line):
        if not _PAPER_BEFORE.search(line[:match.start()]):
            found.update((match.start(1) + number.start(), number.group())
                         for number in re.finditer(_NUMBER, match.group(1)))
    for word in re.finditer(r"\btau\b|τ", line, re.IGNORECASE):
        sentence = re.split(r"(?<=[.;])\s", line[word.end():])[0]
        if not _PAPER_BEFORE.search(line[:word.start()]):
            found.update((word.end() + number.start(1), number.group(1)) for number in _DECIMAL.finditer(sentence))
    return [text for _, text in sorted(found.items())]


def _blanked(line: str) -> str:
    """``line`` with inline code and link targets blanked out (same length): settings and URLs, never figures."""
    line = _CODE_SPAN.sub(lambda match: " " * len(match.group()), line)
    return _LINK_TARGET.sub(lambda match: "]" + " " * (len(match.group()) - 1), line)


def _claimed_spans(line: str) -> list[tuple[int, int]]:
    """Where a line's speedups and taus sit (their matches, and a tau's sentence): no bare figure is read there."""
    spans = [match.span() for pattern in (SPEEDUP, SPEED_PERCENT, TAU) for match in pattern.finditer(line)]
    for word in re.finditer(r"\btau\b|τ", line, re.IGNORECASE):
        sentence = re.split(r"(?<=[.;])\s", line[word.end():])[0]
        spans.append((word.start(), word.end() + len(sentence)))
    return spans


def _bare(line: str, preceding: str = "") -> list[str]:
    """The bare figures of a prose line (module docstring); ``preceding``: its paragraph's earlier lines (a paper's
    figures may follow a "Paper (...):" that a line break split from them)."""
    text = _blanked(line)
    claimed = _claimed_spans(text)
    found = []
    for match in _BARE.finditer(text):
        start = match.start()
        if any(a <= start < b for a, b in claimed) or re.match(_UNIT, text[match.end():]):
            continue
        if _NOT_A_FIGURE_BEFORE.search(text[:start]) or _PAPER_BEFORE.search(f"{preceding} {text[:start]}"):
            continue
        found.append(match.group(1))
    return found


def _rates(line: str, preceding: str = "") -> list[str]:
    """The rates ``a/b`` (a <= b) of a line outside inline code and links, a paper's excepted."""
    text = _blanked(line)
    return [match.group() for match in _RATE.finditer(text) if int(match.group(1)) <= int(match.group(2))
            and not _PAPER_BEFORE.search(f"{preceding} {text[:match.start()]}")]


def _figures_of_line(line: str, header: list[str] | None, following: str = "", tau_table: bool = False,
                     preceding: str = "", prose: bool = True) -> list[tuple[str, str]]:
    """(kind, text) of every figure a line prints; ``header`` is the header row of the table the line belongs to,
    ``tau_table``: the paragraph above it names tau and no header cell does (then every non-label column may);
    ``preceding``: the paragraph's earlier lines; ``prose``: False inside a code fence (no bare figure or rate
    there: commands and their settings)."""
    if header is None:
        found = [("speedup", text) for text in _speedups(line, following)] + [("tau", text) for text in _taus(line)]
        if prose:
            found += [("figure", text) for text in _bare(line, preceding)]
            found += [("rate", text) for text in _rates(line, preceding)]
        return found
    figures, cells = [], _cells(line)
    tau_row = bool(re.search(r"\btau\b|τ", cells[0], re.IGNORECASE))
    for column, (name, cell) in enumerate(zip(header, cells)):
        if "paper" in name.lower():
            continue
        found = [("speedup", text) for text in _speedups(cell)] + [("tau", text) for text in _taus(cell)]
        if re.search(r"\btau\b|τ", name, re.IGNORECASE) or ((tau_row or tau_table) and column):
            found += [("tau", text) for text in re.findall(r"(?<![\w.+])(\d+\.\d\d+)(?![\w.%])", cell)]
        figures += dict.fromkeys(found)  # a tau the cell also prints as "tau 2.04" counts once
        figures += [("rate", text) for text in _rates(cell)]
    return figures


def _lead_in(lines: list[str], table_start: int) -> str:
    """The paragraph right above a table (its caption, in this project's documents)."""
    end = table_start
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    start = end
    while start > 0 and lines[start - 1].strip() and not lines[start - 1].startswith(("#", "|", "```")):
        start -= 1
    return " ".join(lines[start:end])


def figures(path: Path, text: str | None = None) -> list[Figure]:
    """Every speedup and tau a document prints, with the result paths its section cites."""
    lines = (path.read_text() if text is None else text).splitlines()
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    found = []
    for start, end in _sections(lines):
        sources = _sources("\n".join(lines[start:end]))
        header, tau_table, fenced, paragraph = None, False, False, []
        for i in range(start, end):
            line = lines[i]
            if FENCE.match(line):
                fenced = not fenced
            preceding = " ".join(paragraph)
            paragraph = [] if not line.strip() or FENCE.match(line) else [*paragraph, line]
            if line.lstrip().startswith("|"):
                if header is None and i + 1 < end and _is_table_rule(lines[i + 1]):
                    header = _cells(line)
                    tau_table = not any(re.search(r"\btau\b|τ", cell, re.I) for cell in header) and bool(
                        re.search(r"\btau\b|τ", _lead_in(lines, i), re.I))
                    continue
                if _is_table_rule(line):
                    continue
            else:
                header = None
            following = lines[i + 1] if i + 1 < end and header is None else ""
            for kind, figure in _figures_of_line(line, header, following, tau_table, preceding,
                                                 prose=not fenced and not FENCE.match(line)):
                if kind in ("figure", "rate") and name in LOGS:
                    continue
                found.append(Figure(name, i + 1, kind, figure, sources))
    return found


def _paths(source: str) -> list[Path]:
    """The committed paths a citation names: the path itself, or ``name.*`` for ``docs/results/a/name.{json,png}``."""
    path = RESULTS / source
    return [path] if path.exists() else sorted(path.parent.glob(f"{path.name}.*")) if path.parent.is_dir() else []


def _json_values(node, kind: str, key: str = "") -> list[float]:
    """The numbers of a JSON tree stored under a key that names the kind ("speedup*"; "tau*" or "*accept*")."""
    if isinstance(node, dict):
        return [value for name, child in node.items() for value in _json_values(child, kind, str(name))]
    if isinstance(node, list):
        return [value for child in node for value in _json_values(child, kind, key)]
    if kind == "figure":
        wanted = True
    elif kind == "speedup":
        wanted = "speedup" in key.lower()
    else:
        wanted = bool(re.search(r"tau|accept", key, re.IGNORECASE))
    return [float(node)] if wanted and isinstance(node, (int, float)) and not isinstance(node, bool) else []


@lru_cache(maxsize=None)
def _numbers(source: str, kind: str) -> tuple[float, ...]:
    """The figures of one kind in the committed files of one result path (a folder: every file below it): in JSON the
    values under a key naming the kind, in Markdown what this module reads as that kind, in text logs every number."""
    files = [file for path in _paths(source) for file in (sorted(path.rglob("*")) if path.is_dir() else [path])]
    values = []
    for file in files:
        if not file.is_file():
            continue
        if file.suffix == ".json":
            values += _json_values(json.loads(file.read_text()), kind)
        elif kind == "figure" and file.suffix in (".md", ".txt"):  # a bare figure: any number printed there
            values += [float(number) for number in re.findall(_NUMBER, file.read_text())]
        elif file.suffix == ".md":
            values += [float(text) for found, text in
                       ((figure.kind, figure.text) for figure in figures(file)) if found == kind]
        elif file.suffix == ".txt":  # logs: a speedup prints "1.05x"; a tau line names tau or a paired "+-"
            for line in file.read_text().splitlines():
                if kind == "speedup":
                    values += [float(number) for number in re.findall(rf"({_NUMBER})x\b", line)]
                elif re.search(r"\btau\b|\+-", line):
                    values += [float(number) for number in re.findall(_NUMBER, line)]
    return tuple(values)


def _json_rates(node) -> list[str]:
    """``identical/compared`` (and ``identical_eager/compared``) of every JSON object that counts identical rows."""
    if isinstance(node, list):
        return [rate for child in node for rate in _json_rates(child)]
    if not isinstance(node, dict):
        return []
    found = [rate for child in node.values() for rate in _json_rates(child)]
    compared = node.get("compared")
    if isinstance(compared, int):
        found += [f"{node[key]}/{compared}" for key in ("identical", "identical_eager") if isinstance(node.get(key), int)]
    return found


@lru_cache(maxsize=None)
def _rates_of(source: str) -> frozenset[str]:
    """The rates ``a/b`` of one result path: counted pairs in ``.json``, printed ``a/b`` in ``.md`` / ``.txt``."""
    files = [file for path in _paths(source) for file in (sorted(path.rglob("*")) if path.is_dir() else [path])]
    rates = set()
    for file in files:
        if file.is_file() and file.suffix == ".json":
            rates.update(_json_rates(json.loads(file.read_text())))
        elif file.is_file() and file.suffix in (".md", ".txt"):
            rates.update(match.group() for match in _RATE.finditer(file.read_text()))
    return frozenset(rates)


def matches(figure: str, values: tuple[float, ...]) -> bool:
    """True when one of ``values`` prints as ``figure`` at its precision (1.46 takes 1.4612; 2 takes 2.4)."""
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    target, half = float(figure), 0.5 * 10 ** -decimals + 1e-9
    return any(abs(value - target) <= half for value in values)


def check(figure: Figure) -> str | None:
    """Why a figure is not backed by a committed result, or None."""
    if not figure.sources:
        return (f"{figure.where()} has no source: cite its run in the section (a path docs/results/...) or declare "
                f"one above it (<!-- results: docs/results/RUN -->), or remove the figure")
    missing = [source for source in figure.sources if not _paths(source)]
    if missing:
        return f"{figure.where()}: its section cites {missing}, which do not exist under docs/results/"
    if figure.kind == "rate":
        found = any(figure.text in _rates_of(source) for source in figure.sources)
    else:
        backing = [source for source in figure.sources if matches(figure.text, _numbers(source, figure.kind))]
        found = bool(backing)
        if found and figure.kind == "speedup" and figure.document not in LOGS and all(
                (_repeats(source) or MIN_REPEATS) < MIN_REPEATS for source in backing):
            return (f"{figure.where()} comes from a benchmark run of fewer than {MIN_REPEATS} repeats {backing}: "
                    f"quote a median of at least {MIN_REPEATS} (hf-treespec bench --repeats {MIN_REPEATS})")
    if not found:
        return f"{figure.where()} is in none of its section's results {list(figure.sources)}: fix it or its source"
    return None


@lru_cache(maxsize=None)
def _repeats(source: str) -> int | None:
    """The fewest timed repeats of the ``hf-treespec bench`` runs under a result path (``settings.repeats`` of their
    ``summary.json`` / ``batched.json``); None when the path holds no bench run."""
    files = [file for path in _paths(source) for file in (sorted(path.rglob("*.json")) if path.is_dir() else [path])]
    counts = []
    for file in files:
        if file.name in ("summary.json", "batched.json"):
            settings = json.loads(file.read_text()).get("settings")
            if isinstance(settings, dict) and "command" in settings:
                counts.append(int(settings.get("repeats") or 1))
    return min(counts) if counts else None


def provenance(source: str) -> str | None:
    """Why a cited result path does not name its machine, date, commit and command, or None."""
    path = _paths(source)[0]
    folder = path if path.is_dir() else path.parent
    for summary in [*([path] if path.name == "summary.json" else []), *sorted(folder.rglob("summary.json"))][:1]:
        settings = json.loads(summary.read_text()).get("settings", {})
        if all(settings.get(key) for key in ("hardware_summary", "date", "commit", "command")):
            return None
    texts = []
    while folder != RESULTS.parent and folder.is_relative_to(RESULTS):
        texts += [file.read_text() for name in ("README.md", "commands.sh") if (file := folder / name).is_file()]
        folder = folder.parent
    text = "\n".join(texts)
    needs = {"machine": r"EPYC|Xeon|H100|GPU|CPU", "date": r"20\d\d-\d\d-\d\d", "commit": r"\b[0-9a-f]{7,40}\b",
             "command": r"hf-treespec\b|python "}
    lacking = [what for what, pattern in needs.items() if not re.search(pattern, text)]
    return f"docs/results/{source} does not name its {', '.join(lacking)}" if lacking else None


ALL = [figure for document in DOCUMENTS for figure in figures(document)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_figure_is_in_a_committed_result_its_section_cites(document):
    failures = [reason for figure in figures(document) if (reason := check(figure))]
    assert not failures, "\n".join(failures)


def test_every_cited_result_names_machine_date_commit_and_command():
    cited = sorted({source for figure in ALL for source in figure.sources if _paths(source)})
    failures = [reason for source in cited if (reason := provenance(source))]
    assert not failures, "\n".join(failures)


def test_the_documents_print_figures():
    """Guards the scanner: the headline's figures are found (a broken pattern would make every test above pass)."""
    readme = [figure for figure in ALL if figure.document == "README.md"]
    assert {("speedup", "2.70"), ("tau", "1.83")} <= {(figure.kind, figure.text) for figure in readme}


def test_a_wrong_or_unsourced_figure_is_named(tmp_path):
    document = tmp_path / "doc.md"
    text = ("# Speed\n\nThe tree ran at 2.10x (tau 1.83), `docs/results/headline/bf16-greedy`.\n\n"
            "## Other\n\n| method | tau |\n|---|---:|\n| tree | 9.99 |\n\nTen times the data (10x the data), 16x16.\n")
    found = figures(document, text)
    assert [(f.line, f.kind, f.text) for f in found] == [(3, "speedup", "2.10"), (3, "tau", "1.83"), (9, "tau", "9.99")]
    assert check(found[0]) is None and check(found[1]) is None
    assert "doc.md:9: tau 9.99 has no source" in check(found[2])
    wrong = figures(document, text.replace("2.10x", "2.11x"))[0]
    assert check(wrong) == ("doc.md:3: speedup 2.11 is in none of its section's results ['headline/bf16-greedy']: "
                            "fix it or its source")
    swapped = figures(document, text.replace("2.10x (tau 1.83)", "1.83x (tau 2.10)"))
    assert check(swapped[0]) and check(swapped[1]), "a tau of the run is not a speedup, nor the reverse"
    unsourced = figures(document, text.replace("`docs/results/headline/bf16-greedy`", ""))[0]
    assert check(unsourced).startswith("doc.md:3: speedup 2.10 has no source")


def test_a_speedup_of_a_single_repeat_run_is_refused(tmp_path):
    """A speedup is quoted from medians of at least 3 timed repeats: the same figure from a run of one repeat (it is
    in that run's summary) is refused, its tau is not (acceptance is counted, not timed)."""
    text = "# Speed\n\nA compiled 4-node tree ran at 2.46x (tau 2.04), `docs/results/5-greedy-compiled`.\n"
    speedup, tau = figures(tmp_path / "doc.md", text)
    assert "comes from a benchmark run of fewer than 3 repeats ['5-greedy-compiled']" in check(speedup)
    assert check(tau) is None


def test_printed_precision():
    assert matches("1.46", (1.4612,)) and not matches("1.46", (1.4651,)) and matches("2", (2.4,))
    assert _speedups("1.94-1.96x, 2x cheaper, 1.3x a one-token step, 10x the data, paper: 2.10x / 2.33x") == [
        "1.94", "1.96"]
    assert _speedups("~0.5x of plain, 0.9x the compiled plain, 54% faster, 16x16") == ["0.5", "0.9", "54"]


def test_tables_read_taus_by_header_row_or_caption(tmp_path):
    text = ("# Runs\n\nAcceptance (tau) per drafter:\n\n| drafter | greedy | T=1 | nodes |\n|---|---:|---:|---:|\n"
            "| shipped | 2.36 | 1.74 | 14.9 |\n\n| policy | chain | salf |\n|---|---|---|\n| tau | 1.44 | 2.05 |\n")
    assert [(f.line, f.kind, f.text) for f in figures(tmp_path / "doc.md", text)] == [
        (7, "tau", "2.36"), (7, "tau", "1.74"), (11, "tau", "1.44"), (11, "tau", "2.05")]


def test_bare_figures_and_rates_are_checked(tmp_path):
    """A decimal no word marks as a speedup or tau, and a rate a/b, must be in the cited results too."""
    document = tmp_path / "doc.md"
    text = ("# Identity\n\nIn `docs/results/5-greedy-compiled` 7/40 rows matched through the compiled tree, and "
            "the largest top-2 gap at a divergence was 0.500.\n\n## Sampled\n\n"
            "At 16 nodes (`docs/results/6-t1-compiled`): static 2.07, dyspec 1.87.\n")
    found = figures(document, text)
    assert [(f.line, f.kind, f.text) for f in found] == [(3, "figure", "0.500"), (3, "rate", "7/40"),
                                                         (7, "figure", "2.07"), (7, "figure", "1.87")]
    assert check(found[0]) is None and check(found[1]) is None  # both printed by the cited run
    assert "doc.md:7: figure 2.07 is in none of its section's results ['6-t1-compiled']" in check(found[2])
    assert check(found[3])
    mutated = figures(document, text.replace("7/40", "8/40").replace("0.500", "0.600"))
    assert check(mutated[0]) and check(mutated[1]), "a changed figure or rate in a sentence is caught"


def test_what_is_not_a_bare_figure_or_rate():
    line = ("transformers 5.24 and torch 2.13; AdamW `(0.9, 0.95)`; [arXiv:2302.01318](https://arxiv.org/abs/x); "
            "c2t_threshold=0.25; 1.3x the cost; tau 2.04 (1.35 vs 1.38); 12.5 tokens/s; 0.25 ms; rises from 10/9; "
            "docs/results/5-greedy-compiled; 2026-11-27")
    assert _bare(line) == [] and _rates(line) == []
    assert _bare("Paper (Llama, A100): HASS 4.63 -> 4.96") == [] and _bare("ours: 4.63 -> 4.96") == ["4.63", "4.96"]
    assert _rates("| 6/40 (5/40 vs eager) |") == ["6/40", "5/40"]
