"""Dagster ``Definitions`` of eagle-assets: the asset graph, its checks, jobs and resources for one catalog.

The catalog (``$EAGLE_ASSETS_CATALOG``, default ``catalogs/default.yaml``) fixes the partitions: one per dataset.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from eagle_assets.assets.generation import build_generation_assets
from eagle_assets.assets.prompts import build_prompt_assets
from eagle_assets.assets.qc import build_qc_assets
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.schedules import build_schedules
from eagle_assets.assets.sensors import build_sensors
from eagle_assets.assets.training import build_training_assets
from eagle_assets.catalog import default_catalog_path, load_catalog
from eagle_assets.serving.resource import SGLangServerResource
from eagle_assets.storage import default_storage_root

PARTITION_JOB = "partition_job"
TRAINING_JOB = "training_job"
PARTITION_ASSETS = ["raw_prompts", "tokenized_prompts", "generations", "qc_shards", "length_report"]
TRAINING_ASSETS = ["draft_vocab", "training_mix", "drafter_checkpoint"]
# Generation is per partition (its own prompts, sampling and server load), and a failed partition must not fail the
# others: an asset backfill launches one run per partition (README "Backfills").
PARTITION_BACKFILL_POLICY = dg.BackfillPolicy.multi_run(max_partitions_per_run=1)


def build_definitions(
    catalog_path: str | Path | None = None,
    storage_root: str | Path | None = None,
    sglang: SGLangServerResource | None = None,
) -> dg.Definitions:
    """Definitions for ``catalog_path`` writing under ``storage_root``.

    ``sglang`` overrides the server resource built from the catalog's ``server`` section (tests pass one that
    points at their own server). Raises ``CatalogError`` for an invalid catalog.
    """
    catalog_path = Path(catalog_path or default_catalog_path()).resolve()
    storage_root = Path(storage_root or default_storage_root()).resolve()
    catalog = load_catalog(catalog_path)
    partitions_def = dg.StaticPartitionsDefinition(list(catalog.partition_keys))
    assets = [
        *build_prompt_assets(partitions_def),
        *build_generation_assets(partitions_def),
        *build_qc_assets(partitions_def),
        *build_training_assets(),
    ]
    asset_defs = [
        a.with_attributes(backfill_policy=PARTITION_BACKFILL_POLICY) if a.partitions_def is not None else a
        for a in assets if isinstance(a, dg.AssetsDefinition)
    ]
    checks = [a for a in assets if not isinstance(a, dg.AssetsDefinition)]
    partition_job = dg.define_asset_job(
        PARTITION_JOB,
        selection=dg.AssetSelection.assets(*PARTITION_ASSETS),
        executor_def=dg.in_process_executor,
        description="One dataset partition from raw prompts to QC shards, then the refreshed length report.",
    )
    training_job = dg.define_asset_job(
        TRAINING_JOB,
        selection=dg.AssetSelection.assets(*TRAINING_ASSETS),
        executor_def=dg.in_process_executor,
        description="Draft vocab, training mix and EAGLE-3 drafter checkpoint from every partition whose QC passed.",
    )
    server = catalog.server
    if sglang is None:
        sglang = SGLangServerResource(
            urls=list(server.urls), launch=server.launch, api_key_env=server.api_key_env,
            extra_args=list(server.extra_args),
        )
    return dg.Definitions(
        assets=asset_defs,
        asset_checks=checks,
        jobs=[partition_job, training_job],
        sensors=build_sensors(),
        schedules=build_schedules(),
        resources={
            "settings": PipelineSettings(catalog_path=str(catalog_path), storage_root=str(storage_root)),
            "target": TargetModel(model=str(catalog.target.model)),
            "sglang": sglang,
        },
    )


defs = build_definitions()
