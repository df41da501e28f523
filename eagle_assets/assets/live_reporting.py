"""What a ``generations`` step reports from its live quality monitor: run metadata and the failure of a stopped run.

Shared by the single-turn (``generation``) and multi-turn (``conversations``) ``generations`` bodies.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from eagle_assets.generations.run import LIVE_STATS_FILE


def live_metadata(snapshot: dict, path: Path) -> dict:
    """Run metadata of the last live snapshot: level, the main figures (JSON) and the live_stats.json path."""
    keys = ("rows", "rows_this_run", "kept", "dropped", "completion_tokens", "reasoning_tokens", "answer_tokens",
            "share_under_short", "share_truncated", "share_dropped", "share_by_reason", "stopped")
    return {
        "live_level": snapshot["level"],
        "live_figures": dg.MetadataValue.json({k: snapshot[k] for k in keys}),
        "live_alarms": dg.MetadataValue.json([a["message"] for a in snapshot["alarms"]]),
        "live_stats_path": dg.MetadataValue.path(str(path)),
    }


def stopped_failure(key: str, stats, out: Path, monitor) -> dg.Failure:
    """The ``dg.Failure`` of a partition whose live monitor stopped it: which figure broke, what is kept, what to do."""
    stop = monitor.stop
    description = (
        f"generation of partition {key} was stopped early by live quality monitoring: {stop.message()}. "
        f"The {stats.succeeded + stats.skipped_done} rows generated so far are kept in {out} and {stats.not_sent} "
        f"prompts were not sent. Fix the server, chat template or sampling settings, then materialize again: it "
        f"resumes from the kept rows (run config regenerate: true generates every prompt again instead, its rows "
        f"replacing these once it has some, since these count in the partition's figures), or set partitions.{key}.live.fail_fast: false in the catalog to generate every "
        f"prompt anyway. Running figures: {out / LIVE_STATS_FILE}"
    )
    return dg.Failure(description=description, metadata=live_metadata(monitor.snapshot(), out / LIVE_STATS_FILE),
                      allow_retries=False)
