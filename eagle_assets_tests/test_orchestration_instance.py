"""The repo's dagster.yaml loads into a real instance with the settings the README and docs/scaling.md promise."""

import shutil
from pathlib import Path

import dagster as dg
from dagster._core.instance.ref import InstanceRef

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_repo_dagster_yaml_gives_sqlite_pool_queue_retries_and_no_telemetry(tmp_path):
    shutil.copy(REPO_ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path)))
    try:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert Path(instance.root_directory) == tmp_path  # everything under DAGSTER_HOME
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 4
        assert not instance.telemetry_enabled
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 1
        assert instance.run_retries_retry_on_asset_or_op_failure is False
        assert instance.run_monitoring_enabled
        assert instance.event_log_storage.supports_global_concurrency_limits
        assert instance.event_log_storage.initialize_concurrency_limit_to_default("sglang")
        assert instance.event_log_storage.get_concurrency_info("sglang").slot_count == 1
    finally:
        instance.dispose()
