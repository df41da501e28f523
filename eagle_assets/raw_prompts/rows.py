"""The rows ``raw_prompts`` stores: every record of a partition's sources as a kept prompt row or a reject row.

``iter_prompt_rows`` is the whole per-record path of the asset (load, normalize, check, cut the prompt, id,
serialise, drop duplicates), streamed record by record; ``eagle_assets.raw_prompts.write`` writes it in bounded row
groups and ``collect_prompt_rows`` gathers it in memory, so a test can drive exactly what the asset runs. Kept rows
satisfy ``RAW_SCHEMA``: ``messages`` / ``tools`` / ``reference_reply`` are strict JSON (no NaN), valid UTF-8, with
the roles and shapes of :func:`~eagle_assets.formats.conversation.check_conversation`. Reject rows satisfy
``REJECT_SCHEMA`` with a reason from ``REJECT_REASONS`` and a detail saying what was wrong; positions a person reads
(``source_line``, the details) are 1-based, ``source_row`` is the 0-based machine position.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_assets.formats import load_records
from eagle_assets.formats.conversation import DUPLICATE, MALFORMED_RECORD, RecordError, Rejected
from eagle_assets.formats.prompt import build_prompt, sample_id

RAW_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("messages", pa.string()),
        ("tools", pa.string()),
        ("reference_reply", pa.string()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
    ]
)
# A reject row: ``source_row`` is the machine position (0-based, as in RAW_SCHEMA and ``Conversation.source_row``:
# the physical line index of a JSON Lines file, the element index of a JSON array, the row index of a Parquet file);
# ``source_line`` is the same position as a person counts it, 1-based (``source_row + 1``: the line number an
# editor or ``sed -n Np`` shows, the N-th element or row), the number every detail text uses too.
REJECT_SCHEMA = pa.schema(
    [("source_file", pa.string()), ("source_row", pa.int64()), ("source_line", pa.int64()),
     ("sample_id", pa.string()), ("reason", pa.string()), ("detail", pa.string())]
)
_DETAIL_MAX = 1000


def _strict_json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    text.encode("utf-8")  # raises for lone surrogates: such text cannot be stored or tokenized
    return text


def shown_path(path: Path) -> str:
    # A file name that is not valid UTF-8 (surrogate-escaped by the OS layer) is still storable.
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


class SeenIds:
    """The sample ids kept so far, for ``duplicate`` rejects, in ~20 bytes per id (not a dict of rows).

    A sample id is 16 hex digits (64 bits, :func:`~eagle_assets.formats.prompt.sample_id`), stored as one
    ``uint64`` in a sorted array beside the ``int32`` source index and ``int64`` source row of its first kept
    record; the latest ids wait in a small dict and are merged into the arrays every ``merge_every`` (default
    ``MERGE_EVERY``) ids, so a
    look-up is one dict probe plus one binary search. Memory: ~20 bytes per distinct kept record (20 MB at 1M).
    """

    MERGE_EVERY = 4096

    def __init__(self, merge_every: int | None = None):
        self._keys = np.empty(0, dtype=np.uint64)
        self._source = np.empty(0, dtype=np.int32)
        self._row = np.empty(0, dtype=np.int64)
        self._pending: dict[int, tuple[int, int]] = {}
        self._merge_every = merge_every or self.MERGE_EVERY

    def __len__(self) -> int:
        return self._keys.size + len(self._pending)

    def get(self, sid: str) -> tuple[int, int] | None:
        """``(source index, source row)`` of the first kept record with id ``sid``, or None."""
        key = int(sid, 16)
        hit = self._pending.get(key)
        if hit is not None or not self._keys.size:
            return hit
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        if i < self._keys.size and int(self._keys[i]) == key:
            return int(self._source[i]), int(self._row[i])
        return None

    def add(self, sid: str, source: int, row: int) -> None:
        self._pending[int(sid, 16)] = (source, row)
        if len(self._pending) >= self._merge_every:
            self._merge()

    def _merge(self) -> None:
        keys = np.fromiter(self._pending.keys(), dtype=np.uint64, count=len(self._pending))
        where = np.array(list(self._pending.values()), dtype=np.int64).reshape(-1, 2)
        order = np.argsort(keys)
        keys, where = keys[order], where[order]
        at = np.searchsorted(self._keys, keys)  # one linear insert of a sorted batch, not a sort of every id
        self._keys = np.insert(self._keys, at, keys)
        self._source = np.insert(self._source, at, where[:, 0].astype(np.int32))
        self._row = np.insert(self._row, at, where[:, 1])
        self._pending = {}

KEPT, REJECT = "kept", "reject"


def iter_prompt_rows(
    partition_key: str, sources: Iterable[tuple[Path, str]], policy: str
) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """Every record of ``sources`` (``[(path, format)]``), in file order, as ``(KEPT, source index, row)`` with a
    ``RAW_SCHEMA`` row or ``(REJECT, source index, row)`` with a ``REJECT_SCHEMA`` row.

    The first of identical records is kept (later ones are ``duplicate`` rejects naming its file and row); the ids
    seen are held in a :class:`SeenIds`, so memory does not grow with the rows' size. Never raises for a record;
    raises FormatError for a source file that is unusable as a whole (missing, a JSON document that does not
    parse, UTF-16...).
    """
    seen = SeenIds()
    shown_names: list[str] = []
    for index, (path, fmt) in enumerate(sources):
        shown = shown_path(path)
        shown_names.append(shown)

        def reject(row: int, sid: str | None, reason: str, detail: str) -> tuple[str, int, dict[str, Any]]:
            return REJECT, index, {"source_file": shown, "source_row": row, "source_line": row + 1,
                                   "sample_id": sid, "reason": reason,
                                   "detail": detail.encode("utf-8", "backslashreplace").decode("utf-8")[:_DETAIL_MAX]}

        for rec in load_records(path, fmt):
            if isinstance(rec, Rejected):
                yield reject(rec.source_row, None, rec.reason, rec.detail)
                continue
            try:
                sid = sample_id(partition_key, rec.source_record)
            except (ValueError, RecursionError) as exc:  # a record nested past what json.dumps can write back
                yield reject(rec.source_row, None, MALFORMED_RECORD,
                             f"record cannot be hashed into a sample id ({type(exc).__name__}: {exc})")
                continue
            first = seen.get(sid)
            if first is not None:
                yield reject(rec.source_row, sid, DUPLICATE,
                             f"same record as source_line {first[1] + 1} of {shown_names[first[0]]} (kept)")
                continue
            try:
                prompt_messages, reference = build_prompt(rec, policy)
                row = {
                    "sample_id": sid,
                    "messages": _strict_json(prompt_messages),
                    "tools": _strict_json(rec.tools) if rec.tools else None,
                    "reference_reply": _strict_json(reference) if reference else None,
                    "source_file": shown,
                    "source_row": rec.source_row,
                }
            except RecordError as exc:
                yield reject(rec.source_row, sid, exc.reason, exc.detail)
                continue
            except Exception as exc:  # noqa: BLE001 - a bad record must not stop the partition
                yield reject(rec.source_row, sid, MALFORMED_RECORD,
                             f"prompt could not be built ({type(exc).__name__}: {exc})")
                continue
            seen.add(sid, index, rec.source_row)
            yield KEPT, index, row


def collect_prompt_rows(
    partition_key: str, sources: Iterable[tuple[Path, str]], policy: str
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Every record of ``sources`` (``[(path, format)]``) as a prompt row or a reject row, all in memory (small
    sources and tests; ``raw_prompts`` streams :func:`iter_prompt_rows` through ``raw_prompts.write``).

    Returns ``(kept, rejects)``: ``kept`` maps sample_id -> row (``RAW_SCHEMA`` columns) in file order, the first
    of identical records kept (later ones are ``duplicate`` rejects); ``rejects`` are ``REJECT_SCHEMA`` rows.
    Raises FormatError as :func:`iter_prompt_rows` does.
    """
    kept: dict[str, dict[str, Any]] = {}
    rejects: list[dict[str, Any]] = []
    for kind, _, row in iter_prompt_rows(partition_key, sources, policy):
        if kind == KEPT:
            kept[row["sample_id"]] = row
        else:
            rejects.append(row)
    return kept, rejects
