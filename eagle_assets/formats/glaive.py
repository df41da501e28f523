"""glaive-function-calling-v2 raw text layout:
``{"system": "SYSTEM: ...", "chat": "USER: ...\\n\\n\\nASSISTANT: ..."}``.

The system text is ``SYSTEM: You are a helpful assistant with access to the following functions. Use them if
required -`` followed by one or more pretty-printed function JSON schemas separated by blank lines (or ``..., with
no access to external functions.``). The chat is a sequence of ``USER:``, ``ASSISTANT:`` and ``FUNCTION RESPONSE:``
blocks separated by blank lines; assistant blocks end with ``<|endoftext|>``; a call is
``<functioncall> {"name": "f", "arguments": '{"x": 1}'}`` -- the arguments are a JSON document wrapped in single
quotes, so the call as a whole is not valid JSON and is parsed here by position.

Normalized result: system text without the schemas, the schemas as OpenAI ``tools``, user/assistant/tool messages,
``<functioncall>`` blocks as assistant ``tool_calls``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    INVALID_TOOL_ARGUMENTS,
    INVALID_TOOL_CALL,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    UNPARSEABLE_TEXT,
    Conversation,
    RecordError,
    finalize,
    make_message,
    normalize_tools,
)

NAME = "glaive"
SIGNATURE_KEYS = ("chat",)
_SPEAKERS = {"SYSTEM": "system", "USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
_SPEAKER_RE = re.compile(r"(?:^|\n)[ \t]*(SYSTEM|USER|ASSISTANT|FUNCTION RESPONSE):[ \t]?")
_EOT = "<|endoftext|>"
_CALL_TAG = "<functioncall>"
_QUOTED_ARGS_RE = re.compile(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*\'(.*)\'\s*\}$',
                             re.DOTALL)


def matches(record: Any) -> bool:
    """True when the record has a string ``chat`` field with glaive speaker markers."""
    return isinstance(record, dict) and isinstance(record.get("chat"), str) and "USER:" in record["chat"]


def _split_system(system: str) -> tuple[str, list[Any]]:
    """System text -> (instruction text, function schemas decoded from the JSON objects embedded in it)."""
    text = re.sub(r"^\s*SYSTEM:\s*", "", system)
    decoder = json.JSONDecoder()
    schemas: list[Any] = []
    first = text.find("{")
    if first < 0:
        return text.strip(), schemas
    head, pos = text[:first], first
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        if text[pos] != "{":
            break
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise RecordError("invalid_tools",
                              f"system: function schema at char {pos} is not valid JSON ({e.msg})") from None
        schemas.append(value)
        pos = end
    tail = text[pos:].strip()
    instruction = (head.strip() + ("\n\n" + tail if tail else "")).strip()
    return instruction, schemas


def _parse_call(body: str, where: str) -> dict[str, Any]:
    body = body.strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        m = _QUOTED_ARGS_RE.match(body)
        if not m:
            raise RecordError(INVALID_TOOL_CALL, f"{where}: <functioncall> body is neither JSON nor name+quoted "
                              f"arguments: {body[:120]!r}") from None
        name = json.loads(f'"{m.group(1)}"')
        raw = m.group(2)
        try:
            args = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise RecordError(INVALID_TOOL_ARGUMENTS,
                              f"{where} ({name}): arguments are not valid JSON ({e.msg}): {raw[:120]!r}") from None
        call = {"name": name, "arguments": args}
    if not isinstance(call, dict):
        raise RecordError(INVALID_TOOL_CALL, f"{where}: <functioncall> body is a {type(call).__name__}")
    return call


def parse(record: Any, row: int) -> Conversation:
    """One glaive record -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    if not isinstance(record, dict):
        raise RecordError(NOT_AN_OBJECT, f"glaive record is a {type(record).__name__}, expected a JSON object")
    chat = record.get("chat")
    if chat is None:
        raise RecordError(MISSING_FIELD, f"glaive record has no 'chat' field (keys: {sorted(record)[:12]})")
    if not isinstance(chat, str):
        raise RecordError(BAD_FIELD_TYPE, f"glaive field 'chat' is a {type(chat).__name__}, expected text")
    system = record.get("system") or ""
    if not isinstance(system, str):
        raise RecordError(BAD_FIELD_TYPE, f"glaive field 'system' is a {type(system).__name__}, expected text")
    messages: list[dict[str, Any]] = []
    tools = None
    if system.strip():
        instruction, schemas = _split_system(system)
        tools = normalize_tools(schemas, "system functions") if schemas else None
        if instruction:
            messages.append({"role": "system", "content": instruction})

    marks = list(_SPEAKER_RE.finditer(chat))
    if not marks or chat[: marks[0].start()].strip():
        raise RecordError(UNPARSEABLE_TEXT, f"chat does not start with a USER:/ASSISTANT: marker: {chat[:80]!r}")
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(chat)
        role = _SPEAKERS[m.group(1)]
        text = chat[m.end():end].strip()
        where = f"chat block {i} ({m.group(1)})"
        if role == "assistant":
            text = text.removesuffix(_EOT).strip()
            if _CALL_TAG in text:
                before, _, body = text.partition(_CALL_TAG)
                call = _parse_call(body.replace(_EOT, ""), where)
                messages.append(make_message("assistant", before.strip(), where, reasoning=None, tool_calls=[call]))
                continue
        elif _EOT in text:
            text = text.replace(_EOT, "").strip()
        messages.append(make_message(role, text, where))
    return finalize(messages, tools, row, record)
