"""Berkeley Function-Calling Leaderboard layout (ShishirPatil/gorilla
``berkeley-function-call-leaderboard/bfcl_eval/data/BFCL_v4_*.json``; JSON Lines despite the extension):
``{"id": str, "question": [[{"role", "content"}, ...], ...], "function": [{"name", "description",
"parameters": {"type": "dict", "properties": {...}, "required": [...]}}]}``.

``question`` is a list of turns, each a list of messages. Later turns of multi-turn categories follow the model's
own replies (not in the file), so only the first turn is used; the rest stays in ``source_record``. The function
schemas use Python type names (``"dict"``, ``"float"``, ``"tuple"``) and are normalized to JSON schema
(``"object"``, ``"number"``, ``"array"``) so chat templates render them as real tool definitions.
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    EMPTY_PROMPT,
    Conversation,
    RecordError,
    canonical_role,
    content_text,
    finalize,
    make_message,
    normalize_tools,
    require,
)

NAME = "bfcl"


def matches(record: Any) -> bool:
    """True when the record has a list-valued ``question`` and a ``function`` field."""
    return isinstance(record, dict) and isinstance(record.get("question"), list) and "function" in record


def parse(record: Any, row: int) -> Conversation:
    """One BFCL entry -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    question = require(record, "question", list, "bfcl")
    if not question:
        raise RecordError(EMPTY_PROMPT, "bfcl field 'question' is an empty list")
    first = question[0]
    if isinstance(first, dict):  # older BFCL versions: a flat list of messages
        first = question
    if not isinstance(first, list):
        raise RecordError(BAD_FIELD_TYPE, f"bfcl question[0] is a {type(first).__name__}, expected a list of messages")
    tools = normalize_tools(record.get("function"), "function")
    messages: list[dict[str, Any]] = []
    for i, msg in enumerate(first):
        where = f"question[0][{i}]"
        if not isinstance(msg, dict):
            raise RecordError(BAD_FIELD_TYPE, f"{where} is a {type(msg).__name__}, expected an object with role/content")
        role = canonical_role(msg.get("role"))
        text, reasoning, calls = content_text(msg.get("content"), where)
        messages.append(make_message(role, text, where, reasoning=reasoning, tool_calls=calls or msg.get("tool_calls")))
    return finalize(messages, tools, row, record)
