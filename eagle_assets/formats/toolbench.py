"""ToolBench layouts (OpenBMB/ToolBench, ``data/instruction/G{1,2,3}_query.json`` and
``data/answer/G*_answer/<id>_<method>.json``).

Query files: a JSON array of ``{"api_list": [{"category_name", "tool_name", "api_name", "api_description",
"required_parameters": [{"name", "type", "description", "default"}], "optional_parameters": [...], "method",
"template_response"?}], "query": str, "relevant APIs": [[tool, api], ...], "query_id": int}``. The APIs become
OpenAI function schemas the way ToolBench's own ``rapidapi_wrapper.api_json_to_openai_json``
(``toolbench/inference/Downstream_tasks/rapidapi.py``) builds them: name ``<api>_for_<tool>`` (both passed
through ToolBench's ``standardize``/``change_name``, cut to the last 64 characters), description ``This is the
subfunction for tool "<tool>", ...`` (API description cut to 256 characters), parameter types NUMBER -> integer,
STRING -> string, BOOLEAN -> boolean, anything else string, a non-empty ``default`` kept as ``example_value``;
then ToolBench's ``Finish`` function. One deviation: ToolBench adds the optional parameters only when an API also
has required ones; here they are always added (as not required). ToolBench's AutoGPT system prompt is not added:
the target's chat template renders the tools. The user turn is the query.

Answer trees (one JSON document per file, or many in JSON Lines): ``{"answer_generation": {"valid_data",
"query", "function": [OpenAI function schemas, Finish included], "train_messages": [[messages], ...],
"final_answer", ...}, "tree": ..., "win": ...}``. ``train_messages`` holds one growing prefix per step; the longest
is the whole chain (system prompt, user query, assistant ``function_call`` turns, ``function`` results), read as
the ``messages`` layout with ``answer_generation.function`` as the tools. A tree without train_messages (an
invalid or unfinished search) still yields its query with the tools: a missing answer never drops a prompt.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from eagle_assets.formats import messages as messages_layout
from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    INVALID_TOOLS,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    Conversation,
    RecordError,
    finalize,
    normalize_tools,
)

NAME = "toolbench"
SIGNATURE_KEYS = ("api_list", "answer_generation")
_TYPES = {"NUMBER": "integer", "STRING": "string", "BOOLEAN": "boolean"}  # ToolBench's map_type
_DESCRIPTION_MAX = 256
FINISH_FUNCTION = {
    "name": "Finish",
    "description": (
        "If you believe that you have obtained a result that can answer the task, please call this function to "
        "provide the final answer. Alternatively, if you recognize that you are unable to proceed with the task in "
        "the current state, call this function to restart. Remember: you must ALWAYS call this function at the "
        "end of your attempt, and the only part that will be shown to the user is the final answer, so it should "
        "contain sufficient information."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "return_type": {"type": "string", "enum": ["give_answer", "give_up_and_restart"]},
            "final_answer": {"type": "string",
                             "description": ("The final answer you want to give the user. You should have this field "
                                             "if \"return_type\"==\"give_answer\"")},
        },
        "required": ["return_type"],
    },
}


def standardize(name: str) -> str:
    """ToolBench's ``toolbench.utils.standardize``: characters other than CJK, ASCII letters, digits, ``_`` and
    ``^`` (its character class lists ``^`` literally) become ``_``, runs of ``_`` collapse, lower case, no
    leading/trailing ``_``, ``get_`` before a leading digit."""
    out = re.sub(r"(_)\1+", "_", re.sub(r"[^\u4e00-\u9fa5a-zA-Z0-9_^]", "_", name)).lower().strip("_")
    return "get_" + out if out[:1].isdigit() else out


def change_name(name: str) -> str:
    """ToolBench's ``change_name``: Python keywords and ``id`` get an ``is_`` prefix."""
    return "is_" + name.lower() if name in ("from", "class", "return", "false", "true", "id", "and", "", "ID") else name


def matches(record: Any) -> bool:
    """True for a ToolBench query (``api_list`` + ``query``) or an answer tree (``answer_generation``)."""
    if not isinstance(record, dict):
        return False
    return (isinstance(record.get("api_list"), list) and isinstance(record.get("query"), str)) or isinstance(
        record.get("answer_generation"), dict)


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError(INVALID_TOOLS, f"{where} is a {type(value).__name__}, expected text")
    return value


def _function(api: Any, i: int) -> dict[str, Any]:
    where = f"api_list[{i}]"
    if not isinstance(api, dict):
        raise RecordError(INVALID_TOOLS, f"{where} is a {type(api).__name__}, expected an API object")
    tool, api_name = _text(api.get("tool_name"), f"{where}.tool_name"), _text(api.get("api_name"), f"{where}.api_name")
    if not tool.strip() or not api_name.strip():
        raise RecordError(INVALID_TOOLS, f"{where} has no tool_name/api_name")
    tool_std = standardize(tool)
    name = f"{change_name(standardize(api_name))}_for_{tool_std}"[-64:]
    description = f"This is the subfunction for tool \"{tool_std}\", you can use this tool."
    api_description = _text(api.get("api_description"), f"{where}.api_description").strip()
    if api_description:
        description += ("The description of this function is: "
                        f"\"{api_description.replace(api_name, name)[:_DESCRIPTION_MAX]}\"")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for key in ("required_parameters", "optional_parameters"):
        params = api.get(key) or []
        if not isinstance(params, list):
            raise RecordError(INVALID_TOOLS, f"{where}.{key} is a {type(params).__name__}, expected a list")
        for j, p in enumerate(params):
            if not isinstance(p, dict) or not isinstance(p.get("name"), str):
                raise RecordError(INVALID_TOOLS, f"{where}.{key}[{j}] is not a named parameter object")
            pname = change_name(standardize(p["name"]))
            ptype = p.get("type")
            prop: dict[str, Any] = {"type": _TYPES.get(ptype, "string") if isinstance(ptype, str) else "string",
                                    "description": _text(p.get("description"),
                                                         f"{where}.{key}[{j}].description")[:_DESCRIPTION_MAX]}
            default = p.get("default")
            if default is not None and str(default) != "":
                prop["example_value"] = default
            properties[pname] = prop
            if key == "required_parameters":
                required.append(pname)
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required}}


def _parse_query(record: dict, row: int) -> Conversation:
    apis = record["api_list"]
    functions = [_function(api, i) for i, api in enumerate(apis)] + [FINISH_FUNCTION]
    return finalize([{"role": "user", "content": record["query"]}], normalize_tools(functions, "api_list"), row, record)


def _parse_answer(record: dict, row: int) -> Conversation:
    gen = record["answer_generation"]
    functions = gen.get("function")
    chains = gen.get("train_messages") or []
    if not isinstance(chains, list) or not all(isinstance(c, list) for c in chains):
        raise RecordError(BAD_FIELD_TYPE, "answer_generation.train_messages is not a list of message lists")
    if chains:
        longest = max(chains, key=len)
        conv = messages_layout.parse({"messages": longest, "tools": functions}, row)
        return dataclasses.replace(conv, source_record=record)
    query = gen.get("query")
    if not isinstance(query, str):
        raise RecordError(MISSING_FIELD, "answer tree has neither train_messages nor a text answer_generation.query")
    return finalize([{"role": "user", "content": query}], normalize_tools(functions, "answer_generation.function"),
                    row, record)


def parse(record: Any, row: int) -> Conversation:
    """One ToolBench query or answer tree -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    if not isinstance(record, dict):
        raise RecordError(NOT_AN_OBJECT, f"toolbench record is a {type(record).__name__}, expected a JSON object")
    if isinstance(record.get("answer_generation"), dict):
        return _parse_answer(record, row)
    if "api_list" not in record or "query" not in record:
        raise RecordError(MISSING_FIELD, "toolbench record has neither api_list + query nor answer_generation "
                          f"(keys: {sorted(record)[:12]})")
    if not isinstance(record["api_list"], list):
        raise RecordError(BAD_FIELD_TYPE,
                          f"toolbench field 'api_list' is a {type(record['api_list']).__name__}, expected a list")
    if not isinstance(record["query"], str):
        raise RecordError(BAD_FIELD_TYPE,
                          f"toolbench field 'query' is a {type(record['query']).__name__}, expected text")
    return _parse_query(record, row)
