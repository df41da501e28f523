"""A chunked dataset's ``raw_prompts`` as one run over its chunk keys.

Every chunk of a dataset (``chunks: N``) is a partition, and a run of one partition costs Dagster its own run and
step bookkeeping: about 0.1 s of event writes per ``raw_prompts`` step on sqlite, more on Postgres. The dataset's
sources are parsed once whichever way its chunks run (``raw_prompts.dataset_parse``), but at 16 chunks those
steps' bookkeeping alone is a fifth of the parse. :func:`run_raw_prompts_over_chunks` writes all of a dataset's
chunks in one step of one run; each chunk's run of the rest of ``partition_job`` then starts from its rows.
``eagle-assets run`` does this for every chunked dataset it runs whole.

Dagster gives every partition of a ranged run's output the same data version (dagster-io/dagster#18649), and the
automation here fires on per-partition data versions (``assets.automation``: a source edit that adds rows to one
chunk must re-run that chunk only). So ``raw_prompts`` reports each chunk's materialization itself, with the tags
Dagster writes on a run of that one key (:func:`materialization_tags`).
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from eagle_assets.assets.inputs import GLOBAL_INPUTS, PARTITION_INPUTS, observation_event
from eagle_assets.catalog import Catalog
from eagle_assets.lineage.versions import source_files_version

RAW_PROMPTS = dg.AssetKey("raw_prompts")
OBSERVED_INPUTS = frozenset((*PARTITION_INPUTS, *GLOBAL_INPUTS))  # observable source assets: observations only


def materialization_tags(context: dg.AssetExecutionContext, asset_key: dg.AssetKey, partition: str,
                         data_version: str) -> dict[str, str]:
    """The data-version tags of ``asset_key``'s materialization of ``partition``, as Dagster writes them for the
    output of a run of that one key (``_build_data_version_tags`` in ``dagster/_core/execution/plan/execute_step.py``):
    the asset's code version, each dependency's data version and the storage id of the event that set it (its
    latest materialization or observation of ``partition``, else its latest one), and ``data_version`` (sha256
    hex), user-provided. Where the dependency has no event yet, Dagster's ``INITIAL`` version and ``NULL``."""
    from dagster._core.definitions.data_version import (
        CODE_VERSION_TAG,
        DATA_VERSION_IS_USER_PROVIDED_TAG,
        DATA_VERSION_TAG,
        DEFAULT_DATA_VERSION,
        NULL_EVENT_POINTER,
        extract_data_version_from_entry,
        get_input_data_version_tag,
        get_input_event_pointer_tag,
    )

    node = context.job_def.asset_layer.get(asset_key)
    tags = {CODE_VERSION_TAG: node.code_version or context.run_id}
    for dep in sorted(node.parent_keys, key=lambda k: k.to_user_string()):
        # the dependency's own event for this partition; none: it is unpartitioned (or not yet observed there),
        # and its latest event is the one. A run that selects only this asset sees its dependencies as external
        # assets without their partitions or kind, so which are observed comes from assets.inputs.
        is_source = True if dep.to_user_string() in OBSERVED_INPUTS else None
        record = (context.instance.get_latest_data_version_record(dep, is_source=is_source, partition_key=partition)
                  or context.instance.get_latest_data_version_record(dep, is_source=is_source))
        version = (extract_data_version_from_entry(record.event_log_entry) if record is not None else None)
        tags[get_input_data_version_tag(dep)] = (version or DEFAULT_DATA_VERSION).value
        tags[get_input_event_pointer_tag(dep)] = str(record.storage_id) if record is not None else NULL_EVENT_POINTER
    tags[DATA_VERSION_TAG] = data_version
    tags[DATA_VERSION_IS_USER_PROVIDED_TAG] = "true"
    return tags


def run_raw_prompts_over_chunks(job: dg.JobDefinition, instance: dg.DagsterInstance, catalog: Catalog,
                                keys: Sequence[str]) -> dg.ExecuteInProcessResult:
    """``raw_prompts`` of the partitions ``keys`` (a dataset's chunk keys, consecutive in the catalog's order) as one
    in-process run of ``job`` (``partition_job``) over the key range: one step parses the dataset's sources once and
    writes every chunk, one materialization per chunk. Each chunk's ``source_files`` version is observed first
    (a runless observation, as the ``inputs_sensor`` reports them), so the materializations record current inputs,
    as a run of one chunk does by observing its inputs at its start.

    Returns the run's result (``success`` False when a chunk failed: a source that cannot be read fails them all,
    and the message names it). Raises ``ValueError`` when ``keys`` is empty or not a consecutive run of the job's
    partition keys (a range covers every key between its ends)."""
    keys = list(keys)
    order = job.partitions_def.get_partition_keys()
    first = order.index(keys[0]) if keys and keys[0] in order else -1
    if first < 0 or order[first:first + len(keys)] != keys:
        raise ValueError(f"{keys} is not a consecutive range of the partition keys {order}; run each key on its own")
    cache: dict[str, list] = {}  # one sha256 per source file, shared by the chunks of its dataset
    for key in keys:
        version, digest = source_files_version(catalog.partition(key), cache)
        cache.update(digest.files)
        if version.problem:  # the chunk's run reports it (raw_prompts raises the FormatError naming the file)
            continue
        instance.report_runless_asset_event(observation_event(version))
    # execute_in_process takes one partition key; a range is given as the tags a ranged backfill run carries
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    return job.execute_in_process(
        instance=instance, raise_on_error=False, asset_selection=[RAW_PROMPTS],
        tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]})
