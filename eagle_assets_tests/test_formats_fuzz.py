"""Fuzzing raw_prompts' loading path: whatever a source file holds, no record crashes it and no kept row is malformed.

Records are drawn per layout: a well-formed record of that layout with faults planted at random places (lone
surrogates, NaN and Infinity, huge integers, control-token strings, wrong types, deleted keys), random JSON values,
and raw lines that are not JSON at all (bytes that are not UTF-8, truncated JSON, integers past Python's digit
limit, nesting deeper than the parser recurses); a second test plants exactly one surrogate or NaN in every
record, so those faults are met in every example, not by chance. Each file goes through
``collect_prompt_rows`` -- the whole per-record path of the ``raw_prompts`` asset -- with ``auto`` and with the
layout named, and both tables are written with the asset's Parquet schemas. Kept rows are checked here by rules
written independently of the loaders' own checks. Seeded (``derandomize``), so a failure reproduces.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_assets.formats import FORMATS, REJECT_REASONS, FormatError
from eagle_assets.raw_prompts.rows import RAW_SCHEMA, REJECT_SCHEMA, collect_prompt_rows

DATA = Path(__file__).resolve().parent / "data"
ROLES = ("system", "user", "assistant", "tool")

# -- values ------------------------------------------------------------------------------------------------------
surrogate = st.sampled_from(["\ud800", "\udfff", "\udc80", "a\udbffb"])
special = st.sampled_from(["<think>", "</think>", "<|im_start|>", "<|endoftext|>", "USER: hi", "ASSISTANT: ok",
                           "<functioncall> {\"name\": \"f\", \"arguments\": '{}'}", "\x00", "\u2028", "{", "[",
                           "#### 5", "NaN", "   ", ""])
plain = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
number = st.one_of(st.integers(-(10**20), 10**20), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([27.0, float("nan"), float("inf"), -0.0, 2**63]))
scalar = st.one_of(st.none(), st.booleans(), number, plain, special, surrogate)
anything = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(plain, inner, max_size=3)), max_leaves=8)
# What a mutation writes into a well-formed record: bad text, non-finite and huge numbers, wrong types.
non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
hostile = st.one_of(surrogate, st.builds(lambda a, b: a + b, plain, surrogate), non_finite, non_finite, special,
                    number, st.none(), st.booleans(), st.lists(scalar, max_size=2),
                    st.dictionaries(plain, st.one_of(scalar, non_finite), max_size=2))

# -- well-formed records of each layout (then mutated) ---------------------------------------------------------------
finite = st.one_of(plain, st.integers(-1000, 1000), st.floats(allow_nan=False, allow_infinity=False), st.booleans())
arguments = st.dictionaries(word, finite, max_size=3)
schema = st.builds(
    lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]},
    st.dictionaries(word, st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "array", "dict", "float", "str, optional"]),
         "description": plain}, optional={"default": finite}), max_size=3))
bare_tool = st.fixed_dictionaries({"name": word, "description": plain, "parameters": schema})
openai_tool = bare_tool.map(lambda f: {"type": "function", "function": f})
openai_call = st.builds(
    lambda n, a, as_text: {"type": "function", "function": {"name": n, "arguments": json.dumps(a) if as_text else a}},
    word, arguments, st.booleans())
user = plain.map(lambda t: {"role": "user", "content": t})
assistant = st.one_of(plain.map(lambda t: {"role": "assistant", "content": t}),
                      st.builds(lambda t, c: {"role": "assistant", "content": t, "tool_calls": c},
                                plain, st.lists(openai_call, min_size=1, max_size=2)),
                      st.builds(lambda r, t: {"role": "assistant", "content": f"<think>{r}</think>{t}"}, plain, plain))
history = st.lists(st.tuples(user, assistant,
                             st.lists(plain.map(lambda t: {"role": "tool", "content": t}), max_size=1)),
                   max_size=2).map(
    lambda turns: [m for u, a, tools in turns for m in (u, a, *tools)])
conversation = st.builds(lambda h, last, ref: h + [last] + ref, history, user, st.lists(assistant, max_size=1))
glaive_call = st.builds(
    lambda n, a: "<functioncall> " + json.dumps({"name": n, "arguments": "ARGS"}).replace(
        '"ARGS"', "'" + json.dumps(a) + "'"),
    word, arguments)
GOOD = {
    "messages": st.fixed_dictionaries({"messages": conversation},
                                      optional={"tools": st.lists(openai_tool, max_size=2)}),
    "sharegpt": st.builds(  # tools and calls as JSON strings (LLaMA-Factory) or as JSON values
        lambda q, n, a, obs, ans, tools, last, as_text: {"conversations": [
            {"from": "human", "value": q},
            {"from": "function_call", "value": (json.dumps if as_text else dict)({"name": n, "arguments": a})},
            {"from": "observation", "value": obs}, {"from": "gpt", "value": ans}, {"from": "human", "value": last}],
            "tools": json.dumps(tools) if as_text else tools},
        plain, word, arguments, plain, plain, st.lists(bare_tool, min_size=1, max_size=2), plain, st.booleans()),
    "glaive": st.builds(
        lambda tools, q, call, obs, ans: {
            "system": "SYSTEM: You are a helpful assistant with access to the following functions. "
                      "Use them if required -\n"
                      + "\n\n".join(json.dumps(t, indent=4) for t in tools),
            "chat": f"USER: {q}\n\n\nASSISTANT: {call} <|endoftext|>\n\n\nFUNCTION RESPONSE: {obs}\n\n\n"
                    f"ASSISTANT: {ans} <|endoftext|>\n"},
        st.lists(bare_tool, max_size=2), plain, glaive_call, plain, plain),
    "alpaca": st.fixed_dictionaries({"instruction": plain, "input": plain | st.just(""), "output": plain}),
    "opencodeinstruct": st.fixed_dictionaries({"id": word, "input": plain, "output": plain}),
    "mtbench": st.fixed_dictionaries({"question_id": st.integers(0, 200),
                                      "turns": st.lists(plain, min_size=1, max_size=2)},
                                     optional={"reference": st.lists(plain, min_size=2, max_size=2)}),
    "gsm8k": st.fixed_dictionaries({"question": plain, "answer": plain | number}),
    "problem": st.one_of(st.fixed_dictionaries({"problem": plain},
                                               optional={"solution": plain, "answer": plain | number}),
                         st.fixed_dictionaries({"Problem": plain, "Solution": plain, "Answer": number})),
    "bfcl": st.one_of(
        st.fixed_dictionaries({"id": word, "question": st.lists(user, min_size=1, max_size=2).map(lambda m: [m]),
                               "function": st.lists(bare_tool, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"id": word,
                               "question": st.lists(st.lists(user, min_size=1, max_size=1), min_size=1, max_size=3),
                               "involved_classes": st.lists(st.sampled_from(["GorillaFileSystem", "MathAPI",
                                                                             "TwitterAPI"]),
                                                            min_size=1, max_size=2, unique=True)},
                              optional={"missed_function": st.dictionaries(
                                  st.sampled_from(["1", "2"]),
                                  st.lists(st.sampled_from(["ls", "cd", "add", "post_tweet"]), max_size=2),
                                  max_size=1)})),
    "toolbench": st.one_of(
        st.fixed_dictionaries({"query": plain, "query_id": st.integers(0, 10**6), "api_list": st.lists(
            st.fixed_dictionaries({
                "category_name": word, "tool_name": plain, "api_name": plain, "api_description": plain,
                "method": st.just("GET"),
                "required_parameters": st.lists(st.fixed_dictionaries({
                    "name": word, "type": st.sampled_from(["STRING", "NUMBER", "BOOLEAN", "ARRAY"]),
                    "description": plain, "default": finite}), max_size=2),
                "optional_parameters": st.lists(st.fixed_dictionaries({
                    "name": word, "type": st.sampled_from(["STRING", "NUMBER"]), "description": plain,
                    "default": finite}), max_size=1)}),
            min_size=1, max_size=2)}),
        st.builds(lambda sys_, q, n, a, fns: {"answer_generation": {
            "valid_data": True, "query": q, "function": fns, "train_messages": [[
                {"role": "system", "content": sys_}, {"role": "user", "content": q},
                {"role": "assistant", "content": None, "function_call": {"name": n, "arguments": json.dumps(a)}}]]}},
            plain, plain, word, arguments, st.lists(bare_tool, min_size=1, max_size=2))),
    "ultrachat": st.fixed_dictionaries({"id": word, "data": st.lists(plain, min_size=1, max_size=4)}),
    "prompt_response": st.fixed_dictionaries({"prompt": plain},
                                             optional={"response": plain | number, "completion": plain}),
}


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _get(record, path):
    for step in path:
        record = record[step]
    return record


@st.composite
def mutated(draw, good):
    """A well-formed record with 0-3 faults planted at random places: a lone surrogate appended to a string, a
    number made NaN or Infinity, a value replaced by a hostile one, or a key or list item deleted."""
    record = draw(good)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        action = draw(st.sampled_from(["surrogate", "non_finite", "replace", "delete"]))
        paths = list(_paths(record))
        if action == "surrogate":
            paths = [q for q in paths if isinstance(_get(record, q), str)]
        elif action == "non_finite":
            paths = [q for q in paths if type(_get(record, q)) in (int, float)]
        if not paths:
            continue
        path = draw(st.sampled_from(paths))
        if not path:
            record = draw(hostile)
            continue
        parent, key = _get(record, path[:-1]), path[-1]
        if action == "surrogate":
            parent[key] += "\ud800"
        elif action == "non_finite":
            parent[key] = draw(non_finite)
        elif action == "delete":
            del parent[key]
        else:
            parent[key] = draw(hostile)
    return record


RECORDS = {name: mutated(good) for name, good in GOOD.items()}


@st.composite
def planted(draw, good):
    """A well-formed record with exactly one lone surrogate or non-finite number planted (when it has a string or a
    number to plant it in): the faults a loader must catch wherever they sit, drawn so every example has one."""
    record = draw(good)
    kind = draw(st.sampled_from(["non_finite", "surrogate"]))
    wanted = (lambda v: type(v) in (int, float)) if kind == "non_finite" else (lambda v: isinstance(v, str))
    paths = [q for q in _paths(record) if q and wanted(_get(record, q))]
    if paths:
        path = draw(st.sampled_from(paths))
        parent = _get(record, path[:-1])
        parent[path[-1]] = draw(non_finite) if kind == "non_finite" else parent[path[-1]] + draw(surrogate)
    return record
assert set(RECORDS) == set(FORMATS), "every layout is fuzzed"

_RAW = [
    b"{broken json",
    b'{"question": "caf\xe9 au lait?", "answer": "x"}',  # Latin-1 byte: not UTF-8
    b'{"prompt": "\xff\xfe"}',
    b'{"question": "q", "answer": ' + b"9" * 5000 + b"}",  # past Python's int digit limit
    b"[" * 5000 + b"]" * 5000,  # deeper than the JSON parser recurses
    b'{"question": "truncated',
    b"NaN",
    b"\x1c",  # whitespace to str.strip: a blank line
    b'"just a string"',
    b"[1, 2, 3]",
]
RAW_LINES = st.sampled_from(range(len(_RAW))).map(_RAW.__getitem__)  # by index: keeps the strategy's repr short


def _line(value) -> bytes:
    if isinstance(value, bytes):
        return value
    return json.dumps(value).encode("utf-8")  # ensure_ascii: lone surrogates travel as \\ud800 escapes, NaN as NaN


def lines_for(layout: str):
    return st.lists(st.one_of(RECORDS[layout], RECORDS[layout], RECORDS[layout], anything, RAW_LINES),
                    min_size=1, max_size=6)


# -- independent validity rules for a kept row ----------------------------------------------------------------------
def _strict(text: str):
    def no_constant(name):
        raise AssertionError(f"non-finite number {name} stored")

    text.encode("utf-8")  # a lone surrogate would raise here
    return json.loads(text, parse_constant=no_constant)


def _assert_tool_call(call):
    assert call["type"] == "function" and isinstance(call["function"], dict)
    assert isinstance(call["function"]["name"], str) and call["function"]["name"].strip()
    assert isinstance(call["function"]["arguments"], dict)


def _assert_kept_row(row: dict) -> None:
    msgs = _strict(row["messages"])
    assert isinstance(msgs, list) and msgs
    for m in msgs:
        assert m["role"] in ROLES and isinstance(m["content"], str)
        assert set(m) <= {"role", "content", "reasoning_content", "tool_calls", "name"}, m.keys()
        assert all(isinstance(m[k], str) for k in ("reasoning_content", "name") if k in m)
        for call in m.get("tool_calls", []):
            assert m["role"] == "assistant"
            _assert_tool_call(call)
    assert msgs[-1]["role"] == "user" and msgs[-1]["content"].strip(), "a prompt ends with a user turn with text"
    if row["tools"] is not None:
        tools = _strict(row["tools"])
        assert isinstance(tools, list) and tools
        for t in tools:
            fn = t["function"]
            assert t["type"] == "function" and isinstance(fn["name"], str) and fn["name"].strip()
            assert fn["parameters"]["type"] == "object"
            assert all(isinstance(p, dict) for p in fn["parameters"].get("properties", {}).values())
            assert all(isinstance(r, str) for r in fn["parameters"].get("required", []))
            assert isinstance(fn.get("description", ""), str)
    if row["reference_reply"] is not None:
        ref = _strict(row["reference_reply"])
        assert isinstance(ref["content"], str) and (ref["reasoning_content"] is None
                                                    or isinstance(ref["reasoning_content"], str))
        for call in ref["tool_calls"] or []:
            _assert_tool_call(call)


@pytest.fixture(scope="module")
def workdir():
    """A directory holding BFCL's multi_turn_func_doc/, where each example writes its source file (module-scoped:
    Hypothesis does not reset a function-scoped fixture between the examples of one test)."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(DATA / "bfcl_multi_turn" / "multi_turn_func_doc", Path(tmp) / "multi_turn_func_doc")
        yield Path(tmp)


def _run(workdir: Path, lines: list[bytes], fmt: str, policy: str) -> None:
    path = workdir / "source.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    # lines as the reader splits them (universal newlines; str.splitlines would also split at \x1c)
    decoded = list(io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding="utf-8-sig", errors="surrogateescape"))
    nonblank = [i for i, line in enumerate(decoded) if line.strip()]
    expected = nonblank
    if nonblank and decoded[nonblank[0]].lstrip().startswith("["):
        try:  # the whole file is one JSON array: its rows are the list indices
            expected = list(range(len(json.loads("".join(decoded)))))
        except (ValueError, RecursionError):
            pass
    try:
        kept, rejects = collect_prompt_rows("P", [(path, fmt)], policy)
    except FormatError as e:
        # The only file-level refusal: the file is one JSON array document that does not parse.
        assert len(nonblank) == 1 and decoded[nonblank[0]].lstrip().startswith("["), e
        return
    rows = list(kept.values())
    assert sorted([r["source_row"] for r in rows] + [r["source_row"] for r in rejects]) == expected, \
        "every record (a non-blank line, or an element of a one-array file) is one kept row or one reject"
    for row in rows:
        _assert_kept_row(row)
    for rej in rejects:
        assert rej["reason"] in REJECT_REASONS, rej
        # the catch-all is a safety net, not a reason: every fault a loader can meet has a named reason
        assert "could not be normalized (" not in rej["detail"], rej["detail"]
        assert isinstance(rej["detail"], str) and rej["detail"]
        rej["detail"].encode("utf-8")
    for table, schema in ((rows, RAW_SCHEMA), (rejects, REJECT_SCHEMA)):
        pq.write_table(pa.Table.from_pylist(table, schema=schema), io.BytesIO())  # what the asset stores


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("layout", sorted(RECORDS))
@FUZZ
@given(data=st.data())
def test_no_record_crashes_raw_prompts_or_is_kept_malformed(workdir, layout, data):
    lines = [_line(v) for v in data.draw(lines_for(layout), label="lines")]
    fmt = data.draw(st.sampled_from(["auto", layout]), label="format")
    policy = data.draw(st.sampled_from(["last_user", "first_user"]), label="policy")
    _run(workdir, lines, fmt, policy)


@pytest.mark.parametrize("layout", sorted(GOOD))
@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_a_planted_surrogate_or_nan_never_reaches_a_kept_row(workdir, layout, data):
    lines = [_line(v) for v in data.draw(st.lists(planted(GOOD[layout]), min_size=1, max_size=3), label="lines")]
    _run(workdir, lines, layout, "last_user")


@FUZZ
@given(lines=st.lists(st.one_of(*RECORDS.values(), RAW_LINES), min_size=1, max_size=10))
def test_mixed_layouts_in_one_file_never_crash_auto_detection(workdir, lines):
    _run(workdir, [_line(v) for v in lines], "auto", "last_user")
