"""Declarative automation: which asset partitions Dagster materializes on its own, and the sensor that evaluates it.

Every asset carries an ``AutomationCondition``; the ``automation_sensor`` (an ``AutomationConditionSensorDefinition``
over all assets, STOPPED by default) evaluates them on the daemon and requests runs. The condition is Dagster's
``eager()`` triggered by *data versions* (:func:`eager_on_data_versions`): an asset partition is requested when one
of its dependencies has a new data version (a new observation of an input in ``assets.inputs`` with a different
version, or an upstream materialization whose data version changed) and none of its dependencies is missing or in
progress. So an edited source file re-runs its partition from ``raw_prompts`` down, an edited sampling block
re-runs ``generations`` and ``qc_shards`` of that partition only, an edited chat template re-runs
``tokenized_prompts`` down in every partition, training follows once the partition runs are done, and re-running
a partition on unchanged inputs sets off nothing.

What replaced the hand-written sensors (see docs/scaling.md):

- ``source_files_sensor`` launched ``partition_job`` when a partition's files changed: now ``inputs_sensor`` reports
  the new ``source_files`` version and ``raw_prompts``' condition (and its children's) requests the runs. A replay
  of the same content is the same data version, so nothing runs twice.
- ``training_sensor`` launched ``training_job`` once every partition had fresh QC: now ``draft_vocab``,
  ``training_mix`` and ``drafter_checkpoint`` run after any partition's QC data changed (a change that happened,
  never one merely requested in the same tick), once no ``qc_shards`` partition is missing or in a run or
  backfill (``~any_deps_missing``, ``~any_deps_in_progress``), and never twice at once (``~in_progress``). A
  partition whose QC failed is left out by the assets themselves (``qc.status.passing_datasets``), as in
  ``training_job``.

``dataset_qc`` (datasets split into chunks) is ``eager`` over its ``qc_shards`` chunks: it is requested once every
chunk of its dataset is materialized and none is in a run, then again whenever a chunk's QC data changes.

``length_report`` drops the missing-dependency gate: the report covers whichever partitions have QC rows and says
which are missing, as ``partition_job`` refreshes it after every partition.
"""

from __future__ import annotations

import dagster as dg

from eagle_assets.assets.sensors import sensor_interval_s

AUTOMATION_SENSOR = "automation_sensor"


def any_deps_data_version_changed(wait_for: dg.AssetSelection | None = None) -> dg.AutomationCondition:
    """True when a dependency has a new data version since the previous tick (not only a new materialization), or
    will be requested this tick; a dependency updated by a run that also targeted this asset is ignored, as in
    ``any_deps_updated``. Dependencies in ``wait_for`` count only once they have changed, never by being requested
    in the same tick (see :func:`asset_conditions`)."""
    ac = dg.AutomationCondition
    changed = ac.any_deps_match(
        (ac.data_version_changed() & ~ac.executed_with_root_target()).with_label("data_version_changed_without_root"))
    requested = ac.any_deps_match(ac.will_be_requested())
    if wait_for is not None:
        requested = requested.ignore(wait_for)
    return (changed | requested).with_label("any_deps_data_version_changed")


def eager_on_data_versions(wait_for: dg.AssetSelection | None = None) -> dg.AutomationCondition:
    """``AutomationCondition.eager()`` with ``any_deps_updated`` replaced by :func:`any_deps_data_version_changed`.

    Plain ``eager()`` fires on every new upstream materialization (``newly_updated`` ignores data versions for
    materialized assets, ``dagster/_utils/caching_instance_queryer.py``), so re-running a partition on unchanged
    inputs would re-train the drafter; with data versions, only a materialization whose data version changed
    (its code version, its inputs, or for ``generations`` its shards' bytes) propagates."""
    return dg.AutomationCondition.eager().replace("any_deps_updated",
                                                  any_deps_data_version_changed(wait_for)).with_label(
        "eager_on_data_versions")


def asset_conditions() -> dict[str, dg.AutomationCondition]:
    """The automation condition of each materializable asset, by asset name."""
    eager = eager_on_data_versions()
    report = eager.without(~dg.AutomationCondition.any_deps_missing()).with_label("eager_without_missing_gate")
    # The unpartitioned assets after QC are never requested in the tick that requests the partitions: chained
    # into that backfill they would train once inside it, and then once more for the QC data versions the
    # backfill's partition runs wrote (those runs did not target them). Waiting for qc_shards to change, with no
    # qc_shards partition in a run or backfill (~any_deps_in_progress), trains once after all of them.
    after_qc = eager_on_data_versions(wait_for=dg.AssetSelection.assets("qc_shards"))
    partitioned = ("raw_prompts", "tokenized_prompts", "generations", "qc_shards")
    after = ("draft_vocab", "training_mix", "drafter_checkpoint", "evaluation", "speculators_export",
             "specforge_export")
    # dataset_qc (chunked datasets): requested when a chunk's QC data changed, once no chunk of the dataset is
    # missing or in a run (its qc_shards dependency maps every chunk to the dataset)
    return {**{name: eager for name in partitioned}, **{name: after_qc for name in after}, "length_report": report,
            "dataset_qc": eager}


def build_automation_sensor() -> dg.AutomationConditionSensorDefinition:
    """The sensor that evaluates every asset's condition (minimum interval 30 s, ``$EAGLE_ASSETS_SENSOR_INTERVAL_S``
    overrides). A tick requesting several partitions of one asset launches one backfill, which runs one partition
    per run (the assets' ``BackfillPolicy``)."""
    return dg.AutomationConditionSensorDefinition(
        AUTOMATION_SENSOR,
        target=dg.AssetSelection.all(),
        default_status=dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=sensor_interval_s(30),
        description="Materializes the asset partitions whose inputs or upstream data changed (declarative "
        "automation: eager() on every asset).",
    )


def unsynced(instance: dg.DagsterInstance, asset_graph) -> dict[tuple[str, str | None], list[str]]:
    """Every materializable asset partition Dagster's stale-status resolver (the one the UI's "Unsynced" badge
    uses) reports stale, with its causes ("<asset>[<partition>]: <reason> <dependency>").

    ``asset_graph``: ``Definitions.resolve_asset_graph()``. Missing partitions are not listed (never materialized
    is "missing", not "unsynced")."""
    from datetime import datetime, timezone

    from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus

    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=datetime.now(timezone.utc),
                                                           last_event_id=None),
                          instance=instance, asset_graph=asset_graph)
    resolver = CachingStaleStatusResolver(instance, asset_graph, view)
    out: dict[tuple[str, str | None], list[str]] = {}
    for key in sorted(asset_graph.materializable_asset_keys, key=lambda k: k.to_user_string()):
        node = asset_graph.get(key)
        for pk in node.partitions_def.get_partition_keys() if node.partitions_def is not None else [None]:
            if resolver.get_status(key, pk) == StaleStatus.STALE:
                out[(key.to_user_string(), pk)] = [_cause_text(c) for c in resolver.get_stale_causes(key, pk)]
    return out


def _cause_text(cause) -> str:
    dep = cause.dependency
    if dep is None:
        return cause.reason
    where = dep.asset_key.to_user_string() + (f"[{dep.partition_key}]" if dep.partition_key else "")
    return f"{cause.reason}: {where}"
