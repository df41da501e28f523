"""Reading raw records from JSON arrays, JSON Lines (``.json`` files that are really JSON Lines included, as in
BFCL), gzip-compressed variants of both and Parquet, with per-record faults reported as data, not exceptions.

One bad character never loses a file: text is decoded as UTF-8 with ``surrogateescape``, so a byte that is not
UTF-8 becomes a lone surrogate inside the record's strings (the loader then rejects that record as
``invalid_unicode``) or breaks that one line's JSON (``bad_json``); the other records read normally.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle_assets.formats.conversation import BAD_JSON, TRUNCATED_FILE


class FormatError(ValueError):
    """A whole source file is unusable (missing, in another encoding, a JSON document that does not parse, an
    unknown format name): a configuration problem, raised before any record is yielded, with a message saying
    what to do."""


class BadLine:
    """A raw row that is not a record: becomes ``Rejected(row, reason, detail)``.

    ``reason`` is ``bad_json`` (a JSON Lines row that does not parse) or ``truncated_file`` (a compressed file
    that ends mid-stream; it is the last item the reader yields).
    """

    __slots__ = ("detail", "reason")

    def __init__(self, detail: str, reason: str = BAD_JSON):
        self.detail = detail
        self.reason = reason


# Byte-order marks of encodings that are not UTF-8: such a file would decode to noise on every line.
_FOREIGN_BOMS = {b"\xff\xfe\x00\x00": "UTF-32-LE", b"\x00\x00\xfe\xff": "UTF-32-BE", b"\xff\xfe": "UTF-16-LE",
                 b"\xfe\xff": "UTF-16-BE"}


def _open_text(path: Path) -> io.TextIOBase:
    raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape")


def _unwrap_document(doc: Any) -> list[Any]:
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict):
        # {"data": [...]} / {"train": [...]} wrappers: one list-of-objects value and nothing else of substance.
        lists = [v for v in doc.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
        if len(lists) == 1 and len(doc) <= 2:
            return lists[0]
    return [doc]


def _check_encoding(path: Path) -> None:
    with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as fh:
        head = fh.read(4)
    for bom, name in _FOREIGN_BOMS.items():
        if head.startswith(bom):
            raise FormatError(f"{path}: the file is {name} (byte-order mark {bom!r}), not UTF-8; convert it to UTF-8 JSON or JSON Lines (e.g. iconv -f {name} -t UTF-8)")


def _parse_line(lineno: int, line: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, ints past the digit limit, nesting too deep
        where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = e.msg if isinstance(e, json.JSONDecodeError) else f"{type(e).__name__}: {e}"[:200]
        return BadLine(f"line {lineno + 1}: not valid JSON ({msg}{where}): {line[:80]!r}")


def _load_document(path: Path, what: str) -> Any:
    with _open_text(path) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as e:
            raise FormatError(f"{path}: {what} but is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); repair the file or convert it to JSON Lines (one record per line, so one bad record costs only itself)") from None
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path}: {what} but cannot be parsed ({type(e).__name__}: {str(e)[:200]}); convert it to JSON Lines (one record per line, so one bad record costs only itself)") from None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    """Rows of a Parquet file (the Hugging Face Hub's native format) as dicts, read one batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise FormatError(f"{path}: not a readable Parquet file ({e}); re-download it or export it to JSON Lines") from None
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield row, record
                row += 1
    except (pa.ArrowException, OSError) as e:
        yield row, BadLine(f"the Parquet file cannot be read past row {row} ({type(e).__name__}: {e}); every later row is missing: re-download the file", TRUNCATED_FILE)


def iter_raw_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row, record)`` for every record in a JSON array / JSON Lines / gzip file, or a Parquet file (one
    record per row, nested columns as lists and dicts); an empty file (or one of blank lines, or ``[]``) yields
    nothing.

    ``row`` is the 0-based list index for JSON documents and the 0-based physical line number for JSON Lines
    (blank lines are skipped but counted). A JSON Lines row that fails to parse yields a :class:`BadLine`; a
    gzip file cut mid-stream yields the rows before the cut, then one ``BadLine(reason="truncated_file")``.

    Raises:
        FormatError: the file does not exist or cannot be opened, is UTF-16/UTF-32, or is one JSON array that
        does not parse (a single line starting with ``[``, or a pretty-printed array opening with a bare ``[``
        line); a file of several lines whose first starts with ``[`` otherwise is read as JSON Lines.
    """
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: source file does not exist; fix the path in the catalog (relative paths resolve against the catalog file's directory)")
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    lineno = -1
    try:
        _check_encoding(path)
        with _open_text(path) as fh:
            first_line, more_lines = "", False
            for first_line in fh:
                if first_line.strip():
                    break
            more_lines = any(line.strip() for line in fh)
            stripped = first_line.lstrip()
        first_is_value = not isinstance(_parse_line(0, first_line), BadLine)
        if stripped.startswith("["):
            try:
                doc = _load_document(path, "starts with '['")
            except FormatError:
                # A pretty-printed array (a bare "[" line) or a one-line array is one broken document; any other
                # file of several lines is JSON Lines whose first record is an array or broken: read line by line.
                if stripped.strip() == "[" or not more_lines:
                    raise
                doc = None
            if doc is not None:
                yield from enumerate(_unwrap_document(doc))
                return
        elif stripped.startswith("{") and not first_is_value:
            # one pretty-printed JSON document (a JSON Lines file whose first line is broken falls through)
            try:
                doc = _load_document(path, "starts with '{'")
            except FormatError:
                doc = None
            if doc is not None:
                yield from enumerate(_unwrap_document(doc))
                return
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh):
                if line.strip():
                    yield lineno, _parse_line(lineno, line)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        if lineno < 0:
            raise FormatError(f"{path}: cannot be read as gzip ({e}); re-download or re-compress the file") from None
        yield lineno + 1, BadLine(f"the compressed file ends mid-stream after line {lineno + 1} ({type(e).__name__}: {e}); every record after that line is missing: re-download or re-compress the file", TRUNCATED_FILE)
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e})") from None
