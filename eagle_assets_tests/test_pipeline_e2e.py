"""End to end through Dagster: a real instance, the embedded target served over HTTP by our /generate server,
real Parquet shards, blocking checks, and the drafter trained and exported from the QC shards."""

import json
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.definitions import PARTITION_JOB, TRAINING_JOB, build_definitions
from eagle_assets.demo.tokenizer import CONTROL_TOKENS
from eagle_assets.storage.shards import read_shards

REPO_ROOT = Path(__file__).resolve().parents[1]


def _catalog(tmp_path: Path, server_url: str) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    # One embedded server for the module, as a user's running server or sglang-router is given: each partition
    # run would otherwise launch its own (8 CPU-s of imports each). Launching from the pipeline is tested in
    # test_serving_resource.py and, under the daemon, in test_orchestration_live.py.
    base["server"]["url"] = server_url
    b1 = base["partitions"]["B1_glaive"]
    b1["prompt_policy"] = "last_user"  # the single-turn path; all_turns end to end: test_multi_turn_pipeline.py
    b1["sources"] = [{"path": str(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json"), "format": "glaive"}]
    b1["limit"] = 12
    cut = json.loads(json.dumps(b1))
    cut["sampling"]["max_new_tokens"] = 6  # every reply is cut inside its reasoning
    base["partitions"] = {"B1_glaive": b1, "B1_cut": cut}
    base["training"].update({"epochs": 2, "max_length": 512, "batch_tokens": 2048, "holdout_fraction": 0.25,
                             "acceptance_max_positions": 32})
    base["training"]["mix"]["bucket_caps"] = []  # B1 rows are all short: a cap on short rows would leave none
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.fixture(scope="module")
def pipeline(demo_target, tmp_path_factory):
    from eagle_assets.serving.launch import launched_server

    tmp = tmp_path_factory.mktemp("e2e")
    with launched_server(str(demo_target), log_dir=tmp / "server") as server, \
            dg.DagsterInstance.ephemeral() as instance:
        defs = build_definitions(_catalog(tmp, server.url), storage_root=tmp / "store")
        yield defs, instance, tmp / "store" / "catalog"


def _check(result, name):
    evals = [e.asset_check_evaluation_data for e in result.all_events
             if e.event_type_value == "ASSET_CHECK_EVALUATION" and e.asset_check_evaluation_data.check_name == name]
    assert len(evals) == 1, name
    return evals[0]


def test_partition_end_to_end(pipeline):
    defs, instance, store = pipeline
    result = defs.resolve_job_def(PARTITION_JOB).execute_in_process(partition_key="B1_glaive", instance=instance)
    assert result.success
    assert _check(result, "token_structure").passed and _check(result, "response_length").passed
    prompts = pq.read_table(store / "tokenized_prompts" / "B1_glaive" / "prompts.parquet").to_pylist()
    assert len(prompts) == 12
    gens = {r["sample_id"]: r for r in read_shards(store / "generations" / "B1_glaive").to_pylist()}
    assert set(gens) == {p["sample_id"] for p in prompts}
    qc = pq.read_table(store / "qc_shards" / "B1_glaive" / "shard-00000.parquet").to_pylist()
    assert qc, "no row survived QC"
    by_id = {p["sample_id"]: p for p in prompts}
    for row in qc:
        prompt_ids, output_ids = by_id[row["sample_id"]]["prompt_ids"], gens[row["sample_id"]]["output_ids"]
        # The training row is exactly prompt ids + the server's output ids, never re-tokenized text.
        assert row["input_ids"] == prompt_ids + output_ids
        assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(output_ids)
        # The demo target answers a function-calling request with a tool call, and the follow-up question of a B1
        # conversation (its last_user prompt holds the recorded call's <tool_response>) with a plain answer.
        follow_up = CONTROL_TOKENS.index("<tool_response>") in prompt_ids
        assert (row["tool_call_tokens"] > 0) == (not follow_up)
    report = (store / "length_report" / "report.md").read_text()
    assert "| B1_glaive | total | 12 |" in report

    # A second materialization of a finished partition sends no request.
    again = dg.materialize(
        [a for a in defs.assets if a.keys == {dg.AssetKey("generations")}], partition_key="B1_glaive",
        instance=instance, resources=defs.resources,
    )
    meta = again.asset_materializations_for_node("generations")[0].metadata
    assert meta["requested"].value == 0 and meta["skipped_done"].value == 12


def test_truncated_partition_fails_blocking_check_and_stops_downstream(pipeline):
    defs, instance, store = pipeline
    result = defs.resolve_job_def(PARTITION_JOB).execute_in_process(
        partition_key="B1_cut", instance=instance, raise_on_error=False
    )
    assert not result.success
    length = _check(result, "response_length")
    assert not length.passed and length.severity == dg.AssetCheckSeverity.ERROR
    assert length.metadata["share_truncated"].value == 1.0
    structure = _check(result, "token_structure")
    assert not structure.passed and structure.metadata["share_truncated_in_reasoning"].value == 1.0
    assert result.asset_materializations_for_node("length_report") == []
    from eagle_assets.cli import check_summary_lines

    lines = check_summary_lines(result)  # what `eagle-assets run` prints under the partition's status line
    # one finding per line, each under its own level (never "ERROR -- WARN: ...; ERROR: ...")
    assert "  check qc_shards.response_length ERROR: share_truncated = 1 > threshold 0.1" in lines, lines
    assert any(l.startswith("  check qc_shards.token_structure ERROR: share_dropped = 1") for l in lines), lines
    assert all(l.count("WARN:") + l.count("ERROR:") == 1 for l in lines), lines
    status = json.loads((store / "qc_shards" / "B1_cut" / "qc_status.json").read_text())
    assert status["passed"] is False and status["verdict"] == "failed"
    # one verdict, the same words wherever it is read: qc_status.json, the materialization, each check's metadata
    from eagle_assets.qc.status import partition_verdict

    verdict = partition_verdict(defs.resources["settings"].layout(), "B1_cut")
    assert (verdict.verdict, verdict.blocking_check, verdict.rows, verdict.kept) == ("failed", "token_structure", 12, 0)
    assert verdict.text() == ("failed (token_structure: share_dropped = 1 > threshold 0.2; response_length: "
                              "share_truncated = 1 > threshold 0.1); kept 0 of 12 replies, 12 dropped")
    meta = result.asset_materializations_for_node("qc_shards")[0].metadata
    assert list(meta)[:2] == ["qc_verdict", "qc_verdicts_as_of_this_run"] and meta["qc_verdict"].value == verdict.text()
    table = {r.data["partition"]: r.data for r in meta["qc_verdicts_as_of_this_run"].value.records}
    assert table["B1_cut"]["verdict"] == "failed" and table["B1_cut"]["blocking_check"] == "token_structure"
    assert table["B1_glaive"]["verdict"] == "passed" and table["B1_glaive"]["kept"] == 12
    assert length.metadata["qc_verdict"].value == structure.metadata["qc_verdict"].value == verdict.text()


def test_training_uses_passing_partitions_and_exports_valid_checkpoint(pipeline):
    from eagle_assets.assets.automation import unsynced
    from eagle_assets.cli import acceptance_line
    from eagle_assets.drafter.eagle3.export import validate_checkpoint

    defs, instance, store = pipeline
    # training_settings has never been observed in this instance: the job's own observation step must run before
    # the assets that read it (assets.inputs.AFTER_OBSERVATIONS), or they record no input version and show Unsynced
    assert instance.get_latest_data_version_record(dg.AssetKey("training_settings"), is_source=True) is None
    result = defs.resolve_job_def(TRAINING_JOB).execute_in_process(instance=instance)
    assert result.success
    starts = [e.step_key for e in result.all_events if e.event_type_value == "STEP_START"]
    assert starts.index("global_inputs") < starts.index("draft_vocab") < starts.index("drafter_checkpoint")
    stale = unsynced(instance, defs.resolve_asset_graph())  # what the UI's "Unsynced" badge shows
    assert not {k: v for k, v in stale.items() if k[0] in ("draft_vocab", "training_mix", "drafter_checkpoint")}, \
        stale
    line = acceptance_line(result)  # what the CLI prints when training passes
    assert line is not None and "mean held-out tau" in line
    from eagle_assets.cli import mix_line

    mix = result.asset_materializations_for_node("training_mix")[0].metadata["rows_by_partition"].value
    assert set(mix) == {"B1_glaive"} and 0 < mix["B1_glaive"]["mix"] <= mix["B1_glaive"]["candidates"]
    assert mix_line(result) == ("  training_mix: rows in the mix of each partition's training-split rows: "
                                f"B1_glaive {mix['B1_glaive']['mix']} of {mix['B1_glaive']['candidates']}")
    vocab_meta = result.asset_materializations_for_node("draft_vocab")[0].metadata
    assert "B1_cut" in vocab_meta["excluded_partitions"].value
    mix_meta = result.asset_materializations_for_node("training_mix")[0].metadata
    ckpt_meta = result.asset_materializations_for_node("drafter_checkpoint")[0].metadata
    assert mix_meta["dagster/row_count"].value == ckpt_meta["train_rows"].value > 0  # the drafter trains on the mix
    assert "B1_cut" in mix_meta["excluded_partitions"].value
    ckpt = store / "drafter_checkpoint" / "checkpoint"
    validate_checkpoint(ckpt)
    assert _check(result, "export_contract").passed
    metrics = json.loads((store / "drafter_checkpoint" / "training_metrics.json").read_text())["steps"]
    losses = [m["loss"] for m in metrics]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    acceptance = _check(result, "acceptance_length").metadata
    assert acceptance["tau_B1_glaive"].value >= 1.0
    # a catalog without an evaluation section gets the evaluation asset all the same: the held-out table, no suites
    assert "evaluation" in starts
    report = json.loads((store / "evaluation" / "report.json").read_text())
    assert {(r["suite"], r["k"]) for r in report["records"]} == {("heldout", k) for k in range(1, 9)}
    held = [r for r in report["records"] if r["k"] == 7][0]
    assert held["tau"] == pytest.approx(acceptance["mean_tau"].value, abs=1e-6)
    assert report["gates"] == [] and report["qc"] == {}
    assert {k: v["verdict"] for k, v in report["heldout_qc"].items()} == {"B1_glaive": "passed"}
    assert "held-out rows from: B1_glaive QC passed" in (store / "evaluation" / "report.md").read_text()
    # prompts never trained on are measured by the evaluation suites only (test_evaluation_suites.py)
    assert "unseen_tau" not in acceptance and not (store / "drafter_checkpoint" / "unseen_eval").exists()


def test_training_mix_that_caps_every_row_away_fails_with_advice(pipeline, tmp_path):
    defs, instance, store = pipeline
    settings = defs.resources["settings"]
    capped = yaml.safe_load(Path(settings.catalog_path).read_text())
    capped["training"]["mix"]["bucket_caps"] = [{"below_tokens": 300, "max_share": 0.3}]
    path = tmp_path / "catalog.yaml"  # same stem: the same storage directory as the pipeline fixture
    path.write_text(yaml.safe_dump(capped))
    capped_defs = build_definitions(path, storage_root=settings.storage_root)
    result = capped_defs.resolve_job_def(TRAINING_JOB).execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    failure = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"][0]
    assert failure.step_key == "training_mix"
    assert "the training mix is empty" in failure.event_specific_data.error.message
    assert "loosen the caps" in failure.event_specific_data.error.message
