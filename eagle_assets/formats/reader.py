"""Reading raw records from JSON arrays, JSON Lines (``.json`` files that are really JSON Lines included, as in
BFCL) and gzip-compressed variants of both, with per-line JSON errors reported as data, not exceptions."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class FormatError(ValueError):
    """A whole source file is unusable (missing, undecodable, unknown format): a configuration problem, raised
    before any record is yielded, with a message saying what to do."""


class BadLine:
    """A JSON Lines row that is not valid JSON (becomes ``Rejected(row, "bad_json", detail)``)."""

    __slots__ = ("detail",)

    def __init__(self, detail: str):
        self.detail = detail


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _unwrap_document(doc: Any) -> list[Any]:
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict):
        # {"data": [...]} / {"train": [...]} wrappers: one list-of-objects value and nothing else of substance.
        lists = [v for v in doc.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
        if len(lists) == 1 and len(doc) <= 2:
            return lists[0]
    return [doc]


def iter_raw_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row, record)`` for every record in a JSON array / JSON Lines / gzip file.

    ``row`` is the 0-based list index for JSON documents and the 0-based physical line number for JSON Lines
    (blank lines are skipped but counted). A JSON Lines row that fails to parse yields a :class:`BadLine`.

    Raises:
        FormatError: the file does not exist, is not UTF-8, or starts like a JSON document but does not parse.
    """
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: source file does not exist; fix the path in the catalog (relative paths resolve against the catalog file's directory)")
    try:
        with _open_text(path) as fh:
            first_line = ""
            for first_line in fh:
                if first_line.strip():
                    break
            stripped = first_line.lstrip()
        if stripped.startswith("["):
            with _open_text(path) as fh:
                try:
                    doc = json.load(fh)
                except json.JSONDecodeError as e:
                    raise FormatError(f"{path}: starts with '[' but is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); repair the file or convert it to JSON Lines") from None
            yield from enumerate(_unwrap_document(doc))
            return
        if stripped.startswith("{"):
            try:
                json.loads(first_line)
            except json.JSONDecodeError:
                with _open_text(path) as fh:
                    try:
                        doc = json.load(fh)
                    except json.JSONDecodeError:
                        doc = None
                if doc is not None:  # one pretty-printed JSON document
                    yield from enumerate(_unwrap_document(doc))
                    return
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    yield lineno, BadLine(f"line {lineno + 1}: not valid JSON ({e.msg} at column {e.colno}): {line[:80]!r}")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 text ({e}); convert the file to UTF-8 JSON or JSON Lines") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise FormatError(f"{path}: cannot be read ({e})") from None
