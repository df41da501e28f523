"""Layouts users bring (issue 11, item 8) and per-record faults (items 6, 7), loader level.

The samples under ``data/`` are written by us in each dataset's native layout, following its public loader or
dataset card (``data/README.md`` says which): BFCL multi-turn with ``multi_turn_func_doc/``, ToolBench queries and
answer trees, UltraChat (``data`` lists and the HF ``messages`` variant), MATH / AIME / AMC.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from eagle_assets.formats import Conversation, FormatError, Rejected, build_prompt, detect_format, load_records
from eagle_assets.formats.toolbench import change_name, standardize

DATA = Path(__file__).resolve().parent / "data"


def _load(path: Path, fmt: str = "auto") -> list:
    return list(load_records(path, fmt))


def _names(conv: Conversation) -> list[str]:
    return [t["function"]["name"] for t in conv.tools or []]


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


# -- BFCL multi-turn ------------------------------------------------------------------------------------------------
def test_bfcl_multi_turn_loads_the_function_docs_of_the_involved_classes():
    path = DATA / "bfcl_multi_turn" / "BFCL_v4_multi_turn_base.json"
    assert detect_format(path) == "bfcl"
    recs = _load(path)
    assert all(isinstance(r, Conversation) for r in recs)
    assert all(r.tools for r in recs), "a multi-turn prompt is never kept without its tools"
    # BFCL's own order: every involved class's docs, in involved_classes order (TwitterAPI first for record 1)
    assert _names(recs[0]) == ["cd", "find", "ls", "mkdir", "mv", "sort"]
    assert _names(recs[1]) == ["authenticate_twitter", "comment", "post_tweet", "cd", "find", "ls", "mkdir", "mv",
                               "sort"]
    assert _names(recs[2]) == ["add", "mean"]
    # the docs' Python type names are JSON schema now, the BFCL "response" key is not part of the tool
    mean = recs[2].tools[1]["function"]
    assert mean["parameters"] == {"type": "object", "properties": {"numbers": {
        "type": "array", "items": {"type": "number"}, "description": "List of numbers to calculate the mean of. "}},
        "required": ["numbers"]}
    assert set(mean) == {"name", "description", "parameters"}
    # only the first turn is a prompt: later turns follow the model's own replies
    assert [m["content"] for m in recs[1].messages] == [
        "List everything in my current directory, hidden files included."]


def test_bfcl_miss_func_holds_out_functions_and_unknown_classes_are_rejected():
    recs = _load(DATA / "bfcl_multi_turn" / "BFCL_v4_multi_turn_miss_func.json")
    assert _names(recs[0]) == ["cd", "ls", "mkdir", "mv"]  # sort and find come only at turn 1
    assert isinstance(recs[1], Rejected) and recs[1].reason == "missing_tool_docs"
    assert "VehicleControlAPI" in recs[1].detail and "vehicle_control.json" in recs[1].detail


def test_bfcl_multi_turn_without_its_func_doc_directory_is_rejected_per_record(tmp_path):
    src = tmp_path / "BFCL_v4_multi_turn_base.json"
    shutil.copy(DATA / "bfcl_multi_turn" / "BFCL_v4_multi_turn_base.json", src)
    recs = _load(src)
    assert [r.reason for r in recs] == ["missing_tool_docs"] * 3
    assert "multi_turn_func_doc" in recs[0].detail
    # a doc file that is broken rejects the records that need it, not the file
    (tmp_path / "multi_turn_func_doc").mkdir()
    (tmp_path / "multi_turn_func_doc" / "math_api.json").write_text("{broken\n")
    assert [r.reason for r in _load(src)] == ["missing_tool_docs"] * 3
    # an export that already carries "function" (BFCL's loader output) is used as it is
    rec = json.loads(src.read_text().splitlines()[2])
    rec["function"] = [{"name": "calc", "description": "d", "parameters": {"type": "dict", "properties": {}}}]
    (conv,) = _load(_jsonl(tmp_path / "exported.json", [rec]), "bfcl")
    assert _names(conv) == ["calc"]


# -- reference answers are never a reason to drop a prompt -----------------------------------------------------------
def test_numeric_and_malformed_reference_answers_keep_the_prompt(tmp_path):
    amc = _load(DATA / "math" / "amc.jsonl")
    assert detect_format(DATA / "math" / "amc.jsonl") == "problem"
    assert [type(r).__name__ for r in amc] == ["Conversation"] * 3 + ["Rejected"]
    assert build_prompt(amc[1])[1]["content"] == "27.0"
    assert build_prompt(amc[2])[1] is None  # answer [5]: no usable reference, prompt kept
    assert amc[3].reason == "bad_field_type"  # the problem itself is not text: that is a reason
    odd = _jsonl(tmp_path / "odd.jsonl", [
        {"question": "AIME25 style?", "answer": 27},
        {"question": "a float", "answer": 27.0},
        {"question": "an object", "answer": {"value": 3}},
        {"question": "NaN", "answer": float("nan")},
        {"question": "bad text", "answer": "x\ud800"},
    ])
    recs = _load(odd, "gsm8k")
    assert all(isinstance(r, Conversation) for r in recs)
    assert [build_prompt(r)[1] and build_prompt(r)[1]["content"] for r in recs] == ["27", "27.0", None, None, None]
    alpaca = _jsonl(tmp_path / "a.jsonl", [{"instruction": "Count to 3.", "input": "", "output": 123},
                                            {"instruction": "Say hi.", "output": ["hi"]}])
    assert [build_prompt(r)[1] for r in _load(alpaca, "alpaca")] == [
        {"reasoning_content": None, "content": "123", "tool_calls": None}, None]
    pr = _jsonl(tmp_path / "p.jsonl", [{"prompt": "def f():", "response": {"code": 1}, "completion": "  return 1"}])
    assert build_prompt(_load(pr, "prompt_response")[0])[1]["content"] == "  return 1"
    oci = _jsonl(tmp_path / "o.jsonl", [{"id": "x", "input": "Write add().", "output": 7.5}])
    assert build_prompt(_load(oci, "opencodeinstruct")[0])[1]["content"] == "7.5"
    mt = _jsonl(tmp_path / "m.jsonl", [{"question_id": 1, "turns": ["1+1?", "Times 3?"], "reference": [2, "6"]}])
    assert [m["content"] for m in _load(mt, "mtbench")[0].messages] == ["1+1?", "2", "Times 3?"]


def test_math_and_aime_layouts():
    (p1, p2) = _load(DATA / "math" / "math.jsonl")
    assert detect_format(DATA / "math" / "math.jsonl") == "problem"
    assert (p1.messages[0]["content"].startswith("What is the value of")
            and p1.messages[1]["content"].endswith("\\boxed{12}$."))
    aime = _load(DATA / "math" / "aime_2024.jsonl")  # Maxwell-Jia/AIME_2024 capitalises ID/Problem/Solution/Answer
    assert detect_format(DATA / "math" / "aime_2024.jsonl") == "problem"
    assert aime[1].messages == [{"role": "user", "content": "Compute $2^{10} \\bmod 1000$."},
                                {"role": "assistant", "content": "$2^{10} = 1024$, so the answer is $\\boxed{24}$."}]


# -- ToolBench ------------------------------------------------------------------------------------------------------
def test_toolbench_queries_become_toolbench_function_schemas():
    path = DATA / "toolbench" / "G1_query.json"
    assert detect_format(path) == "toolbench"
    weather, squake, bad = _load(path)
    assert _names(weather) == ["current_city_for_open_weather_lite", "forecast_days_for_open_weather_lite", "Finish"]
    assert weather.messages == [{"role": "user", "content": "I'm flying to Lisbon tomorrow. What's the weather there "
                                                            "right now, and what does the next three days look like?"}]
    current = weather.tools[0]["function"]
    assert current["description"] == ('This is the subfunction for tool "open_weather_lite", you can use this tool.'
                                      'The description of this function is: "Current conditions for a city: '
                                      'temperature, wind and sky."')
    assert current["parameters"] == {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name", "example_value": "Lisbon"},
        "units": {"type": "string", "description": "metric or imperial"}}}
    forecast = weather.tools[1]["function"]["parameters"]["properties"]
    assert forecast["days"] == {"type": "integer", "description": "How many days (1-7)", "example_value": "3"}
    assert "is_id" in forecast and forecast["is_id"]["type"] == "boolean"  # ToolBench's change_name("id")
    assert weather.tools[2]["function"]["parameters"]["required"] == ["return_type"]
    assert _names(squake) == ["checkhealth_for_squake", "Finish"]
    assert "The description of this function" not in squake.tools[0]["function"]["description"]  # blank description
    assert isinstance(bad, Rejected) and bad.reason == "bad_field_type" and "api_list" in bad.detail
    assert standardize("Transportistas de Argentina") == "transportistas_de_argentina"
    assert standardize("3d-printer API!") == "get_3d_printer_api" and change_name("from") == "is_from"


def test_toolbench_answer_trees_use_the_longest_train_messages_chain():
    tree = DATA / "toolbench" / "answer" / "10_ChatGPT_DFS_woFilter_w2.json"
    assert detect_format(tree) == "toolbench"
    (conv,) = _load(tree)
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.messages[2]["tool_calls"] == [{"type": "function", "function": {
        "name": "current_city_for_open_weather_lite", "arguments": {"city": "Lisbon"}}}]
    assert conv.messages[3]["name"] == "current_city_for_open_weather_lite"
    assert _names(conv) == ["current_city_for_open_weather_lite", "Finish"]
    prompt, ref = build_prompt(conv, "last_user")
    assert ([m["role"] for m in prompt] == ["system", "user"]
            and ref["tool_calls"][0]["function"]["name"] == "current_city_for_open_weather_lite")
    # an unfinished search has no chain: its query is still a prompt, with the tools
    (query_only,) = _load(DATA / "toolbench" / "answer" / "11_ChatGPT_DFS_woFilter_w2.json")
    assert (query_only.messages == [{"role": "user", "content": "Weather in Porto, please."}]
            and _names(query_only)[-1] == "Finish")


# -- UltraChat ------------------------------------------------------------------------------------------------------
def test_ultrachat_data_lists_and_the_hf_messages_variant():
    path = DATA / "ultrachat" / "train_0.jsonl"
    assert detect_format(path) == "ultrachat"
    recs = _load(path)
    assert [m["role"] for m in recs[0].messages] == ["user", "assistant", "user", "assistant"]
    prompt, ref = build_prompt(recs[0], "last_user")
    assert (prompt[-1]["content"] == "Which cross training is best for knees?"
            and ref["content"].startswith("Low-impact"))
    assert recs[1].messages == [{"role": "user", "content": "Write a haiku about autumn rain."}]
    assert [(r.reason, r.source_row) for r in recs[2:]] == [("empty_prompt", 2), ("bad_field_type", 3)]
    hf = DATA / "ultrachat" / "ultrachat_200k.jsonl"
    assert detect_format(hf) == "messages"  # prompt + messages: the messages layout, not prompt_response
    assert [len(r.messages) for r in _load(hf, "ultrachat_200k")] == [4, 2]


# -- per-record faults (item 6) and files of them (item 7) -----------------------------------------------------------
def test_one_bad_character_costs_only_its_record(tmp_path):
    good = {"question": "What is 2+2?", "answer": "4"}
    path = tmp_path / "mixed.jsonl"
    with open(path, "wb") as fh:
        fh.write(json.dumps(good).encode() + b"\n")
        fh.write(b'{"question": "lone \\ud800 surrogate", "answer": "x"}\n')  # JSON escape of a lone surrogate
        fh.write(b'{"question": "caf\xe9", "answer": "Latin-1 byte, not UTF-8"}\n')
        fh.write(b'{"question": "' + b"9" * 10 + b'", "answer": ' + b"9" * 5000 + b"}\n")  # past the int digit limit
        fh.write(b"[" * 5000 + b"]" * 5000 + b"\n")  # nested deeper than the parser recurses
        fh.write(json.dumps({"question": "Still read?", "answer": "yes"}).encode() + b"\n")
    recs = _load(path)
    assert [type(r).__name__ for r in recs] == ["Conversation", "Rejected", "Rejected", "Rejected", "Rejected",
                                                "Conversation"]
    assert [r.reason for r in recs[1:5]] == ["invalid_unicode", "invalid_unicode", "bad_json", "bad_json"]
    assert recs[1].detail.startswith("messages[0]['content'] holds the lone UTF-16 surrogate \\ud800")
    assert "the byte 0xe9, which is not UTF-8" in recs[2].detail
    assert "4300 digits" in recs[3].detail and "RecursionError" in recs[4].detail
    for r in recs[1:5]:
        r.detail.encode("utf-8")  # a reject is always storable
    nan_tools = _jsonl(tmp_path / "nan.jsonl", [
        '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "parameters": {"type": "object", '
        '"properties": {"x": {"type": "number", "default": NaN}}}}]}',
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": '
        '[{"function": {"name": "f", "arguments": {"x": Infinity}}}]}, {"role": "user", "content": "again"}]}'])
    assert [r.reason for r in _load(nan_tools)] == ["non_finite_number", "non_finite_number"]


def test_auto_format_on_empty_and_all_malformed_files(tmp_path):
    for empty in ("", "\n\n  \n", "[]"):
        path = tmp_path / "empty.json"
        path.write_text(empty)
        assert _load(path) == []  # zero rows, not an error
        with pytest.raises(FormatError, match="holds no records"):
            detect_format(path)
    gz = tmp_path / "empty.jsonl.gz"
    with gzip.open(gz, "wb"):
        pass
    assert _load(gz) == []
    # records meant for a layout but all malformed: that layout's own reasons, one per record
    malformed = _jsonl(tmp_path / "m.jsonl", [{"conversations": 7},  # (a string would be one prompt)
                                              {"conversations": [{"from": "narrator", "value": "x"}]}, "{broken"])
    assert [r.reason for r in _load(malformed)] == ["bad_field_type", "unknown_role", "bad_json"]
    only_bad_json = _jsonl(tmp_path / "b.jsonl", ["{broken", "also broken"])
    assert [r.reason for r in _load(only_bad_json)] == ["bad_json", "bad_json"]
    # a JSON Lines file whose first record is an array is read line by line, not refused as a broken document
    first_array = _jsonl(tmp_path / "f.jsonl", ["[1, 2]", {"question": "q", "answer": "a"}])
    assert [type(r).__name__ for r in _load(first_array)] == ["Rejected", "Conversation"]


def test_truncated_gzip_keeps_the_rows_before_the_cut(tmp_path):
    full = "".join(json.dumps({"question": f"q{i} " + "x" * 200, "answer": "a"}) + "\n" for i in range(200)).encode()
    blob = gzip.compress(full)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(blob[: len(blob) // 2])
    recs = _load(path)
    assert isinstance(recs[-1], Rejected) and recs[-1].reason == "truncated_file" and "re-download" in recs[-1].detail
    kept = [r for r in recs if isinstance(r, Conversation)]
    assert 0 < len(kept) < 200 and [r.source_row for r in kept] == list(range(len(kept)))


def test_utf16_file_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "u16.jsonl"
    path.write_bytes('{"question": "q", "answer": "a"}\n'.encode("utf-16"))
    with pytest.raises(FormatError, match="UTF-16-LE.*convert it to UTF-8"):
        _load(path)


def test_parquet_sources_read_row_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (DATA / "ultrachat" / "ultrachat_200k.jsonl").read_text().splitlines()]
    path = tmp_path / "train-00000-of-00001.parquet"  # the Hugging Face Hub's native file layout
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert detect_format(path) == "messages"
    recs = _load(path)
    assert [r.messages for r in recs] == [r.messages for r in _load(DATA / "ultrachat" / "ultrachat_200k.jsonl")]
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(FormatError, match="not a readable Parquet file"):
        _load(broken)


@pytest.mark.parametrize(("messages", "tools", "reason"), [
    ([{"role": "narrator", "content": "x"}], None, "unknown_role"),
    ([{"role": "user", "content": None}], None, "bad_field_type"),
    ([{"role": "user", "content": "x", "reasoning_content": 3}], None, "bad_field_type"),
    ([{"role": "user", "content": "x", "tool_calls": []}], None, "invalid_tool_call"),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "content": "",
       "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     None, "invalid_tool_arguments"),
    ([{"role": "assistant", "content": "only me"}], None, "no_user_turn"),
    ([{"role": "user", "content": "x"}], [], "invalid_tools"),
    ([{"role": "user", "content": "x"}],
     [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "invalid_tools"),
    ([{"role": "user", "content": "x"}],
     [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 1}}}}],
     "invalid_tools"),
    ([{"role": "user", "content": "x"}],
     [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}],
     "invalid_tools"),
    ([{"role": "user", "content": "x"}],
     [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                    "properties": {"a": {"default": float("inf")}}}}}],
     "non_finite_number"),
    ([{"role": "user", "content": "x\udfff"}], None, "invalid_unicode"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y", "name": "f\ud800"}], None, "invalid_unicode"),
])
def test_every_kept_conversation_is_checked_whatever_the_loader_built(messages, tools, reason):
    from eagle_assets.formats.conversation import RecordError, check_conversation

    with pytest.raises(RecordError) as err:
        check_conversation(Conversation(messages=messages, tools=tools, source_row=0, source_record={}))
    assert err.value.reason == reason
    ok = Conversation(messages=[{"role": "user", "content": "x"}], tools=None, source_row=0, source_record={})
    assert check_conversation(ok) is ok
