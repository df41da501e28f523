"""``provenance.json``: what a drafter checkpoint was made from, written into the checkpoint directory.

The checkpoint directory leaves Dagster (it is copied to a serving host), so the facts needed to reproduce or audit
it travel with it, in one JSON file beside ``config.json`` and ``model.safetensors`` (SGLang's EAGLE-3 loader reads
only those two and ignores other files):

``code``      eagle-assets version, git commit and whether the work tree had uncommitted changes (null outside a
              git checkout, e.g. an installed wheel in an image), and a sha256 over the package's source files,
              which identifies the code in both cases
``packages``  installed versions of torch, transformers, tokenizers, safetensors, numpy, pyarrow, dagster,
              dagster-k8s and eagle-assets (null when not installed), and the Python version
``catalog``   the catalog file's path and sha256 of its bytes, the sha256 of the catalog as loaded (``${VAR}``
              expanded, defaults filled), and its ``training`` block
``inputs``    every asset partition the checkpoint depends on, transitively (the source observations included):
              asset key, partition, data version, code version, the run that wrote it and when; ``direct`` marks
              the checkpoint's own dependencies
``run``       the Dagster run id, job name, partition and the run's trigger tags (sensor, backfill, automation),
              and the command line of the process that trained

Format: JSON object with those keys plus ``format`` ("eagle-assets/provenance") and ``format_version`` 1,
``created_at`` (UTC, ISO 8601). Environment variables and run config are never written (they can hold secrets).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
import sys
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg

PROVENANCE_FILE = "provenance.json"
FORMAT = "eagle-assets/provenance"
FORMAT_VERSION = 1
PACKAGES = ("eagle-assets", "torch", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow", "dagster",
            "dagster-k8s")
# Run tags worth keeping: how the run was started. Others (user tags) may hold anything.
RUN_TAG_PREFIXES = ("dagster/partition", "dagster/backfill", "dagster/sensor_name", "dagster/schedule_name",
                    "dagster/automation", "dagster/from_automation_condition", "dagster/run_key",
                    "dagster/asset_evaluation_id", "eagle_assets/")
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the eagle_assets package, not this assets/ folder


def package_versions() -> dict[str, str | None]:
    """Installed distribution versions of :data:`PACKAGES` (None when absent) and ``python``."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def source_sha256(package_dir: Path = PACKAGE_DIR) -> str:
    """sha256 hex over (relative path, bytes) of the package's ``.py`` and ``.jinja`` files, sorted by path."""
    h = hashlib.sha256()
    for path in sorted(p for p in package_dir.rglob("*") if p.suffix in (".py", ".jinja") and p.is_file()):
        h.update(str(path.relative_to(package_dir)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _git(repo: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def code_identity(package_dir: Path = PACKAGE_DIR) -> dict[str, Any]:
    """Version, git commit / dirty flag of the checkout holding ``package_dir`` (None when it is not one), source
    sha256."""
    repo = package_dir.parent
    commit = dirty = None
    if (repo / ".git").exists():
        commit = _git(repo, "rev-parse", "HEAD")
        status = _git(repo, "status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status)
    try:
        version = importlib.metadata.version("eagle-assets")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"version": version, "git_commit": commit, "git_dirty": dirty, "source_sha256": source_sha256(package_dir)}


def catalog_identity(settings) -> dict[str, Any]:
    """Path and sha256 of the catalog file, sha256 of the loaded catalog, and its training block."""
    from eagle_assets.assets.versions import canonical_digest, file_sha256

    catalog = settings.catalog()
    path = Path(settings.catalog_path)
    return {"path": str(path), "file_sha256": file_sha256(path),
            "loaded_sha256": canonical_digest(catalog.model_dump(mode="json")),
            "training": catalog.training.model_dump(mode="json")}


def _record_entry(record, key: dg.AssetKey, partition: str | None, direct: bool) -> dict[str, Any]:
    from dagster._core.definitions.data_version import CODE_VERSION_TAG, DATA_VERSION_TAG

    entry: dict[str, Any] = {"asset": key.to_user_string(), "partition": partition, "direct": direct}
    if record is None:
        entry.update(data_version=None, code_version=None, run_id=None, recorded_at=None, kind="never recorded")
        return entry
    event = record.asset_materialization or record.asset_observation
    tags = (event.tags if event is not None else None) or {}
    entry.update(
        data_version=tags.get(DATA_VERSION_TAG),
        code_version=tags.get(CODE_VERSION_TAG),
        run_id=record.run_id or None,
        recorded_at=datetime.fromtimestamp(record.timestamp, timezone.utc).isoformat(),
        kind="materialization" if record.asset_materialization is not None else "observation",
    )
    return entry


def input_versions(instance: dg.DagsterInstance, asset_graph, key: dg.AssetKey) -> list[dict[str, Any]]:
    """The latest data version record of every asset partition upstream of ``key`` (transitively), sorted by
    asset then partition. Partitioned assets list each partition of their partitions definition."""
    direct = set(asset_graph.get(key).parent_keys)
    seen: set[dg.AssetKey] = set()
    todo = list(direct)
    while todo:
        k = todo.pop()
        if k in seen:
            continue
        seen.add(k)
        todo.extend(asset_graph.get(k).parent_keys)
    entries = []
    for k in sorted(seen, key=lambda a: a.to_user_string()):
        node = asset_graph.get(k)
        partitions = node.partitions_def.get_partition_keys() if node.partitions_def is not None else [None]
        for pk in partitions:
            record = instance.get_latest_data_version_record(k, is_source=bool(node.is_observable),
                                                             partition_key=pk)
            entries.append(_record_entry(record, k, pk, k in direct))
    return entries


def run_identity(run: dg.DagsterRun) -> dict[str, Any]:
    """Run id, job, partition, trigger tags and the command line of this process."""
    tags = {k: v for k, v in run.tags.items() if k.startswith(RUN_TAG_PREFIXES)}
    return {"run_id": run.run_id, "job_name": run.job_name, "partition": run.tags.get("dagster/partition"),
            "tags": tags, "command": [sys.executable, *sys.argv]}


def full_asset_graph(context: dg.AssetExecutionContext, fallback: Callable[[], Any] | None = None):
    """The whole asset graph of the run's code location: the repository's when the run has one (every launched run
    does), else ``fallback()`` (``execute_in_process`` has no repository, and a job's own asset layer holds only its
    assets' neighbourhood, not every ancestor: ``definitions.build_definitions`` passes its own Definitions' graph),
    else that neighbourhood."""
    from dagster._check import CheckError

    try:
        return context.repository_def.asset_graph
    except CheckError:  # "No repository definition was set on the step context"
        pass
    if fallback is not None:
        return fallback()
    return context.job_def.asset_layer.asset_graph


def build_provenance(context: dg.AssetExecutionContext, settings, asset_graph=None,
                     fallback_graph: Callable[[], Any] | None = None) -> dict[str, Any]:
    """The provenance document of the asset ``context`` materializes (see the module docstring); ``asset_graph``
    defaults to :func:`full_asset_graph` (with ``fallback_graph``)."""
    asset_graph = asset_graph if asset_graph is not None else full_asset_graph(context, fallback_graph)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "asset": context.asset_key.to_user_string(),
        "code": code_identity(),
        "packages": package_versions(),
        "catalog": catalog_identity(settings),
        "inputs": input_versions(context.instance, asset_graph, context.asset_key),
        "run": run_identity(context.run),
    }


def write_provenance(context: dg.AssetExecutionContext, settings, directory: Path, asset_graph=None,
                     fallback_graph: Callable[[], Any] | None = None) -> Path:
    """Write :func:`build_provenance` to ``directory / provenance.json`` atomically; returns the path."""
    from eagle_assets.storage.shards import write_json_atomic

    doc = build_provenance(context, settings, asset_graph, fallback_graph)
    return write_json_atomic(doc, Path(directory) / PROVENANCE_FILE)
