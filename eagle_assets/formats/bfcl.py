"""Berkeley Function-Calling Leaderboard layout (ShishirPatil/gorilla
``berkeley-function-call-leaderboard/bfcl_eval/data/BFCL_v4_*.json``; JSON Lines despite the extension):
``{"id": str, "question": [[{"role", "content"}, ...], ...], "function": [{"name", "description",
"parameters": {"type": "dict", "properties": {...}, "required": [...]}}]}``.

``question`` is a list of turns, each a list of messages. Later turns of multi-turn categories follow the model's
own replies (not in the file), so only the first turn is the prompt; the later ones are the conversation's
``later_turns``, which prompt policy ``all_turns`` asks after the model's replies (BFCL's execution results are not
in the files, so a reply that calls a tool ends its conversation there: no tool is executed). The function
schemas use Python type names (``"dict"``, ``"float"``, ``"tuple"``) and are normalized to JSON schema
(``"object"``, ``"number"``, ``"array"``) so chat templates render them as real tool definitions.

Multi-turn categories (``BFCL_v4_multi_turn_{base,miss_func,miss_param,long_context}.json``) carry no
``function`` field: a record names its API classes in ``involved_classes`` (``["TwitterAPI",
"GorillaFileSystem"]``) and the function docs live in ``multi_turn_func_doc/<file>.json`` beside the data files
(one JSON Lines file per class; BFCL's ``MULTI_TURN_FUNC_DOC_FILE_MAPPING`` in
``bfcl_eval/constants/executable_backend_config.py`` maps class -> file, e.g. ``TwitterAPI -> posting_api.json``).
They are loaded the way BFCL's own ``populate_test_cases_with_predefined_functions`` (``bfcl_eval/utils.py``)
does: every involved class's docs, in ``involved_classes`` order; a ``miss_func`` record's ``missed_function``
(``{"<turn>": [names]}``) are held out until that turn, so for the first-turn prompt they are removed. A class
whose docs cannot be found rejects the record as ``missing_tool_docs`` (a tool prompt without its tools would
teach the drafter the wrong distribution).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    EMPTY_PROMPT,
    MISSING_TOOL_DOCS,
    Conversation,
    RecordError,
    canonical_role,
    content_text,
    finalize,
    make_message,
    normalize_tools,
    require,
)
from eagle_assets.formats.reader import BadLine, FormatError, iter_raw_records

NAME = "bfcl"
SIGNATURE_KEYS = ("function", "involved_classes")
FUNC_DOC_DIR = "multi_turn_func_doc"
# bfcl_eval/constants/executable_backend_config.py (gorilla commit 6a34c9e), MULTI_TURN_FUNC_DOC_FILE_MAPPING.
FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json",
    "MemoryAPI_kv": "memory_kv.json",
    "MemoryAPI_vector": "memory_vector.json",
    "MemoryAPI_rec_sum": "memory_rec_sum.json",
}


def matches(record: Any) -> bool:
    """True when the record has a list-valued ``question`` and a ``function`` or ``involved_classes`` field."""
    return (isinstance(record, dict) and isinstance(record.get("question"), list)
            and ("function" in record or "involved_classes" in record))


class FuncDocs:
    """The multi-turn function docs of one source file: ``multi_turn_func_doc/`` beside it (BFCL's layout) or
    beside its parent directory; each class file is read once."""

    def __init__(self, source: Path):
        self.dirs = [source.parent / FUNC_DOC_DIR, source.parent.parent / FUNC_DOC_DIR]
        self._cache: dict[str, list[Any] | RecordError] = {}

    def _candidates(self, cls: str) -> list[str]:
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls).lower()
        names = [FUNC_DOC_FILES.get(cls), f"{cls}.json", f"{snake}.json"]
        return list(dict.fromkeys(n for n in names if n))

    def _load(self, cls: str) -> list[Any]:
        for d in self.dirs:
            for name in self._candidates(cls):
                path = d / name
                if not path.is_file():
                    continue
                try:
                    docs = list(iter_raw_records(path))
                except FormatError as e:
                    raise RecordError(MISSING_TOOL_DOCS, f"function docs of {cls} cannot be read: {e}") from None
                bad = [rec.detail for _, rec in docs if isinstance(rec, BadLine)]
                if bad:
                    raise RecordError(MISSING_TOOL_DOCS, f"function docs of {cls} in {path} are broken: {bad[0]}")
                return [rec for _, rec in docs]
        tried = [str(d / n) for d in self.dirs[:1] for n in self._candidates(cls)]
        if cls == "MemoryAPI":  # BFCL_v4_memory.json: bfcl_eval/utils.py process_memory_test_case picks the class
            hint = ("BFCL's memory category names a backend (MemoryAPI_kv / _vector / _rec_sum) only at evaluation "
                    "time and needs prerequisite conversations; it is not supported (README, Formats)")
        else:
            hint = "put BFCL's multi_turn_func_doc/ directory beside the source file (as in bfcl_eval/data/)"
        raise RecordError(MISSING_TOOL_DOCS, f"involved class {cls!r}: no function docs at {tried}; {hint}")

    def functions(self, cls: str) -> list[Any]:
        if cls not in self._cache:
            try:
                self._cache[cls] = self._load(cls)
            except RecordError as e:
                self._cache[cls] = e
        got = self._cache[cls]
        if isinstance(got, RecordError):
            raise RecordError(got.reason, got.detail)
        return list(got)


def _multi_turn_functions(record: dict, docs: FuncDocs | None) -> list[Any]:
    classes = record.get("involved_classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise RecordError(BAD_FIELD_TYPE, f"bfcl field 'involved_classes' is a {type(classes).__name__}, "
                          "expected a list of class names")
    if docs is None:
        raise RecordError(MISSING_TOOL_DOCS, f"involved classes {classes} need the multi_turn_func_doc/ directory; "
                          "load the file by path (load_records) so it can be found")
    functions = [f for cls in classes for f in docs.functions(cls)]
    missed = record.get("missed_function") or {}
    if not isinstance(missed, dict):
        raise RecordError(BAD_FIELD_TYPE,
                          f"bfcl field 'missed_function' is a {type(missed).__name__}, expected {{turn: [names]}}")
    # A function missed until turn k > 0 is not available in the first turn (BFCL removes it from the doc list).
    held_out = {n for turn, names in missed.items() if str(turn) != "0" and isinstance(names, list)
                for n in names if isinstance(n, str)}
    return [f for f in functions
            if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"] in held_out)]


def parse(record: Any, row: int, docs: FuncDocs | None = None) -> Conversation:
    """One BFCL entry -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    question = require(record, "question", list, "bfcl")
    if not question:
        raise RecordError(EMPTY_PROMPT, "bfcl field 'question' is an empty list")
    first = question[0]
    if isinstance(first, dict):  # older BFCL versions: a flat list of messages
        first = question
    if not isinstance(first, list):
        raise RecordError(BAD_FIELD_TYPE, f"bfcl question[0] is a {type(first).__name__}, expected a list of messages")
    if record.get("function") or "involved_classes" not in record:
        tools = normalize_tools(record.get("function"), "function")
    else:
        tools = normalize_tools(_multi_turn_functions(record, docs), "multi_turn_func_doc")
    messages: list[dict[str, Any]] = []
    for i, msg in enumerate(first):
        where = f"question[0][{i}]"
        if not isinstance(msg, dict):
            raise RecordError(BAD_FIELD_TYPE,
                              f"{where} is a {type(msg).__name__}, expected an object with role/content")
        role = canonical_role(msg.get("role"))
        text, reasoning, calls = content_text(msg.get("content"), where)
        messages.append(make_message(role, text, where, reasoning=reasoning, tool_calls=calls or msg.get("tool_calls")))
    return dataclasses.replace(finalize(messages, tools, row, record), later_turns=_later_turns(record, question))


def _later_turns(record: dict, question: list) -> tuple[list[dict[str, Any]], ...]:
    """``question[1:]`` as user-side turns for prompt policy ``all_turns`` (they follow the model's own replies).
    Not for a ``miss_func`` record (its tool set grows at a later turn, which one prompt's tools cannot say), nor
    from the first turn that is empty or not a list of user/system messages with text on."""
    if record.get("missed_function") or not isinstance(question[0], list):
        return ()
    turns = []
    for i, turn in enumerate(question[1:], 1):
        if not isinstance(turn, list) or not turn:
            break
        msgs = []
        for j, msg in enumerate(turn):
            try:
                role = canonical_role(msg.get("role")) if isinstance(msg, dict) else None
                text, _, _ = content_text(msg.get("content"), f"question[{i}][{j}]") if role else ("", None, [])
            except RecordError:
                role = None
            if role not in ("user", "system") or not text.strip():
                return tuple(turns)
            msgs.append({"role": role, "content": text})
        turns.append(msgs)
    return tuple(turns)


def parser_for(path: Path):
    """``parse`` bound to the function docs found beside ``path`` (read lazily, once per class)."""
    return functools.partial(parse, docs=FuncDocs(Path(path)))
