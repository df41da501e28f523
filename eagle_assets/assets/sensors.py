"""The ``inputs_sensor``: observes the catalog entries, source files and target files between runs.

Every tick it computes the data version of each input of ``assets.inputs`` (``lineage.versions``: the sources of
every partition are re-hashed only when their size or mtime changed, the cursor caches the per-file sha256) and
reports a runless ``AssetObservation`` for each one whose version differs from the latest recorded one. It launches
nothing itself: the new data versions mark the dependent assets unsynced in the UI, and the ``automation_sensor``
(``assets.automation``) materializes them when it is on.

Why a sensor and not an automation condition on the source assets: a condition can only request an observation
*run* (a process start, an entry in the run list every interval, for a check that finds nothing most of the time);
a sensor evaluates in the code server and reports observations without any run. The decision of what to
materialize stays declarative.

A missing source file is logged and skipped (its partition keeps its last version), never a failed tick. A
partition in the catalog file that the loaded definitions do not have yet is reported in the skip reason: reload
the code location to add it. STOPPED by default; minimum interval 30 s, ``$EAGLE_ASSETS_SENSOR_INTERVAL_S``
overrides.
"""

from __future__ import annotations

import json
import os

import dagster as dg

from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.catalog import CatalogError

INPUTS_SENSOR = "inputs_sensor"
INTERVAL_ENV = "EAGLE_ASSETS_SENSOR_INTERVAL_S"


def sensor_interval_s(default: int) -> int:
    """Minimum seconds between ticks: ``$EAGLE_ASSETS_SENSOR_INTERVAL_S`` when set (>= 1), else ``default``."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return default
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(f"${INTERVAL_ENV}={raw!r} is not a whole number of seconds") from None


def _load_cursor(raw: str | None) -> dict:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return {}  # a hand-edited or foreign cursor only costs a re-hash
    return data if isinstance(data, dict) else {}


def latest_data_version(instance: dg.DagsterInstance, key: str, partition: str | None) -> str | None:
    """The data version of the latest observation of source asset ``key`` (``partition``), None if never observed."""
    from dagster._core.definitions.data_version import extract_data_version_from_entry

    record = instance.get_latest_data_version_record(dg.AssetKey(key), is_source=True, partition_key=partition)
    if record is None:
        return None
    version = extract_data_version_from_entry(record.event_log_entry)
    return version.value if version is not None else None


def build_inputs_sensor(partition_keys: list[str]) -> dg.SensorDefinition:
    """The ``inputs_sensor`` for definitions whose partitions are ``partition_keys``."""
    loaded = list(partition_keys)

    @dg.sensor(
        name=INPUTS_SENSOR,
        minimum_interval_seconds=sensor_interval_s(30),
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Observes source files, catalog entries and target files; reports a new data version for "
        "each input that changed (the automation_sensor then materializes what depends on it).",
    )
    def inputs_sensor(context: dg.SensorEvaluationContext, settings: dg.ResourceParam[PipelineSettings],
                      target: dg.ResourceParam[TargetModel]):
        from eagle_assets.assets.inputs import observation_event
        from eagle_assets.lineage.versions import global_input_versions, partition_input_versions

        try:
            catalog = settings.catalog()
        except (CatalogError, OSError) as exc:
            return dg.SkipReason(f"the catalog cannot be read, nothing observed: {exc}")
        cache = _load_cursor(context.cursor).get("files", {})
        cache = cache if isinstance(cache, dict) else {}
        files: dict = {}
        notes: list[str] = []
        versions = []
        for key in loaded:
            try:
                spec = catalog.partition(key)
            except CatalogError:
                notes.append(f"{key}: no longer in the catalog (reload the code location)")
                continue
            partition_versions, digest = partition_input_versions(spec, cache)
            files.update(digest.files)
            cache = {**cache, **digest.files}  # the chunks of a dataset share its files: hash them once per tick
            versions += partition_versions
        versions += global_input_versions(catalog)
        new_keys = [k for k in catalog.partition_keys if k not in loaded]
        if new_keys:
            notes.append(f"partitions {new_keys} are new in the catalog: reload the code location to add them")
        events = []
        for version in versions:
            if version.problem:
                notes.append(version.problem)
                context.log.warning(version.problem)
                continue
            if latest_data_version(context.instance, version.key, version.partition) != version.data_version:
                where = f"{version.key}[{version.partition}]" if version.partition else version.key
                context.log.info(f"{where}: new data version {version.data_version[:16]}")
                events.append(observation_event(version))
        cursor = json.dumps({"files": files}, sort_keys=True)
        if events:
            return dg.SensorResult(asset_events=events, cursor=cursor)
        reason = "no input changed" + (f" ({'; '.join(notes)})" if notes else "")
        return dg.SensorResult(skip_reason=dg.SkipReason(reason), cursor=cursor)

    return inputs_sensor
