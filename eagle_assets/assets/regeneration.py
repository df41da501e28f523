"""Where a ``generations`` step writes, and when its new rows replace the stored ones.

A partition whose stored rows were generated under other inputs (``versions.generation_inputs_changed``), or whose
run config asks ``regenerate: true``, is generated again into a staging folder beside its shards
(``generations.run.staging_dir``). The stored rows stay the partition's rows until the new run has produced rows of
its own; then ``promote_staged`` swaps them in. A regeneration whose every request failed replaces nothing, and a
killed one resumes its staged rows at the next materialization (the staging folder records its inputs first, so a
staging folder of yet other inputs is started afresh). Shared by the single-turn (``generation``) and multi-turn
(``conversations``) ``generations`` bodies.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_assets.assets.versions import generation_inputs_changed, record_generation_inputs
from eagle_assets.generations.run import (FAILURES_FILE, LOCK_FILE, PartitionBusyError, exclusive_writer,
                                          promote_staged, staging_dir)
from eagle_assets.storage.shards import shard_paths, shard_row_count


def generation_workdir(context: dg.AssetExecutionContext, out: Path, fingerprint: dict,
                       regenerate: bool, explicit: bool) -> tuple[Path, bool]:
    """``(folder to generate into, clear it first)`` for one ``generations`` step.

    Args:
        out: the partition's generations folder; fingerprint: ``versions.generation_fingerprint`` of this run;
        regenerate: the stored rows are not to be resumed from (inputs changed, or ``explicit``);
        explicit: the run config's ``regenerate: true`` (a staged attempt is started afresh too).
    """
    if not regenerate:
        return out, False
    if not shard_paths(out):  # no row to protect: regenerate in place (clears failures and stale files)
        return out, True
    stage = staging_dir(out)
    fresh = explicit or bool(generation_inputs_changed(stage, fingerprint))
    try:
        with exclusive_writer(stage):  # never clear a staging folder another run is writing into
            if fresh:
                for p in stage.iterdir():
                    if p.name != LOCK_FILE:
                        shutil.rmtree(p) if p.is_dir() else p.unlink()
            record_generation_inputs(stage, fingerprint)  # before any row: a killed run's staged rows are known by it
    except PartitionBusyError as exc:
        raise dg.Failure(description=f"{exc}. Another run is regenerating partition {context.partition_key}; wait "
                                     "for it or cancel it.", allow_retries=False) from exc
    kept, resumed = shard_row_count(out), shard_row_count(stage)
    context.log.info(f"the {kept} stored rows of {context.partition_key} stay until the new generation has rows: "
                     f"generating into {stage}" + (f" (resuming its {resumed} staged rows)" if resumed else ""))
    return stage, False


def failure_summary(work: Path, limit: int = 1) -> str:
    """``"<n> <kind>, ... (e.g. <sample id>: <last error>)"`` of ``work``'s ``failures.parquet`` ("" when none)."""
    path = Path(work) / FAILURES_FILE
    if not path.exists():
        return ""
    table = pq.read_table(path)
    if not table.num_rows:
        return ""
    kinds = pc.value_counts(table.column("kind")).to_pylist()
    counts = ", ".join(f"{k['counts']} {k['values']}" for k in sorted(kinds, key=lambda k: -k["counts"]))
    examples = "; ".join(f"{r['sample_id']}: {r['last_error'][:300]}" for r in table.slice(0, limit).to_pylist())
    return f"{counts} (e.g. {examples})"


def settle_generation(context: dg.AssetExecutionContext, out: Path, work: Path, *, requested: int,
                      succeeded: int) -> None:
    """After the requests of a step: promote staged rows that exist, and fail a step that produced no row.

    Raises:
        dg.Failure: requests were sent and none succeeded (every one failed after retries): the description gives
            the failures by kind with one example and says the stored rows were kept; nothing downstream runs on it.
    """
    key = context.partition_key
    staged = work != out
    if staged and shard_paths(work):  # a shard is only written with rows in it
        old, new = promote_staged(out)
        context.log.info(f"{key}: {new} rows generated under the new inputs replace the {old} stored rows")
    if requested and not succeeded:
        kept = shard_row_count(out)
        raise dg.Failure(
            description=(
                f"generation of partition {key} failed: every one of its {requested} requests failed after retries: "
                f"{failure_summary(work) or 'no failure recorded'}. The partition keeps its {kept} stored rows "
                f"({out}). Fix the server or the failing requests (see {work / FAILURES_FILE}) and materialize again."
            ),
            allow_retries=False,
        )
