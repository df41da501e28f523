"""Normalized conversation records and the rules every raw-layout loader shares.

Every loader in this package turns one raw record into either a :class:`Conversation` (OpenAI-style messages plus
OpenAI tool schemas) or a :class:`Rejected` with a named reason. Loaders never raise on bad records: a malformed
record is data, counted and written to the rejects table by the pipeline. Whatever a loader builds,
:func:`check_conversation` checks it before it is kept (roles, types, strict JSON, UTF-8), so no loader can let a
malformed conversation through.

Message shape (shared convention of the project)::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "reasoning_content": str (assistant, optional), "tool_calls": [{"type": "function",
     "function": {"name": str, "arguments": dict}}] (assistant, optional), "name": str (tool, optional)}

Tool shape: ``[{"type": "function", "function": {"name", "description", "parameters": <JSON schema, "object">}}]``
as in the OpenAI chat API and the ``tools`` argument of ``transformers`` ``apply_chat_template``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

# Reject reasons. Stable strings: they are stored in rejects.parquet and counted per partition.
BAD_JSON = "bad_json"  # a JSON Lines row that is not valid JSON
NOT_AN_OBJECT = "not_an_object"  # a record that is not a JSON object
MISSING_FIELD = "missing_field"  # a field the layout requires is absent or null
BAD_FIELD_TYPE = "bad_field_type"  # a field has the wrong type (conversations not a list, content a number...)
UNKNOWN_ROLE = "unknown_role"  # a speaker/role the layout does not define
EMPTY_PROMPT = "empty_prompt"  # a user turn with no text, or no message at all
NO_USER_TURN = "no_user_turn"  # nothing for the target to answer
INVALID_TOOL_ARGUMENTS = "invalid_tool_arguments"  # tool-call arguments are not a JSON object
INVALID_TOOL_CALL = "invalid_tool_call"  # a tool call without a function name
INVALID_TOOLS = "invalid_tools"  # the tool definitions are not a list of named function schemas
UNPARSEABLE_TEXT = "unparseable_text"  # raw text layouts (glaive) whose speaker markers cannot be found
INVALID_UNICODE = "invalid_unicode"  # a lone UTF-16 surrogate (JSON "\ud800") or a byte that is not UTF-8
NON_FINITE_NUMBER = "non_finite_number"  # NaN / Infinity in messages or tools: not JSON, a template would print NaN
MISSING_TOOL_DOCS = "missing_tool_docs"  # the record names tool docs kept in another file that cannot be found
UNDETECTED_LAYOUT = "undetected_layout"  # format auto: no known layout matches the file's records
TRUNCATED_FILE = "truncated_file"  # a compressed file ends mid-stream: the records after the cut are lost
DUPLICATE = "duplicate"  # the same raw record twice in one partition (same sample_id): one is kept
MALFORMED_RECORD = "malformed_record"  # any other structural surprise, caught so one record cannot stop a run

REJECT_REASONS: tuple[str, ...] = (
    BAD_JSON,
    NOT_AN_OBJECT,
    MISSING_FIELD,
    BAD_FIELD_TYPE,
    UNKNOWN_ROLE,
    EMPTY_PROMPT,
    NO_USER_TURN,
    INVALID_TOOL_ARGUMENTS,
    INVALID_TOOL_CALL,
    INVALID_TOOLS,
    UNPARSEABLE_TEXT,
    INVALID_UNICODE,
    NON_FINITE_NUMBER,
    MISSING_TOOL_DOCS,
    UNDETECTED_LAYOUT,
    TRUNCATED_FILE,
    DUPLICATE,
    MALFORMED_RECORD,
)


@dataclass(frozen=True)
class Conversation:
    """One normalized conversation.

    Attributes:
        messages: OpenAI-style message dicts (see module docstring); never empty, contains a user turn, no two
            user turns in a row.
        tools: OpenAI tool schemas, or None when the record defines no tools.
        source_row: 0-based index of the record in its source file (line number for JSON Lines, list index for
            JSON arrays).
        source_record: the raw record exactly as read (used for the stable ``sample_id``).
        later_turns: user-side messages of later turns that follow the model's own replies, which the file does
            not hold (MT-bench turns without references, BFCL multi-turn ``question[1:]``), one list per turn; only
            prompt policy ``all_turns`` uses them (``formats.prompt.all_turns``).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    source_row: int
    source_record: Any = field(repr=False)
    later_turns: tuple[list[dict[str, Any]], ...] = ()


@dataclass(frozen=True)
class Rejected:
    """A raw record that could not become a Conversation.

    Attributes:
        source_row: 0-based index of the record in its source file.
        reason: one of :data:`REJECT_REASONS`.
        detail: human-readable explanation naming the field and the offending value.
    """

    source_row: int
    reason: str
    detail: str


class RecordError(Exception):
    """Raised inside loaders to turn a record into a :class:`Rejected`; never escapes ``load_records``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_ROLE_ALIASES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system role
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",  # legacy OpenAI function-result role
    "ipython": "tool",  # Llama 3 tool-result role
    "observation": "tool",
}


def canonical_role(role: Any) -> str:
    """Map a layout's speaker name to system/user/assistant/tool; raises RecordError(unknown_role)."""
    if isinstance(role, str) and role.strip().lower() in _ROLE_ALIASES:
        return _ROLE_ALIASES[role.strip().lower()]
    raise RecordError(UNKNOWN_ROLE, f"role {role!r} is not one of {sorted(set(_ROLE_ALIASES))}")


def content_text(content: Any, where: str) -> tuple[str, str | None, list[Any]]:
    """Flatten a message content into (text, reasoning or None, embedded tool-call values).

    Accepts a string, None (empty), or a list of parts: OpenAI ``{"type": "text", "text": ...}``, LLaMA-Factory
    ``{"type": "text"|"reasoning"|"tool_call", "value": ...}``, or bare strings. Image/audio parts have no text
    for a text-only target and raise.
    """
    if content is None:
        return "", None, []
    if isinstance(content, str):
        return content, None, []
    if not isinstance(content, list):
        raise RecordError(BAD_FIELD_TYPE,
                          f"{where}: content is a {type(content).__name__}, expected text or a list of parts")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[Any] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise RecordError(BAD_FIELD_TYPE, f"{where}: content part {i} is a {type(part).__name__}")
        kind = part.get("type", "text")
        value = part.get("text", part.get("value"))
        if kind == "text":
            if not isinstance(value, str):
                raise RecordError(BAD_FIELD_TYPE, f"{where}: text part {i} has no string 'text'/'value'")
            texts.append(value)
        elif kind in ("reasoning", "thinking"):
            if isinstance(value, str):
                reasoning.append(value)
        elif kind in ("tool_call", "function_call"):
            calls.append(value)
        else:
            raise RecordError(BAD_FIELD_TYPE,
                              f"{where}: content part {i} has type {kind!r}; only text parts are supported")
    return "".join(texts), ("\n".join(reasoning) if reasoning else None), calls


_THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*(.*)$", re.DOTALL)
_THOUGHT_RE = re.compile(
    r"^\s*<\|begin_of_thought\|>(.*?)<\|end_of_thought\|>\s*(?:<\|begin_of_solution\|>(.*?)(?:<\|end_of_solution\|>|$))?(.*)$",
    re.DOTALL,
)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split an assistant text with inline reasoning into (reasoning_content, content).

    Recognizes ``<think>...</think>`` (DeepSeek-R1 / Qwen3 / Mixture-of-Thoughts; also a bare ``...</think>``
    whose opening tag was part of the prompt) and OpenThoughts'
    ``<|begin_of_thought|>...<|end_of_thought|><|begin_of_solution|>...<|end_of_solution|>``. Text without these
    markers is returned unchanged with reasoning None.
    """
    m = _THINK_RE.match(text)
    if m:
        return m.group(1).strip("\n"), m.group(2).strip()
    if "</think>" in text and "<think>" not in text:
        # R1-style data whose template already emitted the opening <think> in the prompt.
        before, _, after = text.partition("</think>")
        return before.strip("\n"), after.strip()
    m = _THOUGHT_RE.match(text)
    if m:
        solution = m.group(2) if m.group(2) is not None else m.group(3)
        return m.group(1).strip(), (solution or "").strip()
    return None, text


def parse_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """Tool-call arguments as a dict: dicts pass, JSON-object strings are parsed, '' means no arguments."""
    if arguments is None:
        return {}
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise RecordError(INVALID_TOOL_ARGUMENTS, f"{where}: arguments are not valid JSON ({e.msg} at char "
                              f"{e.pos}): {arguments[:120]!r}") from None
        if isinstance(value, dict):
            return value
        raise RecordError(INVALID_TOOL_ARGUMENTS,
                          f"{where}: arguments decode to a {type(value).__name__}, expected a JSON object")
    raise RecordError(INVALID_TOOL_ARGUMENTS,
                      f"{where}: arguments are a {type(arguments).__name__}, expected a JSON object or string")


def normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    """One tool call (OpenAI ``{"type","function":{"name","arguments"}}``, bare ``{"name","arguments"}``, or
    a JSON string of either) -> ``{"type": "function", "function": {"name": str, "arguments": dict}}``."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError as e:
            raise RecordError(INVALID_TOOL_ARGUMENTS,
                              f"{where}: tool call is not valid JSON ({e.msg}): {call[:120]!r}") from None
    if not isinstance(call, dict):
        raise RecordError(INVALID_TOOL_CALL, f"{where}: tool call is a {type(call).__name__}, expected an object")
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RecordError(INVALID_TOOL_CALL, f"{where}: tool call has no function name")
    args = parse_arguments(fn.get("arguments", fn.get("parameters")), f"{where} ({name})")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """A list (or one call, or a JSON string of either) of tool calls, normalized by :func:`normalize_tool_call`."""
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError as e:
            raise RecordError(INVALID_TOOL_ARGUMENTS,
                              f"{where}: tool calls are not valid JSON ({e.msg}): {calls[:120]!r}") from None
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise RecordError(INVALID_TOOL_CALL, f"{where}: tool_calls is a {type(calls).__name__}, expected a list")
    return [normalize_tool_call(c, f"{where} call {i}") for i, c in enumerate(calls)]


# Python and BFCL type names seen in the wild -> JSON-schema type names the chat templates and SGLang expect.
_SCHEMA_TYPES = {
    "dict": "object",
    "object": "object",
    "str": "string",
    "string": "string",
    "int": "integer",
    "integer": "integer",
    "float": "number",
    "number": "number",
    "double": "number",
    "bool": "boolean",
    "boolean": "boolean",
    "list": "array",
    "tuple": "array",
    "array": "array",
    "null": "null",
    "none": "null",
}


def _type_name(value: str) -> str:
    # xLAM / ToolBench write "str, optional" or "List[int]"; keep the base type.
    base = value.split(",")[0].strip()
    base = base.split("[")[0].strip().lower()
    return _SCHEMA_TYPES.get(base, value)


def normalize_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as a JSON-schema object. xLAM / ToolBench data (LLaMA-Factory's
    reason_tool_use_demo) give a bare ``{name: {"type", "description", "default"}}`` map without the
    ``{"type": "object", "properties": ...}`` wrapper; it is wrapped here."""
    looks_bare = (
        "type" not in params
        and "properties" not in params
        and bool(params)
        and all(isinstance(v, dict) and ("type" in v or "description" in v) for v in params.values())
    )
    if looks_bare:
        params = {"type": "object", "properties": params}
    elif "type" not in params and "properties" in params:
        params = {"type": "object", **params}
    return normalize_schema(params)


def normalize_schema(schema: Any) -> Any:
    """Recursively rewrite non-standard type names (BFCL's ``"dict"``, ``"float"``, ``"tuple"``, LLaMA-Factory's
    ``"str"``) to JSON-schema names. Unknown names (``"any"``) are left as they are; other keys are kept."""
    if isinstance(schema, list):
        return [normalize_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = _type_name(value)
        elif key == "type" and isinstance(value, list):
            out[key] = [_type_name(v) if isinstance(v, str) else v for v in value]
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: normalize_schema(prop) for name, prop in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "prefixItems"):
            out[key] = normalize_schema(value)
        else:
            out[key] = value
    return out


def normalize_tools(tools: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    """Tool definitions (list or JSON string; OpenAI-wrapped or bare function schemas) -> OpenAI tool list.

    Returns None for absent/empty tools. The parameters schema is normalized with :func:`normalize_parameters`
    and defaults to an empty object schema.
    """
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RecordError(INVALID_TOOLS, f"{where}: not valid JSON ({e.msg} at char {e.pos})") from None
        if tools in (None, []):
            return None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise RecordError(INVALID_TOOLS, f"{where}: a {type(tools).__name__}, expected a list of function schemas")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RecordError(INVALID_TOOLS, f"{where}[{i}]: a {type(tool).__name__}, expected an object")
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise RecordError(INVALID_TOOLS, f"{where}[{i}]: function schema has no name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise RecordError(INVALID_TOOLS, f"{where}[{i}] ({name}): parameters is a {type(params).__name__}, "
                              "expected a JSON schema object")
        spec: dict[str, Any] = {"name": name}
        if isinstance(fn.get("description"), str):
            spec["description"] = fn["description"]
        spec["parameters"] = normalize_parameters(params)
        out.append({"type": "function", "function": spec})
    return out


def make_message(role: str, content: str, where: str, *, reasoning: str | None = None,
                 tool_calls: Any = None, name: Any = None) -> dict[str, Any]:
    """Build one normalized message; assistant content with inline ``<think>`` is split into reasoning_content."""
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if reasoning is None:
            reasoning, content = split_reasoning(content)
            msg["content"] = content
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = normalize_tool_calls(tool_calls, where)
    if role == "tool" and isinstance(name, str) and name:
        msg["name"] = name
    return msg


def finalize(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, row: int, record: Any) -> Conversation:
    """Apply the shared conversation rules and build the Conversation.

    Rules: empty system messages are dropped; consecutive user turns are merged with ``"\\n\\n"`` (templates
    assume alternation); every user turn must have non-blank text (else ``empty_prompt``); at least one user turn
    (else ``no_user_turn``).
    """
    merged: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "system" and not msg["content"].strip():
            continue
        if msg["role"] == "user" and not msg["content"].strip():
            raise RecordError(EMPTY_PROMPT, f"message {len(merged)} (user) has no text")
        if msg["role"] == "user" and merged and merged[-1]["role"] == "user":
            merged[-1] = {**merged[-1], "content": merged[-1]["content"] + "\n\n" + msg["content"]}
            continue
        merged.append(msg)
    if not merged:
        raise RecordError(EMPTY_PROMPT, "the record has no messages")
    if not any(m["role"] == "user" for m in merged):
        raise RecordError(NO_USER_TURN, f"no user turn among roles {[m['role'] for m in merged]}")
    return Conversation(messages=merged, tools=tools, source_row=row, source_record=record)


def require(record: Any, key: str, kind: type | tuple[type, ...], layout: str) -> Any:
    """record[key] checked for presence and type; raises RecordError(missing_field | bad_field_type)."""
    if not isinstance(record, dict):
        raise RecordError(NOT_AN_OBJECT, f"{layout} record is a {type(record).__name__}, expected a JSON object")
    if record.get(key) is None:
        raise RecordError(MISSING_FIELD,
                          f"{layout} record has no {key!r} field, or it is null (keys: {sorted(record)[:12]})")
    value = record[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise RecordError(BAD_FIELD_TYPE, f"{layout} field {key!r} is a {type(value).__name__}, expected {names}")
    return value


# A reply inside a text that stands where a layout expects a list of turns: a line that opens with an assistant
# speaker (``ASSISTANT:``, ``gpt:``, markdown ``### Assistant:``) or a chat template's turn marker. Such a text is a
# whole transcript, and reading it as one user prompt would put the reply into the prompt the target answers.
_TRANSCRIPT_MARK = re.compile(
    r"(?im)^[ \t#*>]*(?:assistant|gpt|bot|chatbot|model)[ \t]*:|<\|im_start\|>|<\|start_header_id\|>|<\|assistant\|>"
    r"|\[/INST\]")


def single_prompt_text(value: Any, field: str, layout: str) -> str:
    """``value``, a layout's turns field (``turns``, ``messages``, ``conversations``...) that holds one prompt as a
    string instead of a list of turns (public eval files do this: MT-bench-like ``{"turns": "..."}``), checked to be
    read as one user prompt.

    Raises:
        RecordError: ``bad_field_type`` when ``value`` is not a string, or when reading it as one prompt would be a
            guess: a string holding JSON (a list or object: encoded turns, to decode in the file) or a whole
            transcript (a line opening with an assistant speaker or a chat template's turn marker); the detail
            names the field and the fix. ``empty_prompt`` for a blank string.
    """
    if not isinstance(value, str):
        raise RecordError(BAD_FIELD_TYPE, f"{layout} field {field!r} is a {type(value).__name__}, expected a list of "
                                          "turns or one prompt string")
    text = value.strip()
    if not text:
        raise RecordError(EMPTY_PROMPT, f"{layout} field {field!r} is an empty string")
    if text[0] in "[{":
        try:
            decoded = json.loads(text)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, (list, dict)):
            kind = "list" if isinstance(decoded, list) else "object"
            raise RecordError(BAD_FIELD_TYPE, f"{layout} field {field!r} is a string holding JSON (a {kind}), not a "
                                              f"list of turns: decode it in the file (jq -c '.{field} |= fromjson' "
                                              "in.jsonl > out.jsonl), then read it again")
    mark = _TRANSCRIPT_MARK.search(value)
    if mark is not None:
        raise RecordError(BAD_FIELD_TYPE, f"{layout} field {field!r} is one string holding a whole conversation "
                                          f"(it has {mark.group(0).strip()!r} at a line start), not a list of turns: "
                                          "split it into a list of turns in the file (USER: / ASSISTANT: text can "
                                          "instead go in a field 'chat', read by format glaive)")
    return value


def is_single_prompt(value: Any) -> bool:
    """Whether :func:`single_prompt_text` reads ``value`` as one user prompt (for a layout's ``matches``)."""
    try:
        single_prompt_text(value, "", "")
    except RecordError:
        return False
    return True


def reference_text(value: Any) -> str | None:
    """A dataset's reference answer as text, or None when it has none usable; never raises.

    A reference is kept for comparison only (the training target is the target model's own generation), so it is
    never a reason to drop a prompt: strings pass, finite numbers (AMC/AIME's ``"answer": 27.0``) are written as
    JSON numbers (``"27.0"``), and anything else (a list, an object, a bool, NaN, text that is not valid Unicode)
    gives None -- the prompt is kept without a reference.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        try:
            return json.dumps(value)
        except ValueError:  # an integer past Python's int-to-str digit limit
            return None
    if isinstance(value, str) and _utf8_ok(value):
        return value
    return None


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_path(value: Any, bad, where: str) -> str | None:
    """Path (``messages[2].content``) of the first string or number in ``value`` for which ``bad`` is true, dict
    keys included; iterative, so a deeply nested record cannot exhaust the stack."""
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                if bad(k):
                    return f"{path} (a key)"
                stack.append((f"{path}[{k!r}]", x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
        elif bad(v):
            return path
    return None


def _bad_unicode(v: Any) -> bool:
    return isinstance(v, str) and not _utf8_ok(v)


def _describe_bad_char(ch: str) -> str:
    cp = ord(ch)
    if 0xDC80 <= cp <= 0xDCFF:  # how the reader's surrogateescape carries a byte that is not UTF-8
        return f"the byte 0x{cp - 0xDC00:02x}, which is not UTF-8 (or the lone surrogate \\u{cp:04x})"
    return f"the lone UTF-16 surrogate \\u{cp:04x}"


def _non_finite(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


VALID_ROLES = ("system", "user", "assistant", "tool")


def _check_tool_call(call: Any, where: str) -> None:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and call.get("type") == "function"):
        raise RecordError(INVALID_TOOL_CALL, f"{where}: not a {{'type': 'function', 'function': {{...}}}} tool call")
    if not (isinstance(fn.get("name"), str) and fn["name"].strip()):
        raise RecordError(INVALID_TOOL_CALL, f"{where}: tool call has no function name")
    if not isinstance(fn.get("arguments"), dict):
        raise RecordError(INVALID_TOOL_ARGUMENTS, f"{where} ({fn['name']}): arguments are not a JSON object")


def _check_tool(tool: Any, where: str) -> None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(fn, dict) and tool.get("type") == "function"):
        raise RecordError(INVALID_TOOLS, f"{where}: not a {{'type': 'function', 'function': {{...}}}} tool")
    name = fn.get("name")
    if not (isinstance(name, str) and name.strip()):
        raise RecordError(INVALID_TOOLS, f"{where}: function schema has no name")
    if "description" in fn and not isinstance(fn["description"], str):
        raise RecordError(INVALID_TOOLS,
                          f"{where} ({name}): description is a {type(fn['description']).__name__}, expected text")
    params = fn.get("parameters")
    if not (isinstance(params, dict) and params.get("type") == "object"):
        raise RecordError(INVALID_TOOLS, f"{where} ({name}): parameters are not a JSON schema of type 'object'")
    props = params.get("properties", {})
    if not (isinstance(props, dict) and all(isinstance(p, dict) for p in props.values())):
        raise RecordError(INVALID_TOOLS, f"{where} ({name}): 'properties' is not an object of property schemas")
    required = params.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise RecordError(INVALID_TOOLS, f"{where} ({name}): 'required' is not a list of property names")


def check_conversation(conv: Conversation) -> Conversation:
    """Every rule a kept conversation satisfies, checked on the normalized result (whatever loader built it).

    Messages: a non-empty list of dicts, role in :data:`VALID_ROLES`, ``content`` text, ``reasoning_content`` and
    ``name`` text when present, ``tool_calls`` (assistant only) a list of ``{"type": "function", "function":
    {"name": str, "arguments": dict}}``; at least one user turn with text. Tools: None or a list of
    ``{"type": "function", "function": {"name", "description"?, "parameters": {"type": "object",
    "properties"?: {name: schema}, "required"?: [str]}}}``. Everything JSON-serialisable as strict JSON (no NaN or
    Infinity) and encodable as UTF-8 (no lone surrogates), so it can be stored, rendered and tokenized.

    Returns ``conv`` unchanged. Raises RecordError (``unknown_role``, ``bad_field_type``, ``no_user_turn``,
    ``invalid_tool_call``, ``invalid_tool_arguments``, ``invalid_tools``, ``invalid_unicode``,
    ``non_finite_number``, ``malformed_record``) naming the offending field.
    """
    msgs = conv.messages
    if not isinstance(msgs, list) or not msgs:
        raise RecordError(EMPTY_PROMPT, "the record has no messages")
    for i, m in enumerate(msgs):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise RecordError(MALFORMED_RECORD, f"{where} is a {type(m).__name__}, expected an object")
        role = m.get("role")
        if role not in VALID_ROLES:
            raise RecordError(UNKNOWN_ROLE, f"{where}: role {role!r} is not one of {list(VALID_ROLES)}")
        for key in ("content", "reasoning_content", "name"):
            if (key == "content" or key in m) and not isinstance(m.get(key), str):
                raise RecordError(BAD_FIELD_TYPE,
                                  f"{where} ({role}): {key} is a {type(m.get(key)).__name__}, expected text")
        if "tool_calls" in m:
            if role != "assistant" or not isinstance(m["tool_calls"], list):
                raise RecordError(INVALID_TOOL_CALL,
                                  f"{where} ({role}): tool_calls must be a list on an assistant message")
            for j, call in enumerate(m["tool_calls"]):
                _check_tool_call(call, f"{where} call {j}")
    if not any(m["role"] == "user" and m["content"].strip() for m in msgs):
        raise RecordError(NO_USER_TURN, f"no user turn with text among roles {[m['role'] for m in msgs]}")
    if conv.tools is not None:
        if not isinstance(conv.tools, list) or not conv.tools:
            raise RecordError(INVALID_TOOLS, "tools must be None or a non-empty list of function schemas")
        for i, tool in enumerate(conv.tools):
            _check_tool(tool, f"tools[{i}]")
    for where, value in (("messages", msgs), ("tools", conv.tools)):
        bad = _first_path(value, _non_finite, where)
        if bad is not None:
            raise RecordError(NON_FINITE_NUMBER,
                              f"{bad} is NaN or Infinity, which strict JSON (and a chat template's tojson) cannot hold")
        try:
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = _first_path(value, _bad_unicode, where)
            raise RecordError(INVALID_UNICODE, f"{bad} holds {_describe_bad_char(e.object[e.start])}: it cannot be "
                              "encoded as UTF-8 or tokenized; repair the text in the source") from None
        except (TypeError, ValueError, RecursionError) as e:
            raise RecordError(MALFORMED_RECORD,
                              f"the normalized {where} are not JSON-serialisable ({type(e).__name__}: {e})") from None
    return conv
