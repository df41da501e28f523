"""Single-turn prompt/response layouts: ``{"prompt": str, "response"|"completion"|"chosen"|"canonical_solution"?:
str, "system"?: str}``.

Covers HumanEval (openai/human-eval ``data/HumanEval.jsonl.gz``: ``task_id, prompt, canonical_solution, test,
entry_point``; the prompt is a function signature + docstring and is used verbatim as the user turn), and the many
instruction sets published as prompt/response or prompt/completion pairs.
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import Conversation, finalize, make_message, reference_text, require

NAME = "prompt_response"
SIGNATURE_KEYS = ("prompt",)
_REPLY_KEYS = ("response", "completion", "chosen", "canonical_solution")


def matches(record: Any) -> bool:
    """True when the record has a string ``prompt`` field."""
    return isinstance(record, dict) and isinstance(record.get("prompt"), str)


def parse(record: Any, row: int) -> Conversation:
    """One prompt/response record -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    prompt = require(record, "prompt", str, "prompt_response")
    messages: list[dict[str, Any]] = []
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    for key in _REPLY_KEYS:
        reply = reference_text(record.get(key))  # a reference only: a malformed one is skipped, never a reject
        if reply:
            messages.append(make_message("assistant", reply, key))
            break
    return finalize(messages, None, row, record)
