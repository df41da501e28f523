"""Sensors: a changed source file relaunches its partition; fresh QC shards of every partition relaunch training.

``source_files_sensor`` (targets ``partition_job``)
    Hashes every partition's source files (sha256 of the bytes, in catalog order, with the resolved path and the
    format). A partition whose digest differs from the one in the cursor gets a ``RunRequest`` with
    ``run_key = "<catalog>:<partition>:<digest[:24]>"``. Dagster launches one run per run key per sensor, ever, so an
    edit (new digest) relaunches the partition and a replay of the same content (lost cursor, ``touch``, a copy of
    the same bytes) does not. On first sight of a partition (no cursor entry), a partition whose latest
    ``raw_prompts`` materialization is newer than every one of its source files is taken as up to date and only
    recorded, so turning the sensor on after ``eagle-assets run`` does not regenerate everything.
    Files are re-hashed only when their size or mtime changes (the cursor caches the per-file hashes).

``training_sensor`` (targets ``training_job``)
    Launches training once every partition of the catalog has a ``qc_shards/<partition>/qc_status.json`` with
    ``passed: true`` that is newer than the last checkpoint (``drafter_checkpoint/checkpoint/model.safetensors``),
    and no ``training_job`` run is queued or running. The run key is a hash of those status files' mtimes, so a
    failed training run is not retried in a loop: it is retried when a partition's QC is rewritten.

Both default to STOPPED: turn them on in the UI (Automation) or with ``dagster sensor start``. The minimum interval
between ticks is 30 s (source files) and 60 s (training); ``$EAGLE_ASSETS_SENSOR_INTERVAL_S`` overrides both.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg

from eagle_assets.assets.qc import QC_STATUS_FILE
from eagle_assets.assets.resources import PipelineSettings
from eagle_assets.catalog import CatalogError, PartitionSpec

SOURCE_SENSOR = "source_files_sensor"
TRAINING_SENSOR = "training_sensor"
SOURCE_DIGEST_TAG = "eagle_assets/source_sha256"
SOURCES_TAG = "eagle_assets/sources"
TRIGGER_TAG = "eagle_assets/trigger"
INTERVAL_ENV = "EAGLE_ASSETS_SENSOR_INTERVAL_S"
CHECKPOINT_FILE = Path("drafter_checkpoint") / "checkpoint" / "model.safetensors"
_CHUNK = 1 << 20


def sensor_interval_s(default: int) -> int:
    """Minimum seconds between ticks: ``$EAGLE_ASSETS_SENSOR_INTERVAL_S`` when set (>= 1), else ``default``."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return default
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(f"${INTERVAL_ENV}={raw!r} is not a whole number of seconds") from None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class SourceDigest:
    """Content digest of one partition's sources.

    ``digest``: sha256 hex over (resolved path, format, file sha256) of every source in catalog order; None when a
    source is missing. ``files``: per-file cache entries ``{path: [size, mtime_ns, sha256]}`` for the cursor.
    ``newest_mtime``: newest source mtime in seconds (epoch). ``missing``: sources that do not exist.
    """

    digest: str | None
    sources: list[str]
    files: dict[str, list] = field(default_factory=dict)
    newest_mtime: float = 0.0
    missing: list[str] = field(default_factory=list)


def partition_source_digest(spec: PartitionSpec, cache: dict[str, list] | None = None) -> SourceDigest:
    """Hash a partition's resolved source files; files whose (size, mtime_ns) match ``cache`` are not re-read.

    Never raises for a missing or unreadable file: it is listed in ``missing`` and ``digest`` is None.
    """
    cache = cache or {}
    resolved = spec.resolved_sources(check_exists=False)
    outer = hashlib.sha256()
    files: dict[str, list] = {}
    missing: list[str] = []
    newest = 0.0
    for path, fmt in resolved:
        key = str(path)
        try:
            st = path.stat()
            if not path.is_file():
                raise IsADirectoryError(f"{key} is not a file")
            hit = cache.get(key)
            if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
                sha = hit[2]
            else:
                sha = _file_sha256(path)
        except OSError:  # absent, unreadable or not a file: reported, never a failed tick
            missing.append(key)
            continue
        files[key] = [st.st_size, st.st_mtime_ns, sha]
        newest = max(newest, st.st_mtime)
        outer.update(f"{key}\0{fmt}\0{sha}\n".encode())
    return SourceDigest(
        digest=None if missing else outer.hexdigest(),
        sources=[str(p) for p, _ in resolved],
        files=files,
        newest_mtime=newest,
        missing=missing,
    )


def source_run_key(catalog_name: str, partition: str, digest: str) -> str:
    """Run key of a source-triggered partition run: the catalog, the partition and the content digest."""
    return f"{catalog_name}:{partition}:{digest[:24]}"


def _latest_materialization_ts(instance: dg.DagsterInstance, asset: str, partition: str) -> float | None:
    result = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    )
    return result.records[0].timestamp if result.records else None


def _load_cursor(raw: str | None) -> dict:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return {}  # a hand-edited or foreign cursor only costs a re-hash; run keys still prevent relaunches
    return data if isinstance(data, dict) else {}


@dg.sensor(
    name=SOURCE_SENSOR,
    job_name="partition_job",
    minimum_interval_seconds=sensor_interval_s(30),
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Launches partition_job for a partition whose source files appeared or changed "
    "(run key = catalog:partition:content sha256, so the same content never launches twice).",
)
def source_files_sensor(context: dg.SensorEvaluationContext, settings: PipelineSettings):
    """One RunRequest per partition whose sources' content digest changed since the last tick."""
    try:
        catalog = settings.catalog()
    except (CatalogError, OSError) as exc:
        return dg.SkipReason(f"the catalog cannot be read, nothing launched: {exc}")
    catalog_name = settings.layout().catalog_name
    cursor = _load_cursor(context.cursor)
    seen: dict = cursor.get("partitions", {}) if isinstance(cursor.get("partitions"), dict) else {}
    new_seen: dict = {}
    requests: list[dg.RunRequest] = []
    notes: list[str] = []
    for key, spec in catalog.partitions.items():
        prev = seen.get(key) if isinstance(seen.get(key), dict) else {}
        digest = partition_source_digest(spec, prev.get("files"))
        if digest.digest is None:
            notes.append(f"{key}: missing source(s) {digest.missing}")
            context.log.warning(f"partition {key}: source file(s) missing, not launched: {digest.missing}")
            if prev:
                new_seen[key] = prev
            continue
        new_seen[key] = {"digest": digest.digest, "files": digest.files}
        if prev.get("digest") == digest.digest:
            continue
        if not prev:
            done_at = _latest_materialization_ts(context.instance, "raw_prompts", key)
            if done_at is not None and done_at >= digest.newest_mtime:
                notes.append(f"{key}: already materialized from these files")
                context.log.info(f"partition {key}: raw_prompts is newer than its sources {digest.sources}; recorded")
                continue
        run_key = source_run_key(catalog_name, key, digest.digest)
        context.log.info(f"partition {key}: sources {digest.sources} -> sha256 {digest.digest[:24]}; run key {run_key}")
        requests.append(
            dg.RunRequest(
                run_key=run_key,
                partition_key=key,
                tags={
                    SOURCE_DIGEST_TAG: digest.digest,
                    SOURCES_TAG: ",".join(digest.sources)[:1000],
                    TRIGGER_TAG: "source_change",
                },
            )
        )
    new_cursor = json.dumps({"partitions": new_seen}, sort_keys=True)
    if requests:
        return dg.SensorResult(run_requests=requests, cursor=new_cursor)
    reason = "no source changed" + (f" ({'; '.join(notes)})" if notes else "")
    return dg.SensorResult(skip_reason=dg.SkipReason(reason), cursor=new_cursor)


@dataclass
class TrainingReadiness:
    """Whether training should run: ``ready`` and, per partition, why not (``blocked``)."""

    ready: bool
    blocked: dict[str, str]
    qc_mtimes: dict[str, int]  # partition -> qc_status.json mtime_ns
    checkpoint_mtime_ns: int | None

    @property
    def run_key(self) -> str:
        body = json.dumps(sorted(self.qc_mtimes.items()))
        return "train:" + hashlib.sha256(body.encode()).hexdigest()[:24]


def training_readiness(settings: PipelineSettings) -> TrainingReadiness:
    """Read every partition's ``qc_status.json`` and the checkpoint's mtime from the storage layout.

    A partition blocks training when its status file is missing, unreadable, not ``passed``, or not newer than the
    checkpoint. Never raises for bad files (they block, with the reason).
    """
    layout = settings.layout()
    ckpt = layout.base / CHECKPOINT_FILE
    ckpt_mtime = ckpt.stat().st_mtime_ns if ckpt.exists() else None
    blocked: dict[str, str] = {}
    mtimes: dict[str, int] = {}
    for key in settings.catalog().partition_keys:
        status_file = layout.base / "qc_shards" / key / QC_STATUS_FILE
        if not status_file.is_file():
            blocked[key] = "no QC shards yet"
            continue
        try:
            status = json.loads(status_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            blocked[key] = f"unreadable {QC_STATUS_FILE}: {exc}"
            continue
        if not (isinstance(status, dict) and status.get("passed")):
            blocked[key] = "QC failed; see the qc_shards check results"
            continue
        mtime = status_file.stat().st_mtime_ns
        mtimes[key] = mtime
        if ckpt_mtime is not None and mtime <= ckpt_mtime:
            blocked[key] = "QC shards not newer than the last checkpoint"
    return TrainingReadiness(ready=not blocked, blocked=blocked, qc_mtimes=mtimes, checkpoint_mtime_ns=ckpt_mtime)


IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def training_run_in_flight(instance: dg.DagsterInstance) -> dg.DagsterRun | None:
    """A ``training_job`` run that is queued or running, if any (one training at a time writes the checkpoint)."""
    runs = instance.get_runs(dg.RunsFilter(job_name="training_job", statuses=IN_FLIGHT), limit=1)
    return runs[0] if runs else None


@dg.sensor(
    name=TRAINING_SENSOR,
    job_name="training_job",
    minimum_interval_seconds=sensor_interval_s(60),
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Launches training_job once every partition's QC passed and is newer than the last checkpoint.",
)
def training_sensor(context: dg.SensorEvaluationContext, settings: PipelineSettings):
    """A RunRequest for training_job when :func:`training_readiness` says ready, else a SkipReason naming why."""
    try:
        state = training_readiness(settings)
    except (CatalogError, OSError) as exc:
        return dg.SkipReason(f"the catalog cannot be read, nothing launched: {exc}")
    if not state.ready:
        why = "; ".join(f"{k}: {v}" for k, v in state.blocked.items())
        return dg.SkipReason(f"training waits for fresh passing QC of every partition ({why})")
    running = training_run_in_flight(context.instance)
    if running is not None:
        # QC that lands while a run trains is compared with that run's checkpoint once it is written.
        return dg.SkipReason(f"training run {running.run_id} is {running.status.value}; waiting for it to finish")
    context.log.info(f"QC of {sorted(state.qc_mtimes)} is newer than the last checkpoint: launching training")
    return dg.RunRequest(run_key=state.run_key, tags={TRIGGER_TAG: "fresh_qc"})


def build_sensors() -> list[dg.SensorDefinition]:
    """The sensors of a catalog's Definitions (they read the catalog through the ``settings`` resource)."""
    return [source_files_sensor, training_sensor]
