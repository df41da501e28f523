"""OpenAI messages layout: ``{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}], "tools"?}``.

Covers:
- OpenAI chat / SGLang / SpecForge conversations (SpecForge's ``tests/test_data/data/tool_use_conversation.jsonl``
  stores them under ``conversations`` with ``role``/``content`` and tool-call ``arguments`` as JSON strings),
- Mixture-of-Thoughts (open-r1): ``{"messages": [user, assistant], "num_tokens", "source"}`` where the assistant
  content holds ``<think>\\n...\\n</think>\\n\\nanswer``; the reasoning is split into ``reasoning_content``,
- LLaMA-Factory's reasoning tool-use layout (``data/reason_tool_use_demo_50.jsonl``): content is a list of parts
  ``{"type": "text"|"reasoning"|"tool_call", "value": ...}`` and ``tools`` is a JSON string. The results of an
  assistant turn with several calls come in one ``tool`` message whose text is a JSON array
  ``[{"tool_call_id", "name", "content"}, ...]``, one entry per call in call order; they are split into one ``tool``
  message per call (content and name of its entry), the layout every other source and the chat templates use.

A record whose messages field holds one prompt as a string (``{"messages": "..."}``, some eval files) is read as
one user message when that is unambiguous (``conversation.single_prompt_text``), else refused naming the field and
the fix.
"""

from __future__ import annotations

import json
from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    Conversation,
    RecordError,
    canonical_role,
    content_text,
    finalize,
    is_single_prompt,
    make_message,
    normalize_tools,
    single_prompt_text,
)

NAME = "messages"
SIGNATURE_KEYS = ("messages", "conversation")
_KEYS = ("messages", "conversations", "conversation")


def _messages(record: Any) -> tuple[str | None, Any]:
    if isinstance(record, dict):
        for key in _KEYS:
            if key in record:
                return key, record[key]
    return None, None


def matches(record: Any) -> bool:
    """True when the record holds a list of ``{"role": ...}`` dicts under messages/conversations, or one prompt
    string there that is read as one user message."""
    _, msgs = _messages(record)
    return (isinstance(msgs, list) and bool(msgs) and isinstance(msgs[0], dict) and "role" in msgs[0]) \
        or is_single_prompt(msgs)


def parse(record: Any, row: int) -> Conversation:
    """One OpenAI-messages record -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    if not isinstance(record, dict):
        raise RecordError(NOT_AN_OBJECT, f"messages record is a {type(record).__name__}, expected a JSON object")
    key, msgs = _messages(record)
    if key is None or msgs is None:
        raise RecordError(MISSING_FIELD, f"messages record has no 'messages' field (keys: {sorted(record)[:12]})")
    if isinstance(msgs, str):  # one prompt as a string: one user message, or refused as a guess (the detail says why)
        msgs = [{"role": "user", "content": single_prompt_text(msgs, key, "messages")}]
    if not isinstance(msgs, list):
        raise RecordError(BAD_FIELD_TYPE, f"field {key!r} is a {type(msgs).__name__}, expected a list of messages")
    tools = normalize_tools(record.get("tools"))
    messages: list[dict[str, Any]] = []
    system = record.get("system")
    if (isinstance(system, str) and system.strip()
            and not (msgs and isinstance(msgs[0], dict) and msgs[0].get("role") == "system")):
        messages.append({"role": "system", "content": system})
    for i, msg in enumerate(msgs):
        where = f"{key}[{i}]"
        if not isinstance(msg, dict):
            raise RecordError(BAD_FIELD_TYPE,
                              f"{where} is a {type(msg).__name__}, expected an object with role/content")
        role = canonical_role(msg.get("role"))
        text, part_reasoning, part_calls = content_text(msg.get("content"), where)
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        if not isinstance(reasoning, str):
            reasoning = part_reasoning
        calls = msg.get("tool_calls") or part_calls or None
        if role == "assistant" and calls is None and isinstance(msg.get("function_call"), dict):
            calls = [msg["function_call"]]  # legacy OpenAI single function_call
        messages.append(make_message(role, text, where, reasoning=reasoning, tool_calls=calls, name=msg.get("name")))
    return finalize(_split_parallel_results(messages), tools, row, record)


def _split_parallel_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each packed result message (see the module doc) split into one ``tool`` message per call.

    Only a ``tool`` message right after an assistant message with N > 1 calls whose text is a JSON array of N
    objects that each have ``content`` is split; anything else is kept as it is."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        prev = out[-1] if out else None
        n = len(prev.get("tool_calls") or []) if prev is not None and prev.get("role") == "assistant" else 0
        packed = None
        if msg.get("role") == "tool" and n > 1 and isinstance(msg.get("content"), str):
            try:
                packed = json.loads(msg["content"])
            except ValueError:
                packed = None
        if (isinstance(packed, list) and len(packed) == n
                and all(isinstance(e, dict) and "content" in e for e in packed)):
            for e in packed:
                body = e["content"] if isinstance(e["content"], str) else json.dumps(e["content"], ensure_ascii=False)
                part = {"role": "tool", "content": body}
                if isinstance(e.get("name"), str) and e["name"]:
                    part["name"] = e["name"]
                out.append(part)
        else:
            out.append(msg)
    return out
