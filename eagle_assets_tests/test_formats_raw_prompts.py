"""``raw_prompts`` (and what flows from it) on a real Dagster instance: a file mixing good and bad records, an
empty file through the whole partition job, and the tool layouts rendered by the real Qwen3 tokenizer.

The Qwen3 tests use ``../shared/data/tokenizers/qwen3-0.6b`` as the target model directory (tokenizer + config,
no weights: rendering needs nothing more) and skip, saying so, where it is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.definitions import build_definitions
from eagle_assets.formats import REJECT_REASONS

pytestmark = pytest.mark.slow(seconds=50)  # its share of a parallel session: scheduled early (conftest)

DATA = Path(__file__).resolve().parent / "data"


def _catalog(tmp_path: Path, partitions: dict, model: str = "demo") -> Path:
    path = tmp_path / "cat.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": model}, "partitions": {
        key: {"sources": sources, "sampling": {"max_new_tokens": 8}, "prompt_policy": "last_user"}
        for key, sources in partitions.items()}}))
    return path


def _materialize(catalog: Path, tmp_path: Path, keys: list[str], partition: str, **kwargs):
    defs = build_definitions(catalog, storage_root=tmp_path / "store", **kwargs)
    assets = [a for a in defs.assets
              if isinstance(a, dg.AssetsDefinition) and len(a.keys) == 1 and a.key.path[0] in keys]
    with dg.DagsterInstance.ephemeral() as instance:
        return dg.materialize(assets, partition_key=partition, instance=instance, resources=defs.resources,
                              raise_on_error=False)


def _checks(result) -> dict[str, object]:
    return {e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
            for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}


def test_raw_prompts_keeps_every_good_record_of_a_file_with_bad_ones(tmp_path):
    good = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]
    src = tmp_path / "mixed.jsonl"
    with open(src, "wb") as fh:
        fh.write(json.dumps(good[0]).encode() + b"\n")
        fh.write(b'{"question": "lone \\ud800 surrogate", "answer": "x"}\n')  # crashed sample_id before issue 11
        fh.write(json.dumps(good[1]).encode() + b"\n")
        fh.write(b'{"question": "caf\xe9?", "answer": "a byte that is not UTF-8"}\n')
        fh.write(b'{"question": "numeric reference", "answer": 27.0}\n')  # kept: a reference never drops a prompt
        fh.write(b"{broken json\n")
        fh.write(b'{"question": 7}\n')
        fh.write(json.dumps(good[2]).encode() + b"\n")
        fh.write(json.dumps(good[2]).encode() + b"\n")  # duplicate
    result = _materialize(_catalog(tmp_path, {"P": [{"path": str(src), "format": "auto"}]}), tmp_path,
                          ["raw_prompts"], "P")
    assert result.success
    out = tmp_path / "store" / "cat" / "raw_prompts" / "P"
    rows = pq.read_table(out / "prompts.parquet").to_pylist()
    assert [json.loads(r["messages"])[0]["content"] for r in rows] == [
        "What is 0 + 0?", "What is 1 + 1?", "numeric reference", "What is 2 + 2?"]
    assert [r["source_row"] for r in rows] == [0, 2, 4, 7]
    assert json.loads(rows[2]["reference_reply"])["content"] == "27.0"
    rejects = pq.read_table(out / "rejects.parquet").to_pylist()
    assert [(r["source_row"], r["reason"]) for r in rejects] == [
        (1, "invalid_unicode"), (3, "invalid_unicode"), (5, "bad_json"), (6, "bad_field_type"), (8, "duplicate")]
    assert all(r["reason"] in REJECT_REASONS and r["detail"] for r in rejects)
    assert rejects[-1]["sample_id"] == rows[-1]["sample_id"]
    meta = result.asset_materializations_for_node("raw_prompts")[0].metadata
    assert meta["dagster/row_count"].value == 4 and meta["rejected"].value == 5 and meta["empty"].value is False
    assert "invalid_unicode | 2" in meta["reject_reasons"].value
    check = _checks(result)["prompts_available"]
    assert check.passed and "4 prompts" in check.description


def test_an_empty_file_flows_through_the_partition_job_as_zero_rows(tmp_path):
    from eagle_assets.assets.server_resource import SGLangServerResource
    from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

    qwen = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / "qwen3-0.6b"
    if not qwen.is_dir():
        pytest.skip(f"../shared/data is absent ({qwen}): the real Qwen3 tokenizer is the target here")
    (tmp_path / "empty.jsonl").write_text("")
    catalog = _catalog(tmp_path, {"E": [{"path": str(tmp_path / "empty.jsonl"), "format": "auto"}]}, model=str(qwen))
    stub = StubServer(vocab_size=151936)
    with serve_stub_in_thread(stub) as running:
        defs = build_definitions(catalog, storage_root=tmp_path / "store",
                                 sglang=SGLangServerResource(urls=[running.url]))
        with dg.DagsterInstance.ephemeral() as instance:
            result = defs.resolve_job_def("partition_job").execute_in_process(
                partition_key="E", instance=instance, raise_on_error=False)
    assert stub.stats.requests == 0
    failures = {e.step_key for e in result.all_events if e.event_type_value == "STEP_FAILURE"}
    assert failures == {"qc_shards"}, "only QC's blocking checks stop an empty partition; nothing before it crashes"
    rows = {a: result.asset_materializations_for_node(a)[0].metadata["dagster/row_count"].value
            for a in ("raw_prompts", "tokenized_prompts", "generations", "qc_shards")}
    assert rows == {"raw_prompts": 0, "tokenized_prompts": 0, "generations": 0, "qc_shards": 0}
    checks = _checks(result)
    assert not checks["prompts_available"].passed
    assert checks["prompts_available"].description.startswith("partition E is empty: its sources hold no records")
    for name in ("token_structure", "response_length"):
        assert not checks[name].passed and checks[name].description.startswith("the partition is empty")


def test_a_file_of_malformed_records_is_rejected_record_by_record(tmp_path):
    src = tmp_path / "bad.jsonl"
    # (a conversations string is one prompt: test_formats_string_turns.py; a number is not a conversation)
    src.write_text('{"conversations": 7}\n{"conversations": [{"from": "narrator", "value": "x"}]}\n{oops\n')
    result = _materialize(_catalog(tmp_path, {"B": [{"path": str(src), "format": "auto"}]}), tmp_path,
                          ["raw_prompts"], "B")
    assert result.success
    rejects = pq.read_table(tmp_path / "store" / "cat" / "raw_prompts" / "B" / "rejects.parquet").to_pylist()
    assert [r["reason"] for r in rejects] == ["bad_field_type", "unknown_role", "bad_json"]
    check = _checks(result)["prompts_available"]
    assert not check.passed and "all 3 records of its sources were rejected" in check.description


@pytest.fixture(scope="module")
def qwen3_dir():
    path = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / "qwen3-0.6b"
    if not path.is_dir():
        pytest.skip(f"../shared/data is absent ({path}): the real Qwen3 tokenizer is needed to render tools")
    return path


@pytest.mark.parametrize(("sources", "tool_names"), [
    ([{"path": str(DATA / "bfcl_multi_turn" / "BFCL_v4_multi_turn_base.json"), "format": "bfcl"}],
     [["cd", "find", "ls", "mkdir", "mv", "sort"], ["authenticate_twitter", "post_tweet", "comment", "mv"],
      ["add", "mean"]]),
    ([{"path": str(DATA / "toolbench" / "G1_query.json"), "format": "toolbench"},
      {"path": str(DATA / "toolbench" / "answer" / "10_ChatGPT_DFS_woFilter_w2.json"), "format": "auto"}],
     [["current_city_for_open_weather_lite", "forecast_days_for_open_weather_lite", "Finish"],
      ["checkhealth_for_squake", "Finish"], ["current_city_for_open_weather_lite", "Finish"]]),
], ids=["bfcl_multi_turn", "toolbench"])
def test_tool_layouts_reach_the_real_qwen3_chat_template(tmp_path, qwen3_dir, sources, tool_names):
    from transformers import AutoTokenizer

    result = _materialize(_catalog(tmp_path, {"T": sources}, model=str(qwen3_dir)), tmp_path,
                          ["raw_prompts", "tokenized_prompts"], "T")
    assert result.success
    raw = pq.read_table(tmp_path / "store" / "cat" / "raw_prompts" / "T" / "prompts.parquet").to_pylist()
    tokenized = {r["sample_id"]: r for r in pq.read_table(
        tmp_path / "store" / "cat" / "tokenized_prompts" / "T" / "prompts.parquet").to_pylist()}
    assert len(raw) == len(tokenized) == len(tool_names)
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    for r, names in zip(raw, tool_names):
        text = tok.decode(tokenized[r["sample_id"]]["prompt_ids"])
        assert "<tools>\n" in text and "\n</tools>" in text, "Qwen3 renders tools in a <tools> block of the system turn"
        tools_block = text[text.index("<tools>\n"):text.index("\n</tools>")]
        rendered = [json.loads(line)["function"]["name"] for line in tools_block.splitlines()[1:]]
        assert set(names) <= set(rendered), (names, rendered)
        assert rendered == [t["function"]["name"] for t in json.loads(r["tools"])], "every stored tool, in order"
        assert json.loads(r["messages"])[-1]["content"] in text
