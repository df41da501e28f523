"""Alpaca layout: ``{"instruction": str, "input": str, "output": str, "system"?: str, "history"?: [[q, a], ...]}``.

Also Dolly (databricks-dolly-15k: ``instruction, context, response, category``).

Stanford Alpaca / code_alpaca (``data/code_alpaca_2k.json``) and LLaMA-Factory's ``alpaca`` format (optional
``system`` and ``history``). The user turn is the instruction, followed by a blank line and the input when the input
is non-empty (the convention of Alpaca's own prompt). The output becomes the reference assistant reply; a missing
or malformed output never rejects the prompt (a reference is kept for comparison only).
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    Conversation,
    RecordError,
    finalize,
    make_message,
    reference_text,
    require,
)

NAME = "alpaca"
SIGNATURE_KEYS = ("instruction",)


def matches(record: Any) -> bool:
    """True when the record has a string ``instruction`` field."""
    return isinstance(record, dict) and isinstance(record.get("instruction"), str)


def _text(record: dict, key: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError(BAD_FIELD_TYPE, f"alpaca field {key!r} is a {type(value).__name__}, expected text")
    return value


def parse(record: Any, row: int) -> Conversation:
    """One alpaca record -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    instruction = require(record, "instruction", str, "alpaca")
    messages: list[dict[str, Any]] = []
    system = _text(record, "system")
    if system:
        messages.append({"role": "system", "content": system})
    history = record.get("history") or []
    if not isinstance(history, list):
        raise RecordError(BAD_FIELD_TYPE,
                          f"alpaca field 'history' is a {type(history).__name__}, expected [[query, response], ...]")
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise RecordError(BAD_FIELD_TYPE, f"alpaca history[{i}] is not a [query, response] pair of strings")
        messages.append({"role": "user", "content": pair[0]})
        messages.append(make_message("assistant", pair[1], f"history[{i}]"))
    extra = _text(record, "input") or _text(record, "context")  # Dolly names the input "context"
    user = instruction if not extra.strip() else f"{instruction}\n\n{extra}"
    messages.append({"role": "user", "content": user})
    output = reference_text(record.get("output")) or reference_text(record.get("response"))  # Dolly: "response"
    if output:
        messages.append(make_message("assistant", output, "output"))
    return finalize(messages, None, row, record)
