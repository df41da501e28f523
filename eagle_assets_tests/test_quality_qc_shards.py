"""``tokenized_prompts`` and ``qc_shards`` through Dagster on a DeepSeek-R1 target, over generations shards that
another producer wrote (not our client): QC must hold every row to every rule itself and name each drop.

The target directory holds DeepSeek-V3's real tokenizer (R1 shares it) with R1's chat template (V3's template with
the generation prompt ``<｜Assistant｜><think>\\n``, as in deepseek-ai/DeepSeek-R1's tokenizer_config.json) and no
``config.json``, so the vocab size must come from the tokenizer. The raw prompts are written as ``raw_prompts``
writes them; the Dagster instance, Parquet files and metadata are real.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.assets.prompts import RAW_SCHEMA, build_prompt_assets
from eagle_assets.assets.qc import build_qc_assets
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.generations.run import GENERATION_SCHEMA
from eagle_assets.qc.qc_pass import QC_SKIP_REASONS
from eagle_assets.storage.shards import Layout
from eagle_assets.structure.segment import DROP_REASONS
from eagle_assets.target_model import load_tokenizer

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEEPSEEK = SHARED / "tokenizers" / "deepseek-v3"
KEY = "R1"
QUESTIONS = ["What is 2+2?", "Name a prime number.", "Is 9 odd?", "Spell cat.", "What is 3*3?", "Say hi.",
             "What is the capital of Italy?", "Count to three.", "Is 10 even?", "What is 5-2?", "Name a colour."]


@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory) -> Path:
    if not DEEPSEEK.exists():
        pytest.skip(f"../shared/data is absent: {DEEPSEEK} not found")
    d = tmp_path_factory.mktemp("deepseek-r1")
    os.symlink(DEEPSEEK / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((DEEPSEEK / "tokenizer_config.json").read_text())
    v3 = cfg["chat_template"]
    cfg["chat_template"] = v3.replace("{{'<｜Assistant｜>'}}{% endif %}", "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    assert cfg["chat_template"] != v3
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _setup(tmp: Path, r1_dir: Path) -> tuple[dict, Layout, list[dg.AssetsDefinition]]:
    (tmp / "src.jsonl").write_text("")
    catalog = {"target": {"model": str(r1_dir)}, "server": {"url": "http://127.0.0.1:9"},
               "partitions": {KEY: {"sources": [{"path": str(tmp / "src.jsonl"), "format": "messages"}],
                                    "sampling": {"max_new_tokens": 64},
                                    "thresholds": {"short_tokens": 5, "min_median_tokens": 0}}}}
    (tmp / "cat.yaml").write_text(yaml.safe_dump(catalog))
    resources = {"settings": PipelineSettings(catalog_path=str(tmp / "cat.yaml"), storage_root=str(tmp / "store")),
                 "target": TargetModel(model=str(r1_dir))}
    layout = resources["settings"].layout()
    raw = [{"sample_id": f"p{i}", "messages": json.dumps([{"role": "user", "content": q}]), "tools": None,
            "reference_reply": None, "source_file": "src.jsonl", "source_row": i} for i, q in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(raw, schema=RAW_SCHEMA),
                   layout.stage_dir("raw_prompts", KEY) / "prompts.parquet")
    partitions = dg.StaticPartitionsDefinition([KEY])
    return resources, layout, [*build_prompt_assets(partitions), *build_qc_assets(partitions)]


def _materialize(assets, resources, name: str, instance, raise_on_error: bool = True):
    asset = next(a for a in assets if a.key.to_user_string() == name)
    return dg.materialize([asset], resources=resources, partition_key=KEY, instance=instance,
                          raise_on_error=raise_on_error)


def test_qc_holds_rows_of_any_producer_to_every_rule(tmp_path, r1_dir):
    resources, layout, assets = _setup(tmp_path, r1_dir)
    tok = load_tokenizer(r1_dir)
    enc = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    with dg.DagsterInstance.ephemeral() as instance:
        _materialize(assets, resources, "tokenized_prompts", instance)
        prompts = {r["sample_id"]: r for r in
                   pq.read_table(layout.stage_dir("tokenized_prompts", KEY) / "prompts.parquet").to_pylist()}
        # item 1: the R1 prompt ends <think>\n, the think-start is not the last id, and the prompt opens the block
        assert all(p["prompt_opens_think"] for p in prompts.values())
        assert all(p["prompt_ids"][-3:] == [128804, 128798, 201] for p in prompts.values())

        eos = "<｜end▁of▁sentence｜>"
        good = enc("Okay, 2 and 2 make 4.\n</think>\n\n4" + eos)
        outputs = {
            "p0": (good, "stop", None),  # kept
            "p1": (enc("\n</think>\n\nOK" + eos), "stop", None),  # kept: empty reasoning, one-word answer
            "p2": (enc("Okay, no end." + eos), "stop", "missing_think_end"),
            "p3": (enc("A.</think>B.</think>C." + eos), "stop", "multiple_think_end"),
            "p4": (enc("Okay.\n</think>\n\n" + eos), "stop", "empty_answer"),
            "p5": (enc("Okay, 2 and 2 make"), "length", "truncated_in_reasoning"),
            "p6": (good[:3] + [len(tok)] + good[4:], "stop", "id_out_of_vocab"),  # item 5: no config.json
            "p7": (prompts["p7"]["prompt_ids"][-5:] + good, "stop", "prompt_echo"),  # counted echo
            "p8": (good + enc("<｜User｜>And 3+3?<｜Assistant｜>6" + eos), "stop", "stop_token_mid_output"),
            "p9": (enc("Okay.\n</think>\n\nYes") + [128806, 128808] + enc("f") + [128809] + enc(eos), "stop",
                   "unbalanced_tool_call"),
        }
        rows = []
        for sid, (ids, finish, _) in outputs.items():
            rows.append({"sample_id": sid, "output_ids": ids, "finish_reason": finish,
                         "matched_stop": 1 if finish == "stop" else None, "completion_tokens": len(ids),
                         "prompt_tokens": len(prompts[sid]["prompt_ids"]), "latency_s": 0.1, "attempts": 1,
                         "sampling_params": json.dumps({"max_new_tokens": 64})})
        rows.append(dict(rows[0]))  # the same sample twice (two producers)
        rows.append(dict(rows[0], sample_id="gone"))  # a prompt no longer in the partition
        gen_dir = layout.stage_dir("generations", KEY)
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), gen_dir / "shard-00000.parquet")
        # an older producer's shard: fewer columns, no counts, no matched stop, no sampling params
        old = pa.table({"sample_id": ["p10"], "output_ids": pa.array([good], pa.list_(pa.int64())),
                        "finish_reason": ["stop"]})
        pq.write_table(old, gen_dir / "shard-00001.parquet")

        # most rows are broken: the blocking token_structure check fails, after the shards and metadata are written
        result = _materialize(assets, resources, "qc_shards", instance, raise_on_error=False)

    meta = result.asset_materializations_for_node("qc_shards")[0].metadata
    counts = meta["drop_reason_counts"].value
    expected = {r: 0 for r in (*DROP_REASONS, *QC_SKIP_REASONS)}
    for _, _, reason in outputs.values():
        if reason:
            expected[reason] += 1
    expected.update(duplicate_row=1, stale_prompt=1)
    assert counts == expected
    table = meta["drop_reasons"].value
    assert all(f"| {r} |" in table for r in (*DROP_REASONS, *QC_SKIP_REASONS))  # zeros listed too
    assert meta["vocab_size"].value == len(tok) == 128815
    qc_file = layout.stage_dir("qc_shards", KEY) / "shard-00000.parquet"
    qc = {r["sample_id"]: r for r in pq.read_table(qc_file).to_pylist()}
    assert set(qc) == {"p0", "p1", "p10"}
    assert qc["p0"]["reasoning_tokens"] == len(enc("Okay, 2 and 2 make 4.\n")) and qc["p0"]["answer_tokens"] == 2
    assert qc["p0"]["input_ids"] == prompts["p0"]["prompt_ids"] + good
    assert qc["p1"]["reasoning_tokens"] == 1 and qc["p1"]["answer_tokens"] == len(enc("\n\nOK"))
    check = next(e.asset_check_evaluation_data for e in result.all_events
                 if e.event_type_value == "ASSET_CHECK_EVALUATION"
                 and e.asset_check_evaluation_data.check_name == "token_structure")
    assert check.metadata["drop_reasons"].value == expected and not check.passed
    # the partition's verdict: failed by token_structure (8 of 11 checked replies dropped), the same words in
    # qc_status.json, the materialization (its first entries) and each check's metadata
    from eagle_assets.qc.status import partition_verdict

    verdict = partition_verdict(layout, KEY)
    assert verdict.text() == ("failed (token_structure: share_dropped = 0.7273 > threshold 0.2); kept 3 of 11 replies, "
                              "8 dropped")
    assert json.loads((layout.stage_dir("qc_shards", KEY) / "qc_status.json").read_text())["verdict"] == "failed"
    assert list(meta)[:2] == ["qc_verdict", "qc_verdicts_as_of_this_run"] and meta["qc_verdict"].value == verdict.text()
    (row,) = [r.data for r in meta["qc_verdicts_as_of_this_run"].value.records]
    assert row == {"partition": KEY, "verdict": "failed", "blocking_check": "token_structure",
                   "finding": "token_structure: share_dropped = 0.7273 > threshold 0.2", "kept": 3, "dropped": 8,
                   "rows": 11}
    assert check.metadata["qc_verdict"].value == verdict.text()


def test_one_verdict_per_partition_from_its_qc_status():
    """``qc.status.qc_verdict``: passed at level OK, warned on a WARN finding (it trains), failed on an ERROR or
    when no reply is kept; the reason names the blocking check and only the findings of the verdict's own level;
    a qc_status.json from before findings were recorded still gives the word, and says how to get the figures."""
    from eagle_assets.qc.status import qc_verdict

    warn = {"check": "response_length", "level": "WARN", "figure": "share_under_short", "value": 1.0,
            "threshold": 0.9, "comparison": ">"}
    error = {"check": "token_structure", "level": "ERROR", "figure": "share_dropped", "value": 35 / 39,
             "threshold": 0.2, "comparison": ">"}
    ok = qc_verdict({"partition": "a", "token_structure": "OK", "response_length": "OK", "rows": 5, "kept": 5,
                     "findings": []})
    assert (ok.verdict, ok.blocking_check, ok.text()) == ("passed", None, "passed; kept 5 of 5 replies, 0 dropped")
    warned = qc_verdict({"partition": "b", "token_structure": "OK", "response_length": "WARN", "rows": 48,
                         "kept": 48, "findings": [warn]})
    assert warned.text() == ("warned (response_length: share_under_short = 1 > threshold 0.9); kept 48 of 48 "
                             "replies, 0 dropped") and warned.blocking_check is None
    failed = qc_verdict({"partition": "c", "token_structure": "ERROR", "response_length": "WARN", "rows": 39,
                         "kept": 4, "findings": [warn, error]})
    assert failed.text() == ("failed (token_structure: share_dropped = 0.8974 > threshold 0.2); kept 4 of 39 "
                             "replies, 35 dropped")
    assert failed.to_dict()["dropped"] == 35 and failed.to_dict()["blocking_check"] == "token_structure"
    # open thresholds let every check pass, but nothing was kept: nothing to train on
    empty = qc_verdict({"partition": "d", "token_structure": "OK", "response_length": "OK", "rows": 4, "kept": 0,
                        "findings": []})
    assert empty.text() == "failed (no reply kept (0 of 4): nothing to train on or measure); kept 0 of 4 replies, " \
        "4 dropped"
    old = qc_verdict({"partition": "e", "token_structure": "OK", "response_length": "WARN", "rows": 9, "kept": 9})
    assert old.verdict == "warned" and old.stale
    assert old.finding() == "response_length WARN (materialize qc_shards again for the figures)"
