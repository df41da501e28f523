"""Dagster ``Definitions`` of eagle-assets: the asset graph, its checks, jobs and resources for one catalog.

The catalog (``$EAGLE_ASSETS_CATALOG``, default ``catalogs/default.yaml``) fixes the partitions: one per dataset, or
one per chunk of a dataset with ``chunks: N`` (``<dataset>.c00`` ..), all in one ``StaticPartitionsDefinition``.

Why chunks are partition keys of the one dimension, not a second dimension (``MultiPartitionsDefinition``): an asset
job holds one partitions definition, so ``partition_job`` could not take both the dataset-partitioned assets and
multi-partitioned ones (Dagster 1.13.27: ``DagsterInvalidDefinitionError: Failed to resolve asset job``); and a
multi-partition is the product of its dimensions, so every dataset would get the same chunk list, the small ones
as many empty chunks as the largest needs. With chunk keys, a dataset of ``chunks: 1`` keeps its key (existing
partitions, data versions and runs unchanged), each chunk is a run of ``partition_job`` like any partition (queued,
retried, resumed and sent to Kubernetes as one), and the dataset-level QC of chunked datasets is the asset
``dataset_qc`` of its own partitions, in ``dataset_job`` (``assets.qc``).
Every asset depends, besides its upstream assets, on the observable source assets of the inputs it reads
(``assets.inputs``), carries a code version (``lineage.versions``) and an automation condition
(``assets.automation``). ``$EAGLE_ASSETS_EXECUTOR`` picks the executor of every run (``in_process``, or ``k8s``:
one Kubernetes Job per step, ``eagle_assets.assets.k8s``).
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from eagle_assets.assets.automation import asset_conditions, build_automation_sensor
from eagle_assets.assets.comparison import build_comparison_assets
from eagle_assets.assets.evaluation import build_evaluation_assets
from eagle_assets.assets.exports import build_export_assets
from eagle_assets.assets.generation import build_generation_assets
from eagle_assets.assets.inputs import (
    PARTITION_INPUTS,
    TARGET_MODEL,
    TARGET_TOKENIZER,
    TRAINING_SETTINGS,
    build_input_assets,
    with_inputs_and_versions,
)
from eagle_assets.assets.k8s import build_executor
from eagle_assets.assets.prompts import build_prompt_assets
from eagle_assets.assets.qc import build_dataset_assets, build_qc_assets
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.schedules import build_schedules
from eagle_assets.assets.sensors import build_inputs_sensor
from eagle_assets.assets.server_resource import SGLangServerResource
from eagle_assets.assets.training import build_training_assets
from eagle_assets.catalog import CatalogError, default_catalog_path, load_catalog
from eagle_assets.storage.shards import default_storage_root

PARTITION_JOB = "partition_job"
TRAINING_JOB = "training_job"
DATASET_JOB = "dataset_job"  # only in Definitions of a catalog with a chunked dataset
EVALUATION_JOB = "evaluation_job"  # in every catalog's Definitions but one with evaluation: null or served features
PARTITION_ASSETS = ["raw_prompts", "tokenized_prompts", "generations", "qc_shards", "length_report"]
TRAINING_ASSETS = ["draft_vocab", "training_mix", "drafter_checkpoint"]
EVALUATION_ASSETS = ["evaluation"]
COMPARISON_ASSETS = ["drafter_comparison"]  # with training.compare: the drafters side by side
# Each run observes the inputs it reads first, so its materializations record current input data versions.
PARTITION_JOB_INPUTS = [*PARTITION_INPUTS, TARGET_TOKENIZER, TARGET_MODEL]
TRAINING_JOB_INPUTS = [TRAINING_SETTINGS, TARGET_MODEL]
# Generation is per partition (its own prompts, sampling and server load), and a failed partition must not fail the
# others: an asset backfill launches one run per partition (README "Backfills").
PARTITION_BACKFILL_POLICY = dg.BackfillPolicy.multi_run(max_partitions_per_run=1)


def build_definitions(
    catalog_path: str | Path | None = None,
    storage_root: str | Path | None = None,
    sglang: SGLangServerResource | None = None,
    executor: str | None = None,
) -> dg.Definitions:
    """Definitions for ``catalog_path`` writing under ``storage_root``.

    ``sglang`` overrides the server resource built from the catalog's ``server`` section (tests pass one that
    points at their own server). ``executor``: ``in_process`` or ``k8s``; default ``$EAGLE_ASSETS_EXECUTOR``, else
    ``in_process``. Raises ``CatalogError`` for an invalid catalog, ``ValueError`` for an unknown executor.
    """
    catalog_path = Path(catalog_path or default_catalog_path()).resolve()
    storage_root = Path(storage_root or default_storage_root()).resolve()
    catalog = load_catalog(catalog_path)
    partitions_def = dg.StaticPartitionsDefinition(list(catalog.partition_keys))
    assets = [
        *build_prompt_assets(partitions_def),
        *build_generation_assets(partitions_def),
        *build_qc_assets(partitions_def),
        *build_dataset_assets(catalog, partitions_def),
        *build_training_assets(full_asset_graph=lambda: defs.resolve_asset_graph()),
        *build_evaluation_assets(catalog),
        *build_comparison_assets(catalog, full_asset_graph=lambda: defs.resolve_asset_graph()),
        *build_export_assets(),
    ]
    conditions = asset_conditions()
    asset_defs = [
        with_inputs_and_versions(a, conditions)
        for a in assets if isinstance(a, dg.AssetsDefinition)
    ]
    asset_defs = [
        a.with_attributes(backfill_policy=PARTITION_BACKFILL_POLICY)
        if isinstance(a, dg.AssetsDefinition) and a.partitions_def is not None else a
        for a in [*build_input_assets(partitions_def), *asset_defs]
    ]
    checks = [a for a in assets if not isinstance(a, dg.AssetsDefinition)]
    executor_def = build_executor(catalog, executor)
    partition_job = dg.define_asset_job(
        PARTITION_JOB,
        selection=dg.AssetSelection.assets(*PARTITION_JOB_INPUTS, *PARTITION_ASSETS),
        executor_def=executor_def,
        description="One dataset partition from raw prompts to QC shards, then the refreshed length report.",
    )
    evaluated = catalog.evaluation is not None
    measured = ([*EVALUATION_ASSETS, *(COMPARISON_ASSETS if catalog.training.compare else [])]
                if evaluated else [])
    training_job = dg.define_asset_job(
        TRAINING_JOB,
        selection=dg.AssetSelection.assets(*TRAINING_JOB_INPUTS, *TRAINING_ASSETS, *measured),
        executor_def=executor_def,
        description="Draft vocab, training mix and drafter checkpoint from every partition whose QC passed"
                    + (", then its evaluation (held-out rows and the catalog's suites)" if evaluated else "")
                    + (" and the drafters of training.compare side by side." if len(measured) > 1 else "."),
    )
    jobs = [partition_job, training_job]
    if evaluated:
        jobs.append(dg.define_asset_job(
            EVALUATION_JOB,
            selection=dg.AssetSelection.assets(*measured),
            executor_def=executor_def,
            description="The trained drafter measured on its held-out rows and the evaluation suites (run their "
                        "eval-<suite> partitions with partition_job first).",
        ))
    if catalog.chunked_datasets:
        jobs.append(dg.define_asset_job(
            DATASET_JOB,
            selection=dg.AssetSelection.assets("dataset_qc"),
            executor_def=executor_def,
            description="A chunked dataset's QC checks over all its chunks (run once every chunk's partition_job "
                        "is done; the automation sensor does it then).",
        ))
    server = catalog.server
    if sglang is None:
        sglang = SGLangServerResource(
            urls=list(server.urls), launch=server.launch, api_key_env=server.api_key_env,
            extra_args=list(server.extra_args), device=server.device, python=server.python,
            max_reply_bytes=server.max_reply_bytes,
        )
    # The checkpoint's provenance walks this Definitions' whole graph (``assets.provenance``): the lambda above is
    # called at run time, after ``defs`` is bound.
    defs = dg.Definitions(
        assets=asset_defs,
        asset_checks=checks,
        jobs=jobs,
        executor=executor_def,
        sensors=[build_inputs_sensor(list(catalog.partition_keys)), build_automation_sensor()],
        schedules=build_schedules(),
        resources={
            "settings": PipelineSettings(catalog_path=str(catalog_path), storage_root=str(storage_root)),
            "target": TargetModel(model=str(catalog.target.model)),
            "sglang": sglang,
        },
    )
    return defs


# One Dagster instance per catalog: asset keys are the same in every catalog (``raw_prompts``, ``qc_shards``, ...), so
# two catalogs' runs in one instance would show each other's materializations, checks and paths under one key.
INSTANCE_CATALOG_FILE = "eagle_assets_catalog"


def claim_instance(catalog_path: str | Path) -> None:
    """Record ``catalog_path`` as the catalog of the instance in ``$DAGSTER_HOME`` (the file
    ``INSTANCE_CATALOG_FILE`` there), or refuse another catalog's. No-op when ``DAGSTER_HOME`` is unset.

    Raises:
        CatalogError: the instance already holds another catalog's runs (the message names both and the
            ``DAGSTER_HOME`` to use instead).
    """
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return
    catalog_path = str(Path(catalog_path).resolve())
    marker = Path(home) / INSTANCE_CATALOG_FILE
    recorded = marker.read_text().strip() if marker.is_file() else ""
    if not recorded:
        Path(home).mkdir(parents=True, exist_ok=True)
        marker.write_text(catalog_path + "\n")
    elif recorded != catalog_path:
        stem = Path(catalog_path).stem
        fix = (f"give this catalog another file name: catalogs are told apart by file name, and two named {stem}.yaml "
               f"also share the storage folder <storage root>/{stem}/" if Path(recorded).stem == stem else
               "run it with a DAGSTER_HOME of its own (with DAGSTER_HOME unset, eagle-assets run uses "
               f"<repo>/dagster_home/{stem}/ for any catalog but catalogs/default.yaml)")
        raise CatalogError(
            catalog_path, "(DAGSTER_HOME)",
            f"the Dagster instance in {home} holds the runs of another catalog, {recorded}; in one instance the two "
            "catalogs' assets would show each other's state under the same asset keys",
            f"{fix}; or, if {recorded} is this catalog moved or the repository cloned elsewhere, delete {marker}")


defs = build_definitions()
claim_instance(default_catalog_path())
