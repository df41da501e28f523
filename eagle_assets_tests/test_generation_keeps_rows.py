"""A partition's good rows survive a switch to a dead server: a real Dagster instance, the embedded target served
over HTTP, real Parquet shards, and the CLI as a user runs it.

The sequence (one module, one server): B1 is generated against the live server; the catalog then points at a
refusing URL with other sampling settings (so the stored rows are no longer resumable), runs through Dagster and
through the CLI, and fails at once naming the URL and the error while the shards stay byte for byte; pointed back
at the live server, the partition is generated again and the new rows replace the old ones.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.catalog import load_catalog
from eagle_assets.definitions import PARTITION_JOB, build_definitions
from eagle_assets.generations.run import STAGING_DIR
from eagle_assets.lineage.versions import target_model_version
from eagle_assets.storage.shards import read_shards, shard_paths

REPO_ROOT = Path(__file__).resolve().parents[1]
REFUSING = "http://127.0.0.1:9"  # the discard port: nothing listens there, connections are refused


def _write_catalog(path: Path, url: str | None, max_new_tokens: int = 256, target: Path | None = None) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    if target is not None:  # the built demo target by path: "demo" would build one under this test's storage root
        base["target"]["model"] = str(target)
    base["server"]["url"] = url
    b1 = base["partitions"]["B1_glaive"]
    b1["prompt_policy"] = "last_user"
    b1["sources"] = [{"path": str(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json"), "format": "glaive"}]
    b1["limit"] = 6
    b1["sampling"]["max_new_tokens"] = max_new_tokens
    # every reply is "short" (under 1,000 tokens) and the warn level is 0: response_length WARNs, downstream goes on
    b1["thresholds"].update(short_tokens=1000, max_share_short_warn=0.0, max_share_short_error=1.0)
    base["partitions"] = {"B1_glaive": b1}
    path.write_text(yaml.safe_dump(base))
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in shard_paths(folder)}


@pytest.fixture(scope="module")
def switched(demo_target, tmp_path_factory):
    from eagle_assets.cli import failure_lines, main
    from eagle_assets.serving.launch import launched_server

    tmp = tmp_path_factory.mktemp("keeps_rows")
    store, catalog = tmp / "store", tmp / "uc.yaml"
    gens, qc = store / "uc" / "generations" / "B1_glaive", store / "uc" / "qc_shards" / "B1_glaive"
    home = tmp / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    out: dict = {}
    with launched_server(str(demo_target), log_dir=tmp / "server") as server, \
            pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAGSTER_HOME", str(home))
        mp.setenv("EAGLE_ASSETS_HOME", str(store))
        mp.delenv("EAGLE_ASSETS_CATALOG", raising=False)
        instance = dg.DagsterInstance.ephemeral()  # the CLI below uses $DAGSTER_HOME's; the rows are in files

        def run(url, max_new_tokens=256, regenerate=False):
            defs = build_definitions(_write_catalog(catalog, url, max_new_tokens, demo_target), storage_root=store)
            config = {"ops": {"generations": {"config": {"regenerate": True}}}} if regenerate else None
            return defs.resolve_job_def(PARTITION_JOB).execute_in_process(
                partition_key="B1_glaive", instance=instance, raise_on_error=False, run_config=config)

        out["first"] = run(server.url)
        out["good_shards"], out["good_qc"] = _files(gens), pq.read_table(qc / "rows.parquet").num_rows
        # the same weights behind another URL: nothing to regenerate, no request, the rows resumed
        out["same_model_dead_url"] = run(REFUSING)
        out["after_same_model"] = _files(gens)
        # other sampling settings: the rows must be generated again, but the server refuses connections
        out["dead"] = run(REFUSING, max_new_tokens=200)
        out["dead_lines"] = failure_lines(out["dead"])
        out["after_dead"], out["qc_after_dead"] = _files(gens), pq.read_table(qc / "rows.parquet").num_rows
        out["dead_regenerate"] = run(REFUSING, regenerate=True)
        out["after_dead_regenerate"] = _files(gens)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out["cli_rc"] = main(["run", "--catalog", str(_write_catalog(catalog, REFUSING, 200, demo_target))])
        out["cli"] = printed.getvalue()
        out["after_cli"] = _files(gens)
        # a server that answers /health but refuses every /generate: the step fails with the failures by kind
        from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

        with serve_stub_in_thread(StubServer(vocab_size=2048, fault=lambda rid, attempt, body: "http_400")) as stub:
            out["refusing"] = run(stub.url, max_new_tokens=200)
        out["refusing_lines"] = failure_lines(out["refusing"])
        out["after_refusing"] = _files(gens)
        out["back"] = run(server.url, max_new_tokens=200)
        out["after_back"] = read_shards(gens)
        out["staging_left"] = (gens / STAGING_DIR).exists()
    out["versions"] = {url: target_model_version(load_catalog(_write_catalog(tmp / "v.yaml", url, 256, demo_target))
                                                 ).data_version for url in (None, REFUSING)}
    return out


def test_a_warning_check_is_a_warn_severity_failure_of_its_partition_and_blocks_nothing(switched):
    first = switched["first"]
    assert first.success and switched["good_shards"] and switched["good_qc"] > 0
    checks = {e.check_name: e for e in first.get_asset_check_evaluations()}
    length = checks["response_length"]
    assert (length.passed, length.severity) == (False, dg.AssetCheckSeverity.WARN)  # the UI's warning, not "Passed"
    assert length.partition == "B1_glaive" and checks["token_structure"].partition == "B1_glaive"
    assert length.description.startswith("WARN: share_under_short = 1 > threshold 0")
    assert first.asset_materializations_for_node("length_report")  # a warning stops nothing downstream
    table = first.asset_materializations_for_node("length_report")[0].metadata["length_table"]
    assert {r.data["span"] for r in table.value.records} == {"total", "reasoning", "answer"}  # inline, as a table


def test_serving_the_same_weights_another_way_is_the_same_target(switched):
    assert switched["versions"][None] == switched["versions"][REFUSING]
    assert switched["same_model_dead_url"].success
    meta = switched["same_model_dead_url"].asset_materializations_for_node("generations")[0].metadata
    assert meta["requested"].value == 0 and meta["skipped_done"].value == 6
    assert switched["after_same_model"] == switched["good_shards"]


def test_a_dead_server_fails_the_step_at_once_and_every_stored_row_stays(switched):
    for name, after in (("dead", "after_dead"), ("dead_regenerate", "after_dead_regenerate"), (None, "after_cli")):
        if name:
            assert not switched[name].success, name
            # nothing downstream ran on an empty partition: qc_shards was not rewritten
            assert switched[name].asset_materializations_for_node("qc_shards") == []
        assert switched[after] == switched["good_shards"], after  # byte for byte
    assert switched["qc_after_dead"] == switched["good_qc"]
    line = [l for l in switched["dead_lines"] if l.startswith("  step generations FAILED -- ")]
    assert len(line) == 1, switched["dead_lines"]
    assert REFUSING in line[0] and "Cannot connect to host 127.0.0.1:9" in line[0], line[0]
    assert "no stored row was touched" in line[0]


def test_a_step_whose_every_request_failed_fails_with_the_failures_by_kind_and_keeps_the_rows(switched):
    assert not switched["refusing"].success
    assert switched["refusing"].asset_materializations_for_node("qc_shards") == []
    assert switched["after_refusing"] == switched["good_shards"]  # the staged regeneration had no row to promote
    [line] = [l for l in switched["refusing_lines"] if l.startswith("  step generations FAILED -- ")]
    assert "every one of its 6 requests failed after retries: 6 bad_request (e.g. " in line, line
    assert "The partition keeps its 6 stored rows" in line and "failures.parquet" in line


def test_the_cli_summary_names_the_url_and_error_and_does_not_train(switched):
    cli = switched["cli"]
    assert switched["cli_rc"] == 1
    lines = cli.splitlines()
    status = [i for i, l in enumerate(lines) if l.startswith("partition B1_glaive: FAILED")]
    assert len(status) == 1, cli
    reason = lines[status[0] + 1]
    assert reason.startswith("  step generations FAILED -- server http://127.0.0.1:9 is not serving: "), cli
    assert "Cannot connect to host 127.0.0.1:9" in reason
    assert "training: not attempted: no partition passed" in cli
    # the records raw_prompts set aside, by reason, with the file naming each (B1's source plants 3 bad records)
    assert any(l.startswith("  raw_prompts: read ") and "; 3 set aside (" in l and "rejects.parquet" in l
               for l in lines), cli
    # QC did not run in this run: no QC line (the shards of the earlier runs are still on disk), and it says so
    assert not any(l.startswith("  qc_shards:") for l in lines), cli
    assert "  not run: qc_shards, length_report (a step before them failed)" in lines, cli
    assert "length report" not in cli.split("partition B1_glaive")[1] or "FAILED" in cli
    log = [l for l in lines if l.startswith("Dagster's output (every event of every run): ")]
    assert len(log) == 1 and "DEBUG" not in cli
    log_text = Path(log[0].split(": ", 1)[1]).read_text()
    assert "STEP_FAILURE" in log_text and "Cannot connect to host 127.0.0.1:9" in log_text


def test_back_on_a_live_server_the_new_rows_replace_the_old(switched):
    assert switched["back"].success
    rows = switched["after_back"].to_pylist()
    assert len(rows) == 6 and not switched["staging_left"]
    assert {json.loads(r["sampling_params"])["max_new_tokens"] for r in rows} == {200}
    assert all(len(r["output_ids"]) <= 200 for r in rows)


def _stage_with_rows(tmp_path: Path, fingerprint: dict):
    """A partition folder with one stored shard and a staging folder holding one staged shard of ``fingerprint``."""
    import pyarrow as pa

    from eagle_assets.generations.run import GENERATION_SCHEMA, staging_dir
    from eagle_assets.generations.staging import record_generation_inputs

    out = tmp_path / "gen"
    stage = staging_dir(out)
    stage.mkdir(parents=True)
    row = {"sample_id": "s0", "output_ids": [1, 2], "finish_reason": "stop", "matched_stop": 2,
           "completion_tokens": 2, "prompt_tokens": 3, "latency_s": 0.1, "attempts": 1, "sampling_params": "{}"}
    for folder in (out, stage):
        pq.write_table(pa.Table.from_pylist([row], schema=GENERATION_SCHEMA), folder / "shard-00000.parquet")
    record_generation_inputs(stage, fingerprint)
    return out, stage


def test_a_killed_regeneration_resumes_its_staged_rows_and_a_busy_one_is_not_cleared(tmp_path):
    from eagle_assets.generations.run import PartitionBusyError, exclusive_writer
    from eagle_assets.generations.staging import choose_workdir

    fingerprint = {"sha256": "new", "inputs": {"sampling_settings": "new"}}
    out, stage = _stage_with_rows(tmp_path, fingerprint)
    # same inputs as the staged attempt: its rows are resumed, nothing is cleared
    work = choose_workdir(out, fingerprint, True, False)
    assert (work.path, work.clear) == (stage, False)
    assert (stage / "shard-00000.parquet").exists() and "resuming its 1 staged rows" in work.note
    # an explicit regenerate starts the staging folder afresh, but never under another run's lock
    with exclusive_writer(stage):
        with pytest.raises(PartitionBusyError):
            choose_workdir(out, fingerprint, True, True)
    assert (stage / "shard-00000.parquet").exists()
    work = choose_workdir(out, fingerprint, True, True)
    assert (work.path, work.clear) == (stage, False)
    assert not (stage / "shard-00000.parquet").exists() and (out / "shard-00000.parquet").exists()
