"""Raw-layout loaders: small inline records in each dataset's native layout, malformed records, and the real
public samples in ../shared/data."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from eagle_assets.formats import (
    FORMATS,
    REJECT_REASONS,
    Conversation,
    FormatError,
    Rejected,
    detect_format,
    load_records,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _jsonl(tmp_path: Path, name: str, records: list) -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return p


def _json(tmp_path: Path, name: str, records: list) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(records, indent=2), encoding="utf-8")
    return p


def _load(path: Path, fmt: str = "auto") -> list:
    return list(load_records(path, fmt))


GLAIVE_SYSTEM = (
    "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
    '{\n    "name": "get_exchange_rate",\n    "description": "Get the exchange rate between two currencies",\n'
    '    "parameters": {\n        "type": "object",\n        "properties": {\n'
    '            "base_currency": {\n                "type": "string",\n'
    '                "description": "The currency to convert from"\n            },\n'
    '            "target_currency": {\n                "type": "string",\n'
    '                "description": "The currency to convert to"\n            }\n'
    '        },\n        "required": [\n            "base_currency",\n            "target_currency"\n'
    '        ]\n    }\n}\n\n'
    '{\n    "name": "get_time",\n    "description": "Current time in a city",\n'
    '    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}\n}\n'
)
GLAIVE_CHAT = (
    "USER: Hi, can you tell me the exchange rate from USD to EUR?\n\n\n"
    "ASSISTANT: <functioncall> {\"name\": \"get_exchange_rate\", "
    "\"arguments\": '{\"base_currency\": \"USD\", \"target_currency\": \"EUR\"}'} <|endoftext|>\n\n\n"
    "FUNCTION RESPONSE: {\"exchange_rate\": 0.85}\n\n\n"
    "ASSISTANT: The current exchange rate from USD to EUR is 0.85. <|endoftext|>\n\n\n"
    "USER: Thanks! And what time is it in Paris?\n\n\n"
    "ASSISTANT: <functioncall> {\"name\": \"get_time\", \"arguments\": '{\"city\": \"Paris\"}'} <|endoftext|>\n"
)


def test_glaive_raw_text_layout(tmp_path):
    no_tools = {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.\n\n",
                "chat": "USER: What is 2+2?\n\n\nASSISTANT: 2+2 is 4. <|endoftext|>\n\n\n"}
    bad_args = {"system": GLAIVE_SYSTEM,
                "chat": "USER: rate?\n\n\nASSISTANT: <functioncall> {\"name\": \"get_time\", "
                        "\"arguments\": '{\"city\": Paris}'} <|endoftext|>\n"}
    no_markers = {"system": GLAIVE_SYSTEM, "chat": "hello there, no speaker markers"}
    path = _json(tmp_path, "glaive.json",
                 [{"system": GLAIVE_SYSTEM, "chat": GLAIVE_CHAT}, no_tools, bad_args, no_markers, {"system": "x"}])
    assert detect_format(path) == "glaive"
    recs = _load(path)
    conv = recs[0]
    assert isinstance(conv, Conversation)
    assert [t["function"]["name"] for t in conv.tools] == ["get_exchange_rate", "get_time"]
    assert conv.tools[0]["function"]["parameters"]["required"] == ["base_currency", "target_currency"]
    roles = [m["role"] for m in conv.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert conv.messages[0]["content"].startswith("You are a helpful assistant with access to the following functions")
    assert "{" not in conv.messages[0]["content"]  # schemas moved into tools
    assert conv.messages[2]["tool_calls"] == [{"type": "function", "function": {
        "name": "get_exchange_rate", "arguments": {"base_currency": "USD", "target_currency": "EUR"}}}]
    assert conv.messages[3]["content"] == '{"exchange_rate": 0.85}'
    assert conv.messages[4]["content"] == "The current exchange rate from USD to EUR is 0.85."
    assert isinstance(recs[1], Conversation) and recs[1].tools is None
    assert [m["role"] for m in recs[1].messages] == ["system", "user", "assistant"]
    assert (recs[2].reason, recs[3].reason, recs[4].reason) == (
        "invalid_tool_arguments", "unparseable_text", "missing_field")
    assert "get_time" in recs[2].detail


def test_sharegpt_llamafactory_tools_and_openthoughts(tmp_path):
    tool_record = {
        "conversations": [
            {"from": "human", "value": "Convert 100 USD to EUR"},
            {"from": "function_call", "value": "{\"name\": \"convert\", \"arguments\": {\"amount\": 100}}"},
            {"from": "observation", "value": "{\"result\": 85}"},
            {"from": "gpt", "value": "100 USD is 85 EUR."},
            {"from": "human", "value": "And 200?"},
            {"from": "human", "value": "Please be brief."},
        ],
        "tools": "[{\"name\": \"convert\", \"description\": \"convert money\", "
                 "\"parameters\": {\"type\": \"object\", \"properties\": {\"amount\": {\"type\": \"number\"}}}}]",
    }
    openthoughts = {
        "system": "Your role as an assistant involves thoroughly exploring questions.",
        "conversations": [
            {"from": "user", "value": "What is 3*7?"},
            {"from": "assistant", "value": "<|begin_of_thought|>\n\n3 times 7 is 21.\n\n<|end_of_thought|>\n\n"
                                           "<|begin_of_solution|>\n\n21\n\n<|end_of_solution|>"},
        ],
    }
    malformed = [
        {"conversations": {"from": "human", "value": "not a list"}},  # (a string is one prompt: string_turns tests)
        {"conversations": [{"from": "narrator", "value": "Once upon a time"}]},
        {"conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "ok"}]},
        {"conversations": [{"from": "gpt", "value": "only an answer"}]},
        {"conversations": [{"from": "human", "value": "x"}], "tools": "[{not json"},
        {"conversations": [{"from": "human", "value": "x"},
                           {"from": "function_call", "value": "{\"name\": \"f\", \"arguments\": \"{oops\"}"}]},
        [1, 2, 3],
    ]
    path = _jsonl(tmp_path, "sg.jsonl", [tool_record, openthoughts, *malformed, "{broken json"])
    recs = _load(path, "sharegpt")
    conv = recs[0]
    assert conv.tools[0]["type"] == "function" and conv.tools[0]["function"]["name"] == "convert"
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert conv.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "convert", "arguments": {"amount": 100}}}]}
    assert conv.messages[-1]["content"] == "And 200?\n\nPlease be brief."  # consecutive user turns merged
    ot = recs[1]
    assert ot.messages[0] == {"role": "system", "content": openthoughts["system"]}
    assert ot.messages[2]["reasoning_content"] == "3 times 7 is 21."
    assert ot.messages[2]["content"] == "21"
    reasons = [r.reason for r in recs[2:]]
    assert reasons == ["bad_field_type", "unknown_role", "empty_prompt", "no_user_turn", "invalid_tools",
                       "invalid_tool_arguments", "not_an_object", "bad_json"]
    assert recs[-1].source_row == 9 and "line 10" in recs[-1].detail
    assert all(r.reason in REJECT_REASONS for r in recs[2:])


def test_messages_layouts(tmp_path):
    mot = {"messages": [{"role": "user", "content": "Integrate x^2."},
                        {"role": "assistant", "content": "<think>\nPower rule.\n</think>\n\nx^3/3 + C"}],
           "num_tokens": 42, "source": "math"}
    openai = {"messages": [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "name": "weather", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ], "tools": [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "dict", "properties": {"city": {"type": "str"}}}}}]}
    parts = {"messages": [
        {"role": "user", "content": [{"type": "text", "value": "area of r=2?"}]},
        {"role": "assistant", "content": [
            {"type": "reasoning", "value": "pi r^2"},
            {"type": "tool_call", "value": "{\"name\": \"circle_area\", \"arguments\": {\"radius\": 2}}"}]},
    ]}
    xlam = {"messages": [{"role": "user", "content": "products?"}],
            "tools": json.dumps([{"type": "function", "function": {"name": "get_products", "parameters": {
                "limit": {"description": "max items", "type": "int", "default": ""},
                "category": {"description": "which", "type": "str, optional", "default": "all"}}}}])}
    bad = [
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"num_tokens": 3},
    ]
    path = _jsonl(tmp_path, "m.jsonl", [mot, openai, parts, xlam, *bad])
    assert detect_format(path) == "messages"
    recs = _load(path)
    assert recs[0].messages[1] == {"role": "assistant", "content": "x^3/3 + C", "reasoning_content": "Power rule."}
    conv = recs[1]
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "user"]
    assert conv.messages[2]["reasoning_content"] == "Need the tool."
    assert conv.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert conv.messages[3]["name"] == "weather"
    assert conv.tools[0]["function"]["parameters"] == {"type": "object", "properties": {"city": {"type": "string"}}}
    assert recs[2].messages[1]["reasoning_content"] == "pi r^2"
    assert recs[2].messages[1]["tool_calls"][0]["function"] == {"name": "circle_area", "arguments": {"radius": 2}}
    # xLAM/ToolBench bare parameter maps get the JSON-schema object wrapper; "str, optional" -> "string"
    params = recs[3].tools[0]["function"]["parameters"]
    assert params["type"] == "object" and params["properties"]["limit"]["type"] == "integer"
    assert params["properties"]["category"] == {"description": "which", "type": "string", "default": "all"}
    assert [r.reason for r in recs[4:]] == ["bad_field_type", "invalid_tool_call", "bad_field_type", "missing_field"]


def test_single_turn_layouts(tmp_path):
    alpaca = _json(tmp_path, "a.json", [
        {"instruction": "Reverse a list in Python.", "input": "[1, 2, 3]", "output": "lst[::-1]"},
        {"instruction": "Say hi.", "input": "", "output": "hi", "system": "Be nice.", "history": [["q0", "a0"]]},
        {"instruction": "", "input": "", "output": "x"},
        {"input": "no instruction", "output": "x"},
    ])
    recs = _load(alpaca, "alpaca")
    assert recs[0].messages == [{"role": "user", "content": "Reverse a list in Python.\n\n[1, 2, 3]"},
                                {"role": "assistant", "content": "lst[::-1]"}]
    assert [m["role"] for m in recs[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [r.reason for r in recs[2:]] == ["empty_prompt", "missing_field"]

    oci = _jsonl(tmp_path, "oci.jsonl", [
        {"id": "abc", "input": "Write a function add(a, b).", "output": "def add(a, b):\n    return a + b",
         "domain": "generic", "generation_algorithm": "self-instruct", "llm_judgement": "{}", "unit_tests": "[]",
         "tests_execution_status": "[]", "average_test_score": "1"},
        {"id": "bad", "input": None, "output": "x"},
    ])
    assert detect_format(oci) == "opencodeinstruct"
    recs = _load(oci)
    assert (recs[0].messages[0]["content"] == "Write a function add(a, b)."
            and recs[0].messages[1]["role"] == "assistant")
    assert recs[1].reason == "missing_field"

    mt = _jsonl(tmp_path, "mt.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Make it shorter."]},
        {"question_id": 111, "category": "math", "turns": ["1+1?", "Times 3?"], "reference": ["2", "6"]},
        {"question_id": 1, "category": "x", "turns": []},
    ])
    recs = _load(mt, "mt-bench")
    assert recs[0].messages == [{"role": "user", "content": "Write a poem."}]
    assert [m["content"] for m in recs[1].messages] == ["1+1?", "2", "Times 3?"]
    assert recs[2].reason == "empty_prompt"

    gsm = _jsonl(tmp_path, "g.jsonl", [{"question": "Tom has 3 apples...", "answer": "3+2=<<3+2=5>>5\n#### 5"},
                                       {"question": 7}])
    recs = _load(gsm)
    assert recs[0].messages[1]["content"].endswith("#### 5")
    assert recs[1].reason == "bad_field_type"

    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n    \"\"\"doc\"\"\"\n",
                             "canonical_solution": "    return 1\n", "test": "", "entry_point": "f"}) + "\n")
    assert detect_format(he) == "prompt_response"
    assert _load(he)[0].messages[1]["content"] == "    return 1\n"


def test_bfcl_layout_normalizes_python_types(tmp_path):
    rec = {"id": "simple_0", "question": [[{"role": "user", "content": "Area of a triangle base 10 height 5?"}]],
           "function": [{"name": "calc.area", "description": "d", "parameters": {"type": "dict", "properties": {
               "base": {"type": "integer"}, "ratio": {"type": "float"},
               "pair": {"type": "tuple", "items": {"type": "float"}},
               "opts": {"type": "dict", "properties": {"unit": {"type": "string"}}}, "any": {"type": "any"}},
               "required": ["base"]}}]}
    path = _jsonl(tmp_path, "BFCL_v4_x.json",
                  [rec, {"id": "bad", "question": [[{"role": "user", "content": "x"}]], "function": "nope"}])
    assert detect_format(path) == "bfcl"
    recs = _load(path)
    params = recs[0].tools[0]["function"]["parameters"]
    assert params["type"] == "object"
    props = params["properties"]
    assert props["ratio"]["type"] == "number" and props["pair"] == {"type": "array", "items": {"type": "number"}}
    assert props["opts"]["type"] == "object" and props["any"]["type"] == "any"
    assert recs[0].tools[0]["function"]["name"] == "calc.area"
    assert recs[1].reason == "invalid_tools"


def test_file_level_errors(tmp_path):
    with pytest.raises(FormatError, match="does not exist"):
        _load(tmp_path / "missing.jsonl")
    unknown = _jsonl(tmp_path, "u.jsonl", [{"foo": 1}, {"foo": 2}])
    with pytest.raises(FormatError, match="cannot detect the layout.*foo"):
        detect_format(unknown)
    # load_records never refuses a file for its records: each one is a counted reject saying what to do
    recs = _load(unknown)
    assert [(r.source_row, r.reason) for r in recs] == [(0, "undetected_layout"), (1, "undetected_layout")]
    assert "foo" in recs[0].detail and "set 'format'" in recs[0].detail
    with pytest.raises(FormatError, match="unknown format 'parquet'"):
        _load(unknown, "parquet")
    truncated = tmp_path / "t.json"
    truncated.write_text('[{"question": "a", "answer": "b"}, {"quest')
    with pytest.raises(FormatError, match="not valid JSON"):
        _load(truncated)
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"data": [{"question": "a", "answer": "b"}]}))
    assert len(_load(wrapped, "gsm8k")) == 1


REAL = [
    ("llama_factory/glaive_toolcall_en_demo.json", "sharegpt", 300),
    ("code_alpaca/code_alpaca_2k.json", "alpaca", 2017),
    ("numinamath/numina_cot_sharegpt_data_1k.jsonl", "sharegpt", 1000),
    ("gsm8k/test.jsonl", "gsm8k", 1319),
    ("fastchat/mt_bench/question.jsonl", "mtbench", 80),
    ("bfcl/BFCL_v4_simple_python.json", "bfcl", 400),
    ("bfcl/BFCL_v4_multiple.json", "bfcl", 200),
    ("bfcl/BFCL_v4_parallel_multiple.json", "bfcl", 200),
    ("llama_factory/reason_tool_use_demo_50.jsonl", "messages", 50),
    ("fastchat/dummy_conversation.json", "sharegpt", 500),
    ("llama_factory/alpaca_en_demo.json", "alpaca", 999),
    ("human_eval/HumanEval.jsonl.gz", "prompt_response", 164),
]


@pytest.mark.parametrize(("rel", "fmt", "count"), REAL)
def test_real_public_samples(rel, fmt, count):
    path = SHARED / rel
    if not path.exists():
        pytest.skip(f"../shared/data is absent: {path} not found")
    assert detect_format(path) == fmt
    recs = _load(path, fmt)
    assert len(recs) == count
    rejects = Counter(r.reason for r in recs if isinstance(r, Rejected))
    assert not rejects, rejects
    for conv in recs:
        assert any(m["role"] == "user" for m in conv.messages)
        for m in conv.messages:
            assert m["role"] in ("system", "user", "assistant", "tool") and isinstance(m["content"], str)
            for call in m.get("tool_calls", []):
                assert isinstance(call["function"]["arguments"], dict)
        for tool in conv.tools or []:
            assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"


def test_real_glaive_toolcall_structure():
    path = SHARED / "llama_factory/glaive_toolcall_en_demo.json"
    if not path.exists():
        pytest.skip(f"../shared/data is absent: {path} not found")
    convs = _load(path, "sharegpt")
    calls = [c for conv in convs for m in conv.messages for c in m.get("tool_calls", [])]
    tool_msgs = [m for conv in convs for m in conv.messages if m["role"] == "tool"]
    assert len(calls) == 211 and len(tool_msgs) == 211  # one per function_call / observation turn in the file
    assert calls[0]["function"] == {"name": "search_recipes",
                                    "arguments": {"ingredients": ["chicken", "bell peppers", "rice"]}}


def test_real_specforge_invalid_arguments_rejected():
    path = SHARED / "specforge/data/tool_use_conversation.jsonl"
    if not path.exists():
        pytest.skip(f"../shared/data is absent: {path} not found")
    (rec,) = _load(path)
    # The file's second tool call has truncated JSON arguments: rejected, not silently kept as a string.
    assert isinstance(rec, Rejected) and rec.reason == "invalid_tool_arguments" and "search_replace" in rec.detail


def test_every_layout_is_registered():
    assert set(FORMATS) == {"sharegpt", "messages", "glaive", "alpaca", "opencodeinstruct", "mtbench", "gsm8k", "bfcl",
                            "prompt_response", "problem", "toolbench", "ultrachat"}
    for name, mod in FORMATS.items():
        assert mod.NAME == name and mod.SIGNATURE_KEYS and callable(mod.matches) and callable(mod.parse)
