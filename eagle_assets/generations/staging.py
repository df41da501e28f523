"""Where a partition's generation writes, and when its new rows replace the stored ones.

A partition whose stored rows were generated under other inputs (:func:`generation_inputs_changed`: the
fingerprint recorded beside the shards, ``lineage.versions.generation_fingerprint``), or whose run asks for
``regenerate``, is generated again into a staging folder beside its shards (``run.staging_dir``). The stored rows
stay the partition's rows until the new run has produced rows of its own; then ``run.promote_staged`` swaps them in
(:func:`settle`). A regeneration whose every request failed replaces nothing, and a killed one resumes its staged
rows at the next run (the staging folder records its inputs first, so a staging folder of yet other inputs is
started afresh).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_assets.generations.run import FAILURES_FILE, LOCK_FILE, exclusive_writer, promote_staged, staging_dir
from eagle_assets.storage.guard import refuse_symlink, remove_tree
from eagle_assets.storage.shards import shard_paths, shard_row_count, write_json_atomic

GENERATION_INPUTS_FILE = "generation_inputs.json"


def generation_inputs_changed(out_dir: Path, fingerprint: dict) -> list[str]:
    """Names of the inputs that differ between ``fingerprint`` (``{"sha256", "inputs": {name: version}}``) and the
    one recorded in ``out_dir`` (empty when they match or when nothing was recorded yet).

    Shards written before fingerprints were recorded are taken as matching, so upgrading does not regenerate.
    """
    try:
        recorded = json.loads((Path(out_dir) / GENERATION_INPUTS_FILE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(recorded, dict) or recorded.get("sha256") == fingerprint["sha256"]:
        return []
    old = recorded.get("inputs") if isinstance(recorded.get("inputs"), dict) else {}
    return sorted(k for k, v in fingerprint["inputs"].items() if old.get(k) != v) or ["fingerprint"]


def record_generation_inputs(out_dir: Path, fingerprint: dict) -> None:
    """Write ``fingerprint`` beside the shards (atomically), after a generation run that used it."""
    write_json_atomic(fingerprint, Path(out_dir) / GENERATION_INPUTS_FILE)


@dataclass
class Workdir:
    """Where one run generates (``path``: the partition's folder or its staging folder), whether it clears it
    first (``clear``), and what to tell the user (``note``, "" when nothing is special)."""

    path: Path
    clear: bool
    note: str = ""


def choose_workdir(out: Path, fingerprint: dict, regenerate: bool, explicit: bool) -> Workdir:
    """The folder one run generates into.

    Args:
        out: the partition's generations folder; fingerprint: this run's generation fingerprint.
        regenerate: the stored rows are not to be resumed from (inputs changed, or ``explicit``).
        explicit: the run asked for ``regenerate`` (a staged attempt is started afresh too).

    Raises:
        PartitionBusyError: another run is writing into the staging folder (it is never cleared under it).
        SymlinkRefusedError: the partition's folder or its staging folder is a symbolic link (refused before
            anything is read, cleared or locked there: clearing it would delete the files it points to).
    """
    if not regenerate:
        return Workdir(out, False)
    refuse_symlink(out)
    if not shard_paths(out):  # no row to protect: regenerate in place (clears failures and stale files)
        return Workdir(out, True)
    stage = refuse_symlink(staging_dir(out))
    fresh = explicit or bool(generation_inputs_changed(stage, fingerprint))
    with exclusive_writer(stage):
        if fresh:
            for p in stage.iterdir():
                if p.name == LOCK_FILE:
                    continue
                if p.is_dir() and not p.is_symlink():
                    remove_tree(p)
                else:  # a file, or a link (only the link goes: what it points to is not the staging folder's)
                    p.unlink()
        record_generation_inputs(stage, fingerprint)  # before any row: a killed run's staged rows are known by it
    kept, resumed = shard_row_count(out), shard_row_count(stage)
    return Workdir(stage, False, f"the {kept} stored rows of {out.name} stay until the new generation has rows: "
                                 f"generating into {stage}" + (f" (resuming its {resumed} staged rows)" if resumed
                                                               else ""))


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


class NothingGenerated(RuntimeError):
    """Requests were sent and every one failed after retries; the message gives the failures by kind with an
    example and says the stored rows were kept."""


def settle(out: Path, work: Path, *, requested: int, succeeded: int) -> str:
    """After a run's requests: promote staged rows that exist; returns what was promoted ("" when nothing).

    Raises:
        NothingGenerated: requests were sent and none succeeded (nothing downstream should run on it).
    """
    note = ""
    if work != out and shard_paths(work):  # a shard is only written with rows in it
        old, new = promote_staged(out)
        note = f"{out.name}: {new} rows generated under the new inputs replace the {old} stored rows"
    if requested and not succeeded:
        raise NothingGenerated(
            f"generation of partition {out.name} failed: every one of its {requested} requests failed after "
            f"retries: {failure_summary(work) or 'no failure recorded'}. The partition keeps its "
            f"{shard_row_count(out)} stored rows ({out}). Fix the server or the failing requests (see "
            f"{work / FAILURES_FILE}) and materialize again.")
    return note
