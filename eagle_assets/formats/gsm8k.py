"""GSM8K layout (openai/grade-school-math ``grade_school_math/data/*.jsonl``): ``{"question": str, "answer": str}``.

The answer (worked solution with ``<<calc>>`` annotations and a final ``#### n`` line) is kept verbatim as the
reference reply. Sets in the same shape with a bare numeric answer (opencompass/AIME2025 ``{"question",
"answer"}``) keep the number as the reference; a missing or malformed answer never rejects the prompt.
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import Conversation, finalize, make_message, reference_text, require

NAME = "gsm8k"
SIGNATURE_KEYS = ("question",)


def matches(record: Any) -> bool:
    """True when the record has a string ``question`` (and no list-valued one, which would be BFCL)."""
    return isinstance(record, dict) and isinstance(record.get("question"), str)


def parse(record: Any, row: int) -> Conversation:
    """One GSM8K problem -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    question = require(record, "question", str, "gsm8k")
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    answer = reference_text(record.get("answer"))
    if answer:
        messages.append(make_message("assistant", answer, "answer"))
    return finalize(messages, None, row, record)
