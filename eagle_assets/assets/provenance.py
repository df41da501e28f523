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

import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import dagster as dg

from eagle_assets.lineage.identity import catalog_identity, code_identity, package_versions

PROVENANCE_FILE = "provenance.json"
FORMAT = "eagle-assets/provenance"
FORMAT_VERSION = 1
# Run tags worth keeping: how the run was started. Others (user tags) may hold anything.
RUN_TAG_PREFIXES = ("dagster/partition", "dagster/backfill", "dagster/sensor_name", "dagster/schedule_name",
                    "dagster/automation", "dagster/from_automation_condition", "dagster/run_key",
                    "dagster/asset_evaluation_id", "eagle_assets/")
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
        "catalog": catalog_identity(settings.catalog(), Path(settings.catalog_path)),
        "inputs": input_versions(context.instance, asset_graph, context.asset_key),
        "run": run_identity(context.run),
    }


def write_provenance(context: dg.AssetExecutionContext, settings, directory: Path, asset_graph=None,
                     fallback_graph: Callable[[], Any] | None = None) -> Path:
    """Write :func:`build_provenance` to ``directory / provenance.json`` atomically; returns the path."""
    from eagle_assets.storage.shards import write_json_atomic

    doc = build_provenance(context, settings, asset_graph, fallback_graph)
    return write_json_atomic(doc, Path(directory) / PROVENANCE_FILE)
