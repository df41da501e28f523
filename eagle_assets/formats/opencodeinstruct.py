"""OpenCodeInstruct layout (nvidia/OpenCodeInstruct): ``{"id", "input", "output", "domain", "generation_algorithm",
"llm_judgement", "unit_tests", "tests_execution_status", "average_test_score"}``.

``input`` is the full coding instruction (the user turn) and ``output`` the reference solution; the remaining
fields are judge/test metadata kept only in ``source_record``.
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import Conversation, finalize, make_message, reference_text, require

NAME = "opencodeinstruct"
SIGNATURE_KEYS = ("input",)


def matches(record: Any) -> bool:
    """True when the record has string ``input`` and no ``instruction`` (which would make it alpaca)."""
    return (isinstance(record, dict) and isinstance(record.get("input"), str) and "instruction" not in record
            and "output" in record)


def parse(record: Any, row: int) -> Conversation:
    """One OpenCodeInstruct record -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    prompt = require(record, "input", str, "opencodeinstruct")
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    output = reference_text(record.get("output"))  # a reference only: never a reason to reject
    if output:
        messages.append(make_message("assistant", output, "output"))
    return finalize(messages, None, row, record)
