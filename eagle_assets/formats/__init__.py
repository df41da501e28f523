"""Raw dataset layouts -> normalized conversations.

Public API::

    load_records(path, fmt="auto") -> Iterator[Conversation | Rejected]
    detect_format(path) -> str
    sample_id(partition_key, source_record) -> str
    build_prompt(conv, policy) -> (prompt_messages, reference_reply | None)
    FORMATS: dict[name, module]; FORMAT_ALIASES; REJECT_REASONS

One module per layout (sharegpt, messages, glaive, alpaca, opencodeinstruct, mtbench, gsm8k, bfcl, problem,
toolbench, ultrachat, prompt_response); each exposes ``NAME``, ``SIGNATURE_KEYS`` (the top-level keys that mark
a record as meant for this layout, for detecting the layout of a file whose records are all malformed),
``matches(record) -> bool`` and ``parse(record, row) -> Conversation`` raising ``RecordError``; a layout whose
records refer to other files (BFCL multi-turn's function docs) adds ``parser_for(path) -> parse``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    problem,
    prompt_response,
    sharegpt,
    toolbench,
    ultrachat,
)
from eagle_assets.formats.conversation import (
    MALFORMED_RECORD,
    REJECT_REASONS,
    UNDETECTED_LAYOUT,
    Conversation,
    RecordError,
    Rejected,
    check_conversation,
)
from eagle_assets.formats.prompt import PROMPT_POLICIES, build_prompt, sample_id
from eagle_assets.formats.reader import BadLine, FormatError, iter_raw_records

# Order matters for auto-detection ties: more specific layouts first.
FORMATS: dict[str, ModuleType] = {
    m.NAME: m
    for m in (bfcl, toolbench, glaive, messages, sharegpt, ultrachat, mtbench, alpaca, opencodeinstruct, problem,
              gsm8k, prompt_response)
}
FORMAT_ALIASES: dict[str, str] = {
    "numina": "sharegpt",  # NuminaMath CoT ShareGPT exports: {"id", "conversations": [human, gpt]}
    "openthoughts": "sharegpt",
    "openai": "messages",
    "mixturethoughts": "messages",
    "mixture_of_thoughts": "messages",
    "ultrachat_200k": "messages",  # HuggingFaceH4/ultrachat_200k: {"prompt", "prompt_id", "messages"}
    "code_alpaca": "alpaca",
    "mt_bench": "mtbench",
    "mt-bench": "mtbench",
    "humaneval": "prompt_response",
    "dolly": "alpaca",
    "math": "problem",
    "competition_math": "problem",
    "aime": "problem",
    "amc": "problem",
    "bfcl_multi_turn": "bfcl",
}
_DETECT_SAMPLE = 50
_DETAIL_MAX = 1000

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


def _safe(check: Callable[[Any], bool], record: Any) -> bool:
    try:
        return bool(check(record))
    except Exception:  # noqa: BLE001 - a record that breaks a matcher simply does not match
        return False


def _claims(mod: ModuleType, record: Any) -> bool:
    return isinstance(record, dict) and any(k in record for k in mod.SIGNATURE_KEYS)


def _reads(mod: ModuleType, record: Any) -> bool:
    """Whether layout ``mod`` turns ``record`` into a kept conversation (its parser and the shared checks)."""
    try:
        check_conversation(mod.parse(record, 0))
    except Exception:  # noqa: BLE001 - RecordError or anything else: this layout does not read the record
        return False
    return True


def _detect(records: list[Any]) -> str | None:
    """The layout matching most records (first maximum wins: FORMATS is ordered by specificity); when no record
    matches any layout fully, the layout whose signature keys most records carry (a file of malformed records of
    one layout); None when neither finds anything.

    A layout so chosen that would reject every one of ``records`` while another layout reads some of them is not
    kept: the layout that reads most of them is chosen instead (a file must never give zero prompts because of the
    pick alone). When no layout reads any record, the pick stands, so the rejects name the intended layout's
    reasons."""
    best = None
    for test in (lambda mod, r: _safe(mod.matches, r), _claims):
        scores = {name: sum(1 for r in records if test(mod, r)) for name, mod in FORMATS.items()}
        top = max(scores, key=lambda n: scores[n])
        if scores[top]:
            best = top
            break
    if best is None or any(_reads(FORMATS[best], r) for r in records):
        return best
    reads = {name: sum(1 for r in records if _reads(mod, r)) for name, mod in FORMATS.items()}
    top = max(reads, key=lambda n: reads[n])
    return top if reads[top] else best


def _undetected_detail(records: list[Any]) -> str:
    first = next((r for r in records if isinstance(r, dict)), None)
    keys = sorted(first)[:12] if first is not None else "no JSON objects"
    return (f"format auto: no known layout matches this file's records (first record keys: {keys}); set 'format' "
            f"in the catalog to one of {sorted(FORMATS)}, or convert the file to one of them")


def detect_format(path: str | Path) -> str:
    """Layout name of a file, from its first records (the layout matching most of them wins).

    Raises:
        FormatError: unreadable file, or no layout matches (an empty file included: nothing to detect from).
    """
    sample = []
    for _, rec in iter_raw_records(path):
        if not isinstance(rec, BadLine):
            sample.append(rec)
        if len(sample) >= _DETECT_SAMPLE:
            break
    name = _detect(sample)
    if name is None:
        raise FormatError(f"{path}: cannot detect the layout: "
                          + (_undetected_detail(sample) if sample else "the file holds no records"))
    return name


def _printable(detail: str) -> str:
    """A reject detail that can always be stored: text that is not valid Unicode is backslash-escaped."""
    return detail.encode("utf-8", "backslashreplace").decode("utf-8")[:_DETAIL_MAX]


def load_records(path: str | Path, fmt: str = "auto") -> Iterator[Conversation | Rejected]:
    """Read a source file and yield one Conversation or Rejected per raw record, in file order.

    Args:
        path: JSON array, JSON Lines (any extension), ``.gz`` of either, or ``.parquet``.
        fmt: a name from :func:`known_formats`; ``auto`` detects the layout from the first records.
    Yields:
        Conversation for good records, each checked by :func:`~eagle_assets.formats.conversation.check_conversation`
        (valid roles and types, strict JSON, UTF-8-encodable); Rejected(source_row, reason, detail) with reason in
        REJECT_REASONS for every other record. Never raises for a bad record, whatever it holds. An empty file
        yields nothing; with ``auto``, a file whose records match no layout yields one ``undetected_layout``
        reject per record.
    Raises:
        FormatError: unknown format name, missing/unreadable file, or a JSON document that does not parse
        (raised on first iteration, before any record is yielded).
    """
    name = resolve_format(fmt)
    path = Path(path)
    rows = iter_raw_records(path)
    head: list[tuple[int, Any]] = []
    if name == "auto":
        sample = []  # the first _DETECT_SAMPLE records that are JSON (lines that are not do not count)
        for item in rows:
            head.append(item)
            if not isinstance(item[1], BadLine):
                sample.append(item[1])
                if len(sample) >= _DETECT_SAMPLE:
                    break
        detected = _detect(sample)
        undetected = _undetected_detail(sample) if detected is None else ""
    else:
        detected = name
    mod = FORMATS.get(detected) if detected else None
    parser = (mod.parser_for(path) if hasattr(mod, "parser_for") else mod.parse) if mod else None

    def _all() -> Iterator[tuple[int, Any]]:
        yield from head
        yield from rows

    for row, record in _all():
        if isinstance(record, BadLine):
            yield Rejected(row, record.reason, _printable(record.detail))
            continue
        if parser is None:
            yield Rejected(row, UNDETECTED_LAYOUT, _printable(undetected))
            continue
        try:
            yield check_conversation(parser(record, row))
        except RecordError as e:
            yield Rejected(row, e.reason, _printable(e.detail))
        except Exception as e:  # noqa: BLE001 - whatever a record holds, it costs only itself
            yield Rejected(row, MALFORMED_RECORD,
                           _printable(f"{detected} record could not be normalized ({type(e).__name__}: {e})"))
