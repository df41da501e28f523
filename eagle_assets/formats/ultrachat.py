"""UltraChat layout (thunlp/UltraChat; stingning/ultrachat ``train_*.jsonl``): ``{"id": str, "data": [str, ...]}``.

``data`` is the dialogue as bare strings, alternating user and assistant and starting with the user (the dataset
card's example; LLaMA-Factory's ``data/ultra_chat/ultra_chat.py`` reads it the same way, as human/gpt turns).
The HF ``messages`` variant (HuggingFaceH4/ultrachat_200k: ``{"prompt", "prompt_id", "messages": [{"role",
"content"}]}``) is the ``messages`` layout.
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    EMPTY_PROMPT,
    Conversation,
    RecordError,
    finalize,
    make_message,
    require,
)

NAME = "ultrachat"
SIGNATURE_KEYS = ("data",)


def matches(record: Any) -> bool:
    """True when the record has a non-empty ``data`` list of strings."""
    data = record.get("data") if isinstance(record, dict) else None
    return isinstance(data, list) and bool(data) and all(isinstance(t, str) for t in data)


def parse(record: Any, row: int) -> Conversation:
    """One UltraChat dialogue -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    data = require(record, "data", list, "ultrachat")
    if not data:
        raise RecordError(EMPTY_PROMPT, "ultrachat field 'data' is an empty list")
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(data):
        if not isinstance(turn, str):
            raise RecordError(BAD_FIELD_TYPE, f"ultrachat data[{i}] is a {type(turn).__name__}, expected text")
        role = "user" if i % 2 == 0 else "assistant"
        messages.append(make_message(role, turn, f"data[{i}]"))
    return finalize(messages, None, row, record)
