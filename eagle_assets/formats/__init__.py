"""Raw dataset layouts -> normalized conversations.

Public API::

    load_records(path, fmt="auto") -> Iterator[Conversation | Rejected]
    detect_format(path) -> str
    sample_id(partition_key, source_record) -> str
    build_prompt(conv, policy) -> (prompt_messages, reference_reply | None)
    FORMATS: dict[name, module]; FORMAT_ALIASES; REJECT_REASONS

One module per layout (sharegpt, messages, glaive, alpaca, opencodeinstruct, mtbench, gsm8k, bfcl,
prompt_response); each exposes
``NAME``, ``matches(record) -> bool`` and ``parse(record, row) -> Conversation`` raising ``RecordError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from eagle_assets.formats import (
    alpaca,
    bfcl,
    glaive,
    gsm8k,
    messages,
    mtbench,
    opencodeinstruct,
    prompt_response,
    sharegpt,
)
from eagle_assets.formats.conversation import (
    BAD_JSON,
    MALFORMED_RECORD,
    REJECT_REASONS,
    Conversation,
    RecordError,
    Rejected,
)
from eagle_assets.formats.prompt import PROMPT_POLICIES, build_prompt, sample_id
from eagle_assets.formats.reader import BadLine, FormatError, iter_raw_records

# Order matters for auto-detection ties: more specific layouts first.
FORMATS: dict[str, ModuleType] = {
    m.NAME: m for m in (bfcl, glaive, messages, sharegpt, mtbench, alpaca, opencodeinstruct, gsm8k, prompt_response)
}
FORMAT_ALIASES: dict[str, str] = {
    "numina": "sharegpt",  # NuminaMath CoT ShareGPT exports: {"id", "conversations": [human, gpt]}
    "openthoughts": "sharegpt",
    "openai": "messages",
    "mixturethoughts": "messages",
    "mixture_of_thoughts": "messages",
    "code_alpaca": "alpaca",
    "mt_bench": "mtbench",
    "mt-bench": "mtbench",
    "humaneval": "prompt_response",
    "dolly": "alpaca",
}
_DETECT_SAMPLE = 50

__all__ = [
    "FORMATS",
    "FORMAT_ALIASES",
    "PROMPT_POLICIES",
    "REJECT_REASONS",
    "Conversation",
    "FormatError",
    "Rejected",
    "build_prompt",
    "detect_format",
    "known_formats",
    "load_records",
    "resolve_format",
    "sample_id",
]


def known_formats() -> list[str]:
    """Every accepted ``format`` value: layout names, aliases and ``auto``."""
    return sorted([*FORMATS, *FORMAT_ALIASES, "auto"])


def resolve_format(fmt: str) -> str:
    """Canonical layout name for a format name or alias (``auto`` passes through); raises FormatError."""
    name = fmt.strip().lower()
    name = FORMAT_ALIASES.get(name, name)
    if name != "auto" and name not in FORMATS:
        raise FormatError(f"unknown format {fmt!r}; use one of {known_formats()}")
    return name


def _detect(records: list[Any], path: Path) -> str:
    scores = {name: sum(1 for r in records if mod.matches(r)) for name, mod in FORMATS.items()}
    best = max(scores, key=lambda n: scores[n])  # first maximum wins: FORMATS is ordered by specificity
    if scores[best] == 0:
        first = next((r for r in records if isinstance(r, dict)), None)
        keys = sorted(first)[:12] if first is not None else "no JSON objects"
        raise FormatError(f"{path}: cannot detect the layout (first record keys: {keys}); set 'format' in the catalog to one of {sorted(FORMATS)}")
    return best


def detect_format(path: str | Path) -> str:
    """Layout name of a file, from its first records (the layout matching most of them wins).

    Raises:
        FormatError: unreadable file or no layout matches.
    """
    sample = []
    for _, rec in iter_raw_records(path):
        if not isinstance(rec, BadLine):
            sample.append(rec)
        if len(sample) >= _DETECT_SAMPLE:
            break
    return _detect(sample, Path(path))


def load_records(path: str | Path, fmt: str = "auto") -> Iterator[Conversation | Rejected]:
    """Read a source file and yield one Conversation or Rejected per raw record, in file order.

    Args:
        path: JSON array, JSON Lines (any extension) or ``.gz`` of either.
        fmt: a name from :func:`known_formats`; ``auto`` detects the layout from the first records.
    Yields:
        Conversation for good records; Rejected(source_row, reason, detail) with reason in REJECT_REASONS for bad
        ones. Never raises for a bad record.
    Raises:
        FormatError: unknown format name, missing/unreadable file, or undetectable layout (raised on first
        iteration, before any record is yielded).
    """
    name = resolve_format(fmt)
    path = Path(path)
    rows = iter_raw_records(path)
    head: list[tuple[int, Any]] = []
    if name == "auto":
        for item in rows:
            head.append(item)
            if len(head) >= _DETECT_SAMPLE:
                break
        name = _detect([r for _, r in head if not isinstance(r, BadLine)], path)
    parser = FORMATS[name].parse

    def _all() -> Iterator[tuple[int, Any]]:
        yield from head
        yield from rows

    for row, record in _all():
        if isinstance(record, BadLine):
            yield Rejected(row, BAD_JSON, record.detail)
            continue
        try:
            yield parser(record, row)
        except RecordError as e:
            yield Rejected(row, e.reason, e.detail)
        except (RecursionError, TypeError, AttributeError, KeyError, ValueError) as e:
            yield Rejected(row, MALFORMED_RECORD, f"{name} record could not be normalized ({type(e).__name__}: {e})"[:500])
