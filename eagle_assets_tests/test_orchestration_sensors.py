"""Sensors and the nightly schedule evaluated with Dagster's own test contexts on real files and a real instance."""

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle_assets.assets.resources import PipelineSettings
from eagle_assets.assets.schedules import NIGHTLY_SCHEDULE, nightly_training_schedule
from eagle_assets.assets.sensors import (
    SOURCE_DIGEST_TAG,
    SOURCE_SENSOR,
    TRAINING_SENSOR,
    source_files_sensor,
    training_sensor,
)
from eagle_assets.definitions import build_definitions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO_ROOT / "catalogs" / "demo_data"


def _catalog(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(DEMO_DATA / "B1_glaive.json", data / "B1_glaive.json")
    shutil.copy(DEMO_DATA / "B2_opencodeinstruct.jsonl", data / "B2_code.jsonl")
    catalog = {
        "target": {"model": "demo"},
        "partitions": {
            "B1_glaive": {"sources": [{"path": "data/B1_glaive.json", "format": "glaive"}],
                          "sampling": {"max_new_tokens": 64}, "limit": 4},
            "B2_code": {"sources": [{"path": "data/B2_code.jsonl", "format": "opencodeinstruct"}],
                        "sampling": {"max_new_tokens": 64}, "limit": 4},
        },
    }
    path = tmp_path / "sensed.yaml"
    path.write_text(yaml.safe_dump(catalog))
    return path


@pytest.fixture
def env(tmp_path):
    catalog = _catalog(tmp_path)
    settings = PipelineSettings(catalog_path=str(catalog), storage_root=str(tmp_path / "store"))
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        yield catalog, settings, instance


def _tick(instance, settings, cursor=None):
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"settings": settings})
    return source_files_sensor(ctx)


def _append_record(path: Path) -> None:
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record["input"] = record["input"] + " Also explain the complexity."
    path.write_text("\n".join([*lines, json.dumps(record)]) + "\n")


def test_definitions_register_sensors_and_a_stopped_schedule(env):
    catalog, _settings, _instance = env
    repo = build_definitions(catalog, storage_root=catalog.parent / "store").get_repository_def()
    sensors = {s.name: s for s in repo.sensor_defs}
    assert set(sensors) == {SOURCE_SENSOR, TRAINING_SENSOR}
    assert sensors[SOURCE_SENSOR].job_name == "partition_job"
    assert sensors[TRAINING_SENSOR].job_name == "training_job"
    schedule = repo.get_schedule_def(NIGHTLY_SCHEDULE)
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert all(s.default_status == dg.DefaultSensorStatus.STOPPED for s in sensors.values())
    # One run per partition in an asset backfill; the unpartitioned report and training assets have none.
    policies = {a.key.to_user_string(): a.backfill_policy for a in repo.asset_graph.assets_defs}
    assert policies["generations"] == dg.BackfillPolicy.multi_run(max_partitions_per_run=1)
    assert policies["length_report"] is None


def test_source_sensor_launches_new_and_changed_files_once(env):
    catalog, settings, instance = env
    first = _tick(instance, settings)
    requests = {r.partition_key: r for r in first.run_requests}
    assert set(requests) == {"B1_glaive", "B2_code"}
    b2 = requests["B2_code"]
    digest = b2.tags[SOURCE_DIGEST_TAG]
    assert len(digest) == 64 and digest[:24] in b2.run_key and "B2_code" in b2.run_key
    assert str(catalog.parent / "data" / "B2_code.jsonl") in b2.tags["eagle_assets/sources"]

    # Same content on the next tick: nothing to launch.
    again = _tick(instance, settings, first.cursor)
    assert again.run_requests in (None, []) and "no source changed" in again.skip_reason.skip_message

    # An edit relaunches only that partition, under a new run key.
    _append_record(catalog.parent / "data" / "B2_code.jsonl")
    edited = _tick(instance, settings, again.cursor)
    assert [r.partition_key for r in edited.run_requests] == ["B2_code"]
    assert edited.run_requests[0].run_key != b2.run_key

    # A lost cursor replays the same content under the same run keys (the daemon drops a used run key), and a
    # touch without a content change keeps the key.
    os.utime(catalog.parent / "data" / "B1_glaive.json", None)
    replay = _tick(instance, settings, None)
    keys = {r.partition_key: r.run_key for r in replay.run_requests}
    assert keys == {"B1_glaive": requests["B1_glaive"].run_key, "B2_code": edited.run_requests[0].run_key}


def test_source_sensor_records_partitions_materialized_after_their_files(env):
    _catalog_path, settings, instance = env
    instance.report_runless_asset_event(dg.AssetMaterialization("raw_prompts", partition="B1_glaive"))
    result = _tick(instance, settings)
    assert [r.partition_key for r in result.run_requests] == ["B2_code"]
    # The recorded partition is in the cursor, so a later edit of it is noticed.
    assert "B1_glaive" in json.loads(result.cursor)["partitions"]


def test_source_sensor_skips_a_missing_file_and_says_which(env):
    catalog, settings, instance = env
    (catalog.parent / "data" / "B1_glaive.json").unlink()
    result = _tick(instance, settings)
    assert [r.partition_key for r in result.run_requests] == ["B2_code"]
    (catalog.parent / "data" / "B2_code.jsonl").unlink()
    empty = _tick(instance, settings, result.cursor)
    assert "missing source" in empty.skip_reason.skip_message and "B1_glaive.json" in empty.skip_reason.skip_message


def _write_status(store: Path, key: str, passed: bool) -> Path:
    path = store / "sensed" / "qc_shards" / key / "qc_status.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"partition": key, "passed": passed, "kept": 3}))
    return path


def _train_tick(instance, settings):
    return training_sensor(dg.build_sensor_context(instance=instance, resources={"settings": settings}))


def test_training_sensor_waits_for_every_partition_then_for_newer_qc(env):
    _catalog_path, settings, instance = env
    store = Path(settings.storage_root)
    skip = _train_tick(instance, settings)
    assert isinstance(skip, dg.SkipReason) and "B1_glaive: no QC shards yet" in skip.skip_message

    _write_status(store, "B1_glaive", True)
    _write_status(store, "B2_code", False)
    skip = _train_tick(instance, settings)
    assert "B2_code: QC failed" in skip.skip_message and "B1_glaive" not in skip.skip_message

    _write_status(store, "B2_code", True)
    run = _train_tick(instance, settings)
    assert isinstance(run, dg.RunRequest) and run.run_key.startswith("train:")
    assert _train_tick(instance, settings).run_key == run.run_key  # same QC state, same key: no second launch

    # While that run is queued or training, fresh QC does not start a second one.
    inflight = dg.DagsterRun(job_name="training_job", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED)
    instance.add_run(inflight)
    busy = _train_tick(instance, settings)
    assert isinstance(busy, dg.SkipReason) and inflight.run_id in busy.skip_message
    instance.report_run_canceled(inflight)

    ckpt = store / "sensed" / "drafter_checkpoint" / "checkpoint" / "model.safetensors"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"\0")
    later = time.time() + 5
    os.utime(ckpt, (later, later))
    skip = _train_tick(instance, settings)
    assert "not newer than the last checkpoint" in skip.skip_message

    status = _write_status(store, "B1_glaive", True)
    os.utime(status, (later + 5, later + 5))
    skip = _train_tick(instance, settings)  # B2 is still older than the checkpoint
    assert "B2_code: QC shards not newer" in skip.skip_message and "B1_glaive" not in skip.skip_message
    status = _write_status(store, "B2_code", True)
    os.utime(status, (later + 6, later + 6))
    fresh = _train_tick(instance, settings)
    assert isinstance(fresh, dg.RunRequest) and fresh.run_key != run.run_key


def test_nightly_schedule_skips_without_passing_qc_and_trains_with_it(env):
    _catalog_path, settings, instance = env
    ctx = dg.build_schedule_context(instance=instance, resources={"settings": settings})
    skip = nightly_training_schedule(ctx)
    assert isinstance(skip, dg.SkipReason) and "no partition has passing QC" in skip.skip_message
    _write_status(Path(settings.storage_root), "B1_glaive", True)
    run = nightly_training_schedule(dg.build_schedule_context(instance=instance, resources={"settings": settings}))
    assert isinstance(run, dg.RunRequest) and run.tags["eagle_assets/partitions"] == "B1_glaive"
    running = dg.DagsterRun(job_name="training_job", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED)
    instance.add_run(running)
    busy = nightly_training_schedule(dg.build_schedule_context(instance=instance, resources={"settings": settings}))
    assert isinstance(busy, dg.SkipReason) and f"{running.run_id} is STARTED" in busy.skip_message


def test_sensors_skip_with_the_reason_on_a_broken_catalog_or_status_file(env):
    catalog, settings, instance = env
    _write_status(Path(settings.storage_root), "B1_glaive", True)
    (Path(settings.storage_root) / "sensed" / "qc_shards" / "B2_code").mkdir(parents=True)
    (Path(settings.storage_root) / "sensed" / "qc_shards" / "B2_code" / "qc_status.json").write_text("{")
    assert "B2_code: unreadable qc_status.json" in _train_tick(instance, settings).skip_message

    catalog.write_text("partitions: [not, a, mapping")
    later = time.time() + 10
    os.utime(catalog, (later, later))  # the settings resource re-reads the catalog when its mtime changes
    skip = _tick(instance, settings)
    assert isinstance(skip, dg.SkipReason) and "catalog cannot be read" in skip.skip_message
    assert "invalid YAML" in skip.skip_message
    assert "catalog cannot be read" in _train_tick(instance, settings).skip_message
