"""Reading raw records from JSON arrays, JSON Lines (``.json`` files that are really JSON Lines included, as in
BFCL), gzip-compressed variants of both and Parquet, with per-record faults reported as data, not exceptions.

A top-level JSON array is streamed: one element in memory at a time plus a read buffer of ~1 MiB
(:func:`_iter_array`), however large the file (glaive-function-calling-v2 ships as one 113k-record array). It is
read twice: a first pass checks that the whole document parses, so a broken array is still refused before any
record is yielded, with the message of a whole-document ``json.load`` (only a broken file is ever read whole).
Elements are decoded by the standard library's own decoder (``json.JSONDecoder.raw_decode``), so every value is
what ``json.load`` gives: ``NaN``, ``1e400``, lone ``\\ud800`` escapes and duplicate keys included (a C streaming
parser such as ijson's yajl backend refuses the first two and turns lone surrogates into ``?``, which would hide
records the loader must reject as ``invalid_unicode``). A ``{"data": [...]}`` wrapper document is still read whole.

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
            raise FormatError(f"{path}: the file is {name} (byte-order mark {bom!r}), not UTF-8; convert it to UTF-8 "
                              f"JSON or JSON Lines (e.g. iconv -f {name} -t UTF-8)")


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
            raise FormatError(f"{path}: {what} but is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                              "repair the file or convert it to JSON Lines (one record per line, so one bad record "
                              "costs only itself)") from None
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path}: {what} but cannot be parsed ({type(e).__name__}: {str(e)[:200]}); convert it "
                              "to JSON Lines (one record per line, so one bad record costs only itself)") from None


_ARRAY_READ_CHARS = 1 << 20  # characters read per refill of the array buffer
_SNIFF_CHARS = 1 << 16  # characters of the first line read to tell a JSON array from JSON Lines
_SKIP_WHITESPACE = json.decoder.WHITESPACE.match  # JSON's whitespace, as the decoder itself skips it


class _ArrayEnd(ValueError):
    """The streamed file is not one well-formed JSON array (``iter_raw_records`` then reads it as JSON Lines, or
    refuses it with the message of a whole-document ``json.load``)."""


def _iter_array(path: Path) -> Iterator[Any]:
    """The elements of the top-level JSON array in ``path``, in order, decoded one at a time.

    Memory: the current element plus a buffer of ``_ARRAY_READ_CHARS`` characters (more only while one element
    is larger than that). A value that touches the end of the buffer is decoded again after a refill, since a
    number or a literal there may continue past it (``12`` of ``123``).

    Raises:
        _ArrayEnd: the text is not one JSON array followed by whitespace only (a bad element, a missing comma or
        bracket, trailing data); ``json.JSONDecodeError``/``ValueError``/``RecursionError`` from the decoder are
        wrapped in it.
    """
    decoder = json.JSONDecoder()
    with _open_text(path) as fh:
        buf, pos, eof = "", 0, False

        def fill(grow: bool = False) -> bool:
            """Append the next chunk; ``grow``: at least as much again as is buffered (a value that did not fit
            is decoded again after each refill, so doubling keeps a huge or broken one linear in its size)."""
            nonlocal buf, pos, eof
            if eof:
                return False
            chunk = fh.read(max(_ARRAY_READ_CHARS, len(buf) - pos) if grow else _ARRAY_READ_CHARS)
            if not chunk:
                eof = True
                return False
            buf, pos = buf[pos:] + chunk, 0
            return True

        def next_char() -> str:
            """The next non-whitespace character (not consumed), or "" at the end of the file."""
            nonlocal pos
            while True:
                pos = _SKIP_WHITESPACE(buf, pos).end()
                if pos < len(buf) or not fill():
                    return buf[pos] if pos < len(buf) else ""

        if next_char() != "[":
            raise _ArrayEnd("the document does not start with '['")
        pos += 1
        if next_char() == "]":
            pos += 1
        else:
            while True:
                if not next_char():
                    raise _ArrayEnd("the array ends before its closing ']'")
                while True:
                    try:
                        value, end = decoder.raw_decode(buf, pos)
                    except json.JSONDecodeError as e:
                        if fill(grow=True):
                            continue
                        raise _ArrayEnd(f"element does not parse: {e.msg}") from None
                    except (ValueError, RecursionError) as e:
                        raise _ArrayEnd(f"element does not parse: {type(e).__name__}") from None
                    if end == len(buf) and fill(grow=True):
                        continue
                    break
                pos = end
                yield value
                sep = next_char()
                pos += 1
                if sep == "]":
                    break
                if sep != ",":
                    raise _ArrayEnd(f"expected ',' or ']' after an element, found {sep!r}")
        if next_char():
            raise _ArrayEnd("data after the array's closing ']'")


def _is_array(path: Path) -> bool:
    """Whether ``path`` holds exactly one well-formed JSON array (a full :func:`_iter_array` pass, values dropped)."""
    try:
        for _ in _iter_array(path):
            pass
    except _ArrayEnd:
        return False
    return True


def _iter_array_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(index, element)`` of a JSON array that :func:`_is_array` accepted.

    Raises:
        FormatError: the file no longer reads as one array (it changed after the check).
    """
    try:
        yield from enumerate(_iter_array(path))
    except _ArrayEnd as e:
        raise FormatError(f"{path}: the file changed while it was read ({e}); "
                          "read it again once it is complete") from None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    """Rows of a Parquet file (the Hugging Face Hub's native format) as dicts, read one batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise FormatError(f"{path}: not a readable Parquet file ({e}); "
                          "re-download it or export it to JSON Lines") from None
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield row, record
                row += 1
    except (pa.ArrowException, OSError) as e:
        yield row, BadLine(f"the Parquet file cannot be read after its first {row} rows ({type(e).__name__}: {e}); "
                           "every later row is missing: re-download the file", TRUNCATED_FILE)


def _more_lines(path: Path) -> bool:
    """Whether any non-blank line follows the first non-blank line of ``path`` (read in bounded chunks)."""
    state = 0  # 0: before the first non-blank line, 1: inside it, 2: after it
    with _open_text(path) as fh:
        while chunk := fh.read(_ARRAY_READ_CHARS):
            for i, piece in enumerate(chunk.split("\n")):
                if i and state == 1:
                    state = 2
                if piece.strip():
                    if state == 2:
                        return True
                    state = max(state, 1)
    return False


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
        raise FormatError(f"{path}: source file does not exist; fix the path in the catalog (relative paths resolve "
                          "against the catalog file's directory)")
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    lineno = -1
    try:
        _check_encoding(path)
        with _open_text(path) as fh:
            first_line = ""
            while True:  # the first non-blank line, at most _SNIFF_CHARS of it: a one-line array can be gigabytes
                first_line = fh.readline(_SNIFF_CHARS)
                if not first_line or first_line.strip():
                    break
            stripped = first_line.lstrip()
            if stripped.startswith("{") and not first_line.endswith("\n"):
                first_line += fh.readline()  # the whole first record (JSON Lines reads it whole anyway)
        if stripped.startswith("["):
            if _is_array(path):  # the whole file is checked before its first record is yielded
                yield from _iter_array_rows(path)
                return
            # A pretty-printed array (a bare "[" line) or a one-line array is one broken document: refused with
            # json.load's own message (line, column). Any other file of several lines is JSON Lines whose first
            # record is an array or broken: read line by line.
            if stripped.strip() == "[" or not _more_lines(path):
                yield from enumerate(_unwrap_document(_load_document(path, "starts with '['")))
                return
        elif stripped.startswith("{") and isinstance(_parse_line(0, first_line), BadLine):
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
        yield lineno + 1, BadLine(f"the compressed file ends mid-stream after line {lineno + 1} "
                                  f"({type(e).__name__}: {e}); every record after that line is missing: "
                                  "re-download or re-compress the file", TRUNCATED_FILE)
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e})") from None
