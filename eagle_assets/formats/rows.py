"""The rows ``raw_prompts`` stores: every record of a partition's sources as a kept prompt row or a reject row.

``collect_prompt_rows`` is the whole per-record path of the asset (load, normalize, check, cut the prompt, id,
serialise), so a test can drive exactly what the asset runs. Kept rows satisfy ``RAW_SCHEMA``: ``messages`` /
``tools`` / ``reference_reply`` are strict JSON (no NaN), valid UTF-8, with the roles and shapes of
:func:`~eagle_assets.formats.conversation.check_conversation`. Reject rows satisfy ``REJECT_SCHEMA`` with a
reason from ``REJECT_REASONS`` and a detail saying what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
REJECT_SCHEMA = pa.schema(
    [("source_file", pa.string()), ("source_row", pa.int64()), ("sample_id", pa.string()),
     ("reason", pa.string()), ("detail", pa.string())]
)
_DETAIL_MAX = 1000


def _strict_json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    text.encode("utf-8")  # raises for lone surrogates: such text cannot be stored or tokenized
    return text


def _shown(path: Path) -> str:
    # A file name that is not valid UTF-8 (surrogate-escaped by the OS layer) is still storable.
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def collect_prompt_rows(
    partition_key: str, sources: Iterable[tuple[Path, str]], policy: str
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Every record of ``sources`` (``[(path, format)]``) as a prompt row or a reject row.

    Returns ``(kept, rejects)``: ``kept`` maps sample_id -> row (``RAW_SCHEMA`` columns) in file order, the first
    of identical records kept (later ones are ``duplicate`` rejects); ``rejects`` are ``REJECT_SCHEMA`` rows.
    Never raises for a record; raises FormatError for a source file that is unusable as a whole (missing, a
    JSON document that does not parse, UTF-16...).
    """
    kept: dict[str, dict[str, Any]] = {}
    rejects: list[dict[str, Any]] = []
    for path, fmt in sources:
        shown = _shown(path)

        def reject(row: int, sid: str | None, reason: str, detail: str) -> None:
            rejects.append({"source_file": shown, "source_row": row, "sample_id": sid, "reason": reason,
                            "detail": detail.encode("utf-8", "backslashreplace").decode("utf-8")[:_DETAIL_MAX]})

        for rec in load_records(path, fmt):
            if isinstance(rec, Rejected):
                reject(rec.source_row, None, rec.reason, rec.detail)
                continue
            try:
                sid = sample_id(partition_key, rec.source_record)
            except (ValueError, RecursionError) as exc:  # a record nested past what json.dumps can write back
                reject(rec.source_row, None, MALFORMED_RECORD, f"record cannot be hashed into a sample id ({type(exc).__name__}: {exc})")
                continue
            if sid in kept:
                reject(rec.source_row, sid, DUPLICATE, f"same record as {kept[sid]['source_file']} row {kept[sid]['source_row']}")
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
                reject(rec.source_row, sid, exc.reason, exc.detail)
                continue
            except Exception as exc:  # noqa: BLE001 - a bad record must not stop the partition
                reject(rec.source_row, sid, MALFORMED_RECORD, f"prompt could not be built ({type(exc).__name__}: {exc})")
                continue
            kept[sid] = row
    return kept, rejects
