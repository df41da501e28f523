"""A layout's turns field holding one prompt as a string (``{"turns": "..."}``, ``{"messages": "..."}``,
``{"conversations": "..."}``, as some public eval files have it): read as one user prompt when that is unambiguous,
else refused naming the field and the fix; and ``format: auto`` never picks a layout that rejects every record while
another layout reads them. Driven through the ``raw_prompts`` asset on a real Dagster instance, on held-back files
(``data/string_turns/``, one per kind) that no loader was written against.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.definitions import build_definitions
from eagle_assets.formats import FORMATS, detect_format, load_records
from eagle_assets.formats.conversation import Conversation, Rejected, check_conversation

DATA = Path(__file__).resolve().parent / "data"
STRINGS = DATA / "string_turns"


def _raw_prompts(tmp_path: Path, sources: dict[str, Path]) -> tuple[dict[str, dg.ExecuteInProcessResult], Path]:
    """``raw_prompts`` of one partition per source (``format: auto``) materialized on an ephemeral instance;
    returns the result per partition and the catalog's raw_prompts folder."""
    catalog = tmp_path / "strings.yaml"
    catalog.write_text(yaml.safe_dump({"target": {"model": "demo"}, "partitions": {
        key: {"sources": [{"path": str(path), "format": "auto"}], "sampling": {"max_new_tokens": 8}}
        for key, path in sources.items()}}))
    defs = build_definitions(catalog, storage_root=tmp_path / "store")
    raw = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and a.keys == {dg.AssetKey("raw_prompts")}]
    results = {}
    with dg.DagsterInstance.ephemeral() as instance:
        for key in sources:
            results[key] = dg.materialize(raw, partition_key=key, instance=instance, resources=defs.resources,
                                          raise_on_error=False)
    return results, tmp_path / "store" / "strings" / "raw_prompts"


def _prompts(folder: Path) -> list[list[dict]]:
    return [json.loads(r["messages"]) for r in pq.read_table(folder / "prompts.parquet").to_pylist()]


def test_a_turns_field_holding_one_prompt_string_is_read_as_one_user_turn_in_every_layout(tmp_path):
    files = {"mt": STRINGS / "mtbench_turns_string.jsonl", "msgs": STRINGS / "messages_string.json",
             "conv": STRINGS / "conversations_string.jsonl.gz"}
    results, store = _raw_prompts(tmp_path, files)
    expected = {
        "mt": [[{"role": "user", "content": json.loads(line)["turns"]}]
               for line in files["mt"].read_text().splitlines()],
        "msgs": [[{"role": "user", "content": "Summarize the water cycle for a ten-year-old."}],
                 [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "List three uses of a paper clip besides holding paper."}],
                 [{"role": "user", "content": "Translate 'good morning' into French and Spanish."}]],
        "conv": [[{"role": "user", "content": "Give me a packing list for a two-day hike."}],
                 [{"role": "user", "content": "Explain why the sky looks blue at noon and red at sunset."}]],
    }
    for key, result in results.items():
        assert result.success, key
        assert _prompts(store / key) == expected[key], key  # every record, none rejected
        assert pq.read_table(store / key / "rejects.parquet").num_rows == 0, key
        meta = result.asset_materializations_for_node("raw_prompts")[0].metadata
        assert meta["dagster/row_count"].value == len(expected[key]) and meta["rejected"].value == 0
    assert [detect_format(files[k]) for k in ("mt", "msgs", "conv")] == ["mtbench", "messages", "messages"]
    # the layout named explicitly reads it the same way (sharegpt for a conversations string)
    assert [r.messages for r in load_records(files["conv"], "sharegpt")] == expected["conv"]


def test_a_string_that_would_be_read_by_guessing_is_refused_naming_the_field_and_the_fix(tmp_path):
    path = STRINGS / "mtbench_turns_ambiguous.jsonl"
    results, store = _raw_prompts(tmp_path, {"amb": path})
    assert results["amb"].success
    assert _prompts(store / "amb") == [[{"role": "user", "content": "What does a barometer measure?"}]]
    rejects = pq.read_table(store / "amb" / "rejects.parquet").to_pylist()
    assert [(r["source_line"], r["reason"]) for r in rejects] == [
        (1, "bad_field_type"), (2, "bad_field_type"), (3, "empty_prompt")]
    encoded, transcript, blank = (r["detail"] for r in rejects)
    assert "field 'turns' is a string holding JSON (a list)" in encoded and "jq -c '.turns |= fromjson'" in encoded
    assert "field 'turns' is one string holding a whole conversation (it has 'ASSISTANT:'" in transcript
    assert "split it into a list of turns in the file" in transcript and "format glaive" in transcript
    assert "field 'turns' is an empty string" in blank


def test_format_auto_never_picks_a_layout_that_rejects_every_record_another_layout_reads(tmp_path):
    """Every held-back file of each kind: when some layout reads some of its records, ``auto`` yields prompts; and a
    file whose records mtbench claims but cannot read (a blank first turn) while prompt_response reads them."""
    tie = tmp_path / "tie.jsonl"
    tie.write_text("".join(json.dumps({"turns": ["", "What next?"], "prompt": f"Name a colour, {i}."}) + "\n"
                           for i in range(3)))
    files = [tie, *sorted(p for p in STRINGS.iterdir()), *sorted((DATA / "math").iterdir()),
             *sorted((DATA / "ultrachat").iterdir())]

    def reads(mod, record) -> bool:
        try:
            check_conversation(mod.parse(record, 0))
        except Exception:  # noqa: BLE001 - any refusal: this layout does not read the record
            return False
        return True

    from eagle_assets.formats.reader import BadLine, iter_raw_records

    for path in files:
        records = [r for _, r in iter_raw_records(path) if not isinstance(r, BadLine)][:50]
        readable = any(reads(mod, r) for mod in FORMATS.values() for r in records)
        loaded = list(load_records(path, "auto"))
        kept = [r for r in loaded if isinstance(r, Conversation)]
        assert bool(kept) == readable, (path, detect_format(path), [r for r in loaded if isinstance(r, Rejected)])
    assert detect_format(tie) == "prompt_response"
    assert [r.messages for r in load_records(tie, "auto")][0] == [{"role": "user", "content": "Name a colour, 0."}]


@pytest.mark.parametrize("value", ["Hello there", "Compute 3 * 4.\nShow your work.", "User: explain DNS"])
def test_plain_prompt_strings_are_one_user_turn(value):
    from eagle_assets.formats import mtbench

    assert mtbench.matches({"turns": value})
    assert mtbench.parse({"turns": value}, 0).messages == [{"role": "user", "content": value}]
