"""The inputs sensor and the nightly schedule, evaluated with Dagster's own test contexts on real files and a real
instance; the definitions register them (and the automation sensor) STOPPED."""

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle_assets.assets.automation import AUTOMATION_SENSOR
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.schedules import NIGHTLY_SCHEDULE, nightly_training_schedule
from eagle_assets.assets.sensors import INPUTS_SENSOR, build_inputs_sensor, latest_data_version
from eagle_assets.definitions import build_definitions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO_ROOT / "catalogs" / "demo_data"
KEYS = ["B1_glaive", "B2_code"]


def _catalog_dict(tmp_path: Path) -> dict:
    return {
        "target": {"model": "demo"},
        "partitions": {
            "B1_glaive": {"sources": [{"path": "data/B1_glaive.json", "format": "glaive"}],
                          "sampling": {"max_new_tokens": 64}, "limit": 4},
            "B2_code": {"sources": [{"path": "data/B2_code.jsonl", "format": "opencodeinstruct"}],
                        "sampling": {"max_new_tokens": 64}, "limit": 4},
        },
    }


def _write_catalog(path: Path, catalog: dict) -> None:
    """Rewrite the catalog with an mtime later than before (the settings resource re-reads on an mtime change)."""
    before = path.stat().st_mtime_ns
    path.write_text(yaml.safe_dump(catalog))
    later = before + 1_000_000_000
    os.utime(path, ns=(later, later))


@pytest.fixture
def env(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(DEMO_DATA / "B1_glaive.json", data / "B1_glaive.json")
    shutil.copy(DEMO_DATA / "B2_opencodeinstruct.jsonl", data / "B2_code.jsonl")
    catalog = tmp_path / "sensed.yaml"
    catalog.write_text(yaml.safe_dump(_catalog_dict(tmp_path)))
    resources = {"settings": PipelineSettings(catalog_path=str(catalog), storage_root=str(tmp_path / "store")),
                 "target": TargetModel(model="demo")}
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        yield catalog, resources, instance


def _tick(instance, resources, cursor=None, keys=KEYS):
    """One evaluation of the inputs sensor; its observations are stored as the daemon stores them."""
    result = build_inputs_sensor(keys)(dg.build_sensor_context(instance=instance, cursor=cursor,
                                                                resources=resources))
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return result


def _observed(result) -> set[tuple[str, str | None]]:
    return {(e.asset_key.to_user_string(), e.partition) for e in result.asset_events}


def _append_record(path: Path) -> None:
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record["input"] = record["input"] + " Also explain the complexity."
    path.write_text("\n".join([*lines, json.dumps(record)]) + "\n")


def test_definitions_register_the_sensors_and_a_schedule_stopped(env):
    catalog, _resources, _instance = env
    repo = build_definitions(catalog, storage_root=catalog.parent / "store").get_repository_def()
    sensors = {s.name: s for s in repo.sensor_defs}
    assert set(sensors) == {INPUTS_SENSOR, AUTOMATION_SENSOR}
    assert isinstance(sensors[AUTOMATION_SENSOR], dg.AutomationConditionSensorDefinition)
    assert all(s.default_status == dg.DefaultSensorStatus.STOPPED for s in sensors.values())
    assert repo.get_schedule_def(NIGHTLY_SCHEDULE).default_status == dg.DefaultScheduleStatus.STOPPED
    # One run per partition in an asset backfill; the unpartitioned report and training assets have none.
    policies = {k.to_user_string(): a.backfill_policy for a in repo.asset_graph.assets_defs for k in a.keys}
    assert policies["generations"] == dg.BackfillPolicy.multi_run(max_partitions_per_run=1)
    assert policies["length_report"] is None


def test_first_tick_observes_every_input_then_only_what_changed(env):
    catalog, resources, instance = env
    first = _tick(instance, resources)
    per_partition = {(k, p) for k in ("source_files", "render_settings", "sampling_settings", "qc_settings")
                     for p in KEYS}
    assert _observed(first) == per_partition | {("target_tokenizer", None), ("target_model", None),
                                                ("training_settings", None)}
    # Same content on the next tick: nothing reported, even after a touch or with the cursor lost.
    again = _tick(instance, resources, first.cursor)
    assert not again.asset_events and "no input changed" in again.skip_reason.skip_message
    os.utime(catalog.parent / "data" / "B1_glaive.json", None)
    assert not _tick(instance, resources, None).asset_events

    # An edited source file: only that partition's source_files.
    before = latest_data_version(instance, "source_files", "B2_code")
    _append_record(catalog.parent / "data" / "B2_code.jsonl")
    edited = _tick(instance, resources, again.cursor)
    assert _observed(edited) == {("source_files", "B2_code")}
    assert latest_data_version(instance, "source_files", "B2_code") not in (None, before)

    # A sampling edit of one partition, then a training edit: only those inputs.
    spec = _catalog_dict(catalog.parent)
    spec["partitions"]["B1_glaive"]["sampling"]["temperature"] = 0.7
    _write_catalog(catalog, spec)
    assert _observed(_tick(instance, resources, edited.cursor)) == {("sampling_settings", "B1_glaive")}
    spec["training"] = {"epochs": 3}
    _write_catalog(catalog, spec)
    assert _observed(_tick(instance, resources, edited.cursor)) == {("training_settings", None)}
    # The observation carries what went into the version, for the UI's metadata panel.
    record = instance.get_latest_data_version_record(dg.AssetKey("sampling_settings"), is_source=True,
                                                     partition_key="B1_glaive")
    assert record.asset_observation.metadata["inputs"].value["sampling"]["temperature"] == 0.7


def test_a_missing_source_or_a_new_partition_is_reported_not_fatal(env):
    catalog, resources, instance = env
    (catalog.parent / "data" / "B1_glaive.json").unlink()
    result = _tick(instance, resources)
    assert ("source_files", "B1_glaive") not in _observed(result)
    assert ("source_files", "B2_code") in _observed(result) and ("sampling_settings", "B1_glaive") in _observed(result)
    spec = _catalog_dict(catalog.parent)
    spec["partitions"]["B3_new"] = dict(spec["partitions"]["B2_code"])
    _write_catalog(catalog, spec)
    skip = _tick(instance, resources, result.cursor)
    message = skip.skip_reason.skip_message
    assert "B1_glaive.json" in message and "missing" in message
    assert "['B3_new'] are new in the catalog: reload the code location" in message


def test_a_broken_catalog_skips_with_the_reason(env):
    catalog, resources, instance = env
    catalog.write_text("partitions: [not, a, mapping")
    later = time.time() + 10
    os.utime(catalog, (later, later))
    skip = _tick_raw(instance, resources)
    assert isinstance(skip, dg.SkipReason) and "catalog cannot be read" in skip.skip_message
    assert "invalid YAML" in skip.skip_message


def _tick_raw(instance, resources):
    return build_inputs_sensor(KEYS)(dg.build_sensor_context(instance=instance, resources=resources))


def _write_status(store: Path, key: str, passed: bool) -> Path:
    path = store / "sensed" / "qc_shards" / key / "qc_status.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"partition": key, "passed": passed, "kept": 3}))
    return path


def test_nightly_schedule_skips_without_passing_qc_and_trains_with_it(env):
    _catalog_path, resources, instance = env
    settings = resources["settings"]
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
