"""The committed demo source files: native layouts, up to date with the generator, malformed rows rejected."""

from __future__ import annotations

import json

import pytest

from eagle_assets.demo.raw_samples import FILES, MALFORMED_ROWS, N_RECORDS, default_out_dir, prompt_samples, write_raw_samples
from eagle_assets.formats import Rejected, build_prompt, load_records

FORMATS = {"tool": "glaive", "code": "opencodeinstruct", "math": "messages", "reasoning": "sharegpt"}
EXPECTED_REJECTS = {
    "tool": {"no_user_turn", "unparseable_text", "invalid_tool_arguments"},
    "code": {"missing_field", "bad_field_type"},
    "math": {"no_user_turn", "bad_field_type"},
    "reasoning": {"bad_field_type", "empty_prompt"},
}


def _records(path):
    text = path.read_text(encoding="utf-8")
    return json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()]


def test_committed_files_match_the_generator(tmp_path):
    written = write_raw_samples(tmp_path)
    for path in written:
        committed = default_out_dir() / path.name
        assert committed.exists(), f"{committed} is missing: run python -m eagle_assets.demo.raw_samples"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run python -m eagle_assets.demo.raw_samples and commit the result")


@pytest.mark.parametrize("kind", sorted(FILES))
def test_native_layout(kind):
    records = _records(default_out_dir() / FILES[kind])
    assert len(records) == N_RECORDS + len(MALFORMED_ROWS) >= 48 + 2
    good = [r for i, r in enumerate(records) if i not in MALFORMED_ROWS]
    if kind == "tool":
        for r in good:
            assert set(r) == {"system", "chat"} and r["system"].startswith("SYSTEM: You are a helpful assistant")
            assert r["chat"].startswith("USER: ") and "ASSISTANT: <functioncall> {\"name\": " in r["chat"]
            assert "\"arguments\": '{" in r["chat"] and "FUNCTION RESPONSE: " in r["chat"]
    elif kind == "code":
        keys = {"id", "input", "output", "domain", "generation_algorithm", "llm_judgement", "unit_tests",
                "tests_execution_status", "average_test_score"}
        for r in good:
            assert set(r) == keys and isinstance(json.loads(r["unit_tests"]), list)
            assert r["output"].startswith("```python\ndef ")
    elif kind == "math":
        for r in good:
            assert set(r) == {"messages", "num_tokens", "source"}
            assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
            assert r["messages"][1]["content"].startswith("<think>\n") and "\n</think>\n\n" in r["messages"][1]["content"]
    else:
        for r in good:
            assert set(r) == {"system", "conversations"}
            assert [t["from"] for t in r["conversations"]] == ["user", "assistant"]
            value = r["conversations"][1]["value"]
            assert value.startswith("<|begin_of_thought|>") and value.endswith("<|end_of_solution|>")


@pytest.mark.parametrize("kind", sorted(FILES))
def test_loaders_reject_malformed_rows_and_keep_prompts_in_distribution(kind):
    loaded = list(load_records(default_out_dir() / FILES[kind], FORMATS[kind]))
    rejected = [r for r in loaded if isinstance(r, Rejected)]
    assert [r.source_row for r in rejected] == list(MALFORMED_ROWS)
    assert {r.reason for r in rejected} <= EXPECTED_REJECTS[kind]
    convs = [r for r in loaded if not isinstance(r, Rejected)]
    # The pipeline's prompts are exactly the generator's prompts the demo target was trained on.
    for conv, sample in zip(convs, prompt_samples(kind), strict=True):
        prompt, reference = build_prompt(conv, "last_user")
        assert prompt == sample.messages
        assert conv.tools == sample.tools
        assert reference is not None
