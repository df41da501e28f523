"""Which datasets passed QC, and where a dataset's QC rows and shards are: read from ``qc_status.json`` and the
files under ``<storage root>/<catalog>/qc_shards/<partition>/`` (no Dagster: the assets, the schedules, the CLI and
the exports ask here)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_assets.catalog import Catalog
from eagle_assets.qc.dataset_checks import dataset_checks
from eagle_assets.storage.shards import Layout, shard_paths

QC_STATUS_FILE = "qc_status.json"
ROWS_FILE = "rows.parquet"


def dataset_rows_files(layout: Layout, catalog: Catalog, dataset: str) -> list[Path]:
    """``rows.parquet`` of every partition of ``dataset`` (its chunks in order, or the dataset's one partition)."""
    return [Path(layout.base) / "qc_shards" / k / ROWS_FILE for k in catalog.dataset_partition_keys(dataset)]


def dataset_shard_paths(layout: Layout, catalog: Catalog, dataset: str) -> list[Path]:
    """The training shards of ``dataset``: every ``shard-NNNNN.parquet`` of each of its partitions, chunk by chunk.

    Raises:
        FileNotFoundError: a partition has no shards (the message names it and says to materialize it).
    """
    paths = []
    for key in catalog.dataset_partition_keys(dataset):
        found = shard_paths(layout.base / "qc_shards" / key)
        if not found:
            raise FileNotFoundError(f"no QC shards in {layout.base / 'qc_shards' / key}: materialize qc_shards for "
                                    f"partition {key} first")
        paths += found
    return paths


def passing_datasets(layout: Layout, catalog: Catalog) -> tuple[list[str], dict[str, str]]:
    """Datasets whose latest QC passed both blocking checks, and why each other dataset is excluded.

    A dataset that is not chunked passes by its one partition's ``qc_status.json``. A chunked dataset needs QC
    shards of every chunk (each QC'd as the chunk the catalog now names) and passes by the checks over all of its
    chunks' rows (``qc.dataset_checks``: the figures an unchunked run of the dataset would check, so it trains
    exactly when the unchunked dataset would); a single chunk's failed check does not exclude it by itself.
    """
    ok, excluded = [], {}
    for dataset in catalog.dataset_keys:
        why = _exclusion(layout, catalog, dataset)
        if why is None:
            ok.append(dataset)
        else:
            excluded[dataset] = why
    return ok, excluded


def _exclusion(layout: Layout, catalog: Catalog, dataset: str) -> str | None:
    """Why ``dataset`` is not trained on (None: it passed)."""
    spec = catalog.partitions[dataset]
    statuses, missing, stale = {}, [], []
    for key in catalog.dataset_partition_keys(dataset):
        status_file = Path(layout.base) / "qc_shards" / key / QC_STATUS_FILE
        if not status_file.exists():
            missing.append(key)
            continue
        statuses[key] = status = json.loads(status_file.read_text())
        if spec.chunks > 1 and status.get("chunk") != list(catalog.resolve(key)[1:]):
            stale.append(key)
    if missing:
        return (f"no QC shards yet for {missing}: materialize the partition first" if spec.chunks == 1
                else f"no QC shards yet for chunks {missing}: materialize them first")
    if stale:
        return (f"chunks {stale} were QC'd before the dataset was split into {spec.chunks} chunks: materialize them "
                "again")
    if spec.chunks == 1:
        levels = statuses[dataset]
        passed = levels.get("passed") and levels.get("kept", 0) > 0
    else:
        checks = dataset_checks(dataset_rows_files(layout, catalog, dataset), spec.thresholds)
        passed = checks.passed
        levels = {"token_structure": checks.token_structure.level, "response_length": checks.response_length.level}
    if passed:
        return None
    where = "" if spec.chunks == 1 else f" over its {spec.chunks} chunks (dataset_qc)"
    return (f"QC failed{where} (token_structure {levels.get('token_structure')}, response_length "
            f"{levels.get('response_length')}); see the check results")
