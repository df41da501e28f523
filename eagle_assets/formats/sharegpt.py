"""ShareGPT layout: ``{"conversations": [{"from": ..., "value": ...}, ...], "system"?: str, "tools"?: str|list}``.

Covers the layouts seen in practice:
- FastChat / Vicuna ShareGPT (``from`` human/gpt, optional ``id``),
- LLaMA-Factory ``sharegpt`` with tool use (``from`` function_call / observation, top-level ``tools`` as a JSON
  string; ``data/glaive_toolcall_en_demo.json``; see LLaMA-Factory ``data/README.md``),
- OpenThoughts (``from`` user/assistant, top-level ``system``, assistant value with
  ``<|begin_of_thought|>...<|end_of_thought|><|begin_of_solution|>...<|end_of_solution|>``),
- NuminaMath CoT ShareGPT exports (``{"id", "conversations": [human, gpt]}``).

A ``function_call`` turn becomes an assistant message with ``tool_calls`` (merged into the preceding assistant
message when there is one); an ``observation`` turn becomes a ``tool`` message. A ``conversations`` field that holds
one prompt as a string is read as one human turn when that is unambiguous (``conversation.single_prompt_text``),
else the record is refused naming the field and the fix.
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    Conversation,
    RecordError,
    canonical_role,
    content_text,
    finalize,
    is_single_prompt,
    make_message,
    normalize_tool_calls,
    normalize_tools,
    single_prompt_text,
)

NAME = "sharegpt"
SIGNATURE_KEYS = ("conversations",)
_TURN_KEYS = ("conversations", "conversation")


def _turns(record: Any) -> Any:
    for key in _TURN_KEYS:
        if isinstance(record, dict) and key in record:
            return key, record[key]
    return None, None


def matches(record: Any) -> bool:
    """True when the record looks like ShareGPT: a conversations list whose first turn has ``from``/``value``, or
    one prompt string there that is read as one human turn."""
    _, turns = _turns(record)
    return (isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and "from" in turns[0]
            and "value" in turns[0]) or is_single_prompt(turns)


def parse(record: Any, row: int) -> Conversation:
    """One ShareGPT record -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    if not isinstance(record, dict):
        raise RecordError("not_an_object", f"sharegpt record is a {type(record).__name__}, expected a JSON object")
    key, turns = _turns(record)
    if key is None:
        raise RecordError("missing_field",
                          f"sharegpt record has no 'conversations' field (keys: {sorted(record)[:12]})")
    if isinstance(turns, str):  # one prompt as a string: one human turn, or refused as a guess (the detail says why)
        turns = [{"from": "human", "value": single_prompt_text(turns, key, "sharegpt")}]
    if not isinstance(turns, list):
        raise RecordError(BAD_FIELD_TYPE,
                          f"sharegpt field {key!r} is a {type(turns).__name__}, expected a list of turns")
    tools = normalize_tools(record.get("tools"))
    messages: list[dict[str, Any]] = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RecordError(BAD_FIELD_TYPE, f"sharegpt field 'system' is a {type(system).__name__}, expected text")
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(BAD_FIELD_TYPE, f"{where} is a {type(turn).__name__}, expected an object with from/value")
        speaker = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        if isinstance(speaker, str) and speaker.lower() == "function_call":
            calls = normalize_tool_calls(value, where)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1] = {**messages[-1], "tool_calls": messages[-1].get("tool_calls", []) + calls}
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        role = canonical_role(speaker)
        text, reasoning, calls = content_text(value, where)
        messages.append(make_message(role, text, where, reasoning=reasoning, tool_calls=calls or turn.get("tool_calls"),
                                     name=turn.get("name")))
    return finalize(messages, tools, row, record)
