"""The optional nightly re-training schedule (STOPPED by default; turn it on in the UI or with
``dagster schedule start nightly_training_schedule``).

It stays beside the declarative automation (``assets.automation``) for deployments that keep the automation sensor
off and train in a fixed window (shared GPUs that are free at night), from whatever QC passed by then: the time of
day, not a data change, decides. With the automation sensor on it is not needed.
"""

from __future__ import annotations

import dagster as dg

from eagle_assets.assets.resources import PipelineSettings
from eagle_assets.catalog import CatalogError
from eagle_assets.qc.status import passing_datasets

NIGHTLY_SCHEDULE = "nightly_training_schedule"
NIGHTLY_CRON = "0 3 * * *"
TRIGGER_TAG = "eagle_assets/trigger"
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def training_run_in_flight(instance: dg.DagsterInstance) -> dg.DagsterRun | None:
    """A ``training_job`` run that is queued or running, if any (one training at a time writes the checkpoint)."""
    runs = instance.get_runs(dg.RunsFilter(job_name="training_job", statuses=IN_FLIGHT), limit=1)
    return runs[0] if runs else None


@dg.schedule(
    name=NIGHTLY_SCHEDULE,
    cron_schedule=NIGHTLY_CRON,
    execution_timezone="UTC",
    job_name="training_job",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Re-trains the drafter at 03:00 UTC from every partition whose latest QC passed.",
)
def nightly_training_schedule(context: dg.ScheduleEvaluationContext,
                              settings: dg.ResourceParam[PipelineSettings]):
    """A training run every night, skipped (with the reason) while no partition has passing QC shards or while a
    training run is still queued or running."""
    try:
        keys, excluded = passing_datasets(settings.layout(), settings.catalog())
    except (CatalogError, OSError) as exc:
        return dg.SkipReason(f"the catalog cannot be read, nothing launched: {exc}")
    if not keys:
        return dg.SkipReason(f"no partition has passing QC shards yet: {excluded}")
    running = training_run_in_flight(context.instance)
    if running is not None:
        return dg.SkipReason(f"training run {running.run_id} is {running.status.value}; not starting another")
    return dg.RunRequest(tags={TRIGGER_TAG: "nightly", "eagle_assets/partitions": ",".join(keys)[:1000]})


def build_schedules() -> list[dg.ScheduleDefinition]:
    """Schedules of a catalog's Definitions."""
    return [nightly_training_schedule]
