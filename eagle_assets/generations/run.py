"""Resumable, exactly-once generation of one partition against SGLang ``/generate`` servers.

Results are buffered and flushed to a new shard (``shard-NNNNN.parquet``, atomic temp file + rename) every
``flush_rows`` rows, and at least every ``flush_seconds`` seconds by a timer (not only when a reply arrives). On
start, the sample ids already in shards are read back and skipped, so a killed run loses at most the unflushed
buffer and never writes an id twice. Only validated replies (``parse_generate_reply``) reach a shard. Requests that
still fail after the client's retries go to ``failures.parquet`` (sample id, kind, attempts, last error) and are
retried by the next materialization; a partition whose every prompt is in a shard sends no request at all.

Exactly-once needs one writer per partition directory: ``run_generation`` holds an exclusive ``flock`` on
``<out_dir>/.generation.lock`` while it runs (``storage.guard.stage_lock``: the kernel drops it when the process
dies, SIGKILL included) and refuses to start when another process holds it. Temp files left by a killed writer are
removed on start. A partition folder, staging folder or lock file that is a symbolic link is refused before anything
is deleted (``storage.guard.refuse_symlink``): clearing through it would delete what it points to.

Live quality (optional ``monitor``, an ``eagle_assets.qc.live.LiveQualityMonitor``): the monitor is seeded with
the rows already in the shards and fed every new row; at each of its reports (every report evaluates)
``live_stats.json`` is rewritten (atomically, by a writer thread: no file I/O on the event loop; at most every
``LIVE_STATS_MIN_INTERVAL_S``; the final figures synchronously) beside the shards, alarms go to the ``alarm``
callback once per change of level, and a one-line summary goes to ``progress`` at most every ``live.log_every_s``
seconds. When the monitor decides to stop, no new request is sent: the requests already in flight finish and their
rows are kept like every other row, and the stats say
``stopped_early`` with the reason. The unsent prompts are not failures; the next materialization sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.figures.running import DurationSketch
from eagle_assets.storage.guard import PartitionBusyError as PartitionBusyError  # re-exported: callers catch it here
from eagle_assets.storage.guard import refuse_symlink, stage_lock
from eagle_assets.storage.shards import (
    clear_shards,
    next_shard_path,
    read_done_ids,
    shard_paths,
    shard_row_count,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
)

GENERATION_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("output_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("matched_stop", pa.int64()),
        ("completion_tokens", pa.int32()),
        ("prompt_tokens", pa.int32()),
        ("latency_s", pa.float64()),
        ("attempts", pa.int32()),
        ("sampling_params", pa.string()),
    ]
)
FAILURE_SCHEMA = pa.schema(
    [("sample_id", pa.string()), ("kind", pa.string()), ("attempts", pa.int32()), ("last_error", pa.string())]
)
FAILURES_FILE = "failures.parquet"
LOCK_FILE = ".generation.lock"
LIVE_STATS_FILE = "live_stats.json"


@dataclass
class GenerationStats:
    """What one generation run did. Units: seconds, requests/s, tokens/s.

    Attributes:
        prompts: distinct sample ids given; requested: those not yet in a shard (sent to the client);
        skipped_done: those already in a shard; succeeded / failed: results of this run;
        retried: HTTP attempts beyond the first, over all results; finish_reasons / failure_kinds: counts;
        output_tokens: ids in succeeded replies; latencies_s: client seconds per succeeded request (retries
        included); wall_s: run time; shards_written: new shard files; stopped_early / stop_reason: the live
        monitor stopped the run (reason: one line naming figure, value, threshold, examples); not_sent: prompts of
        ``requested`` that were never sent because of that stop.
    """

    prompts: int = 0
    requested: int = 0
    skipped_done: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    failure_kinds: Counter = field(default_factory=Counter)
    output_tokens: int = 0
    latencies_s: DurationSketch = field(default_factory=DurationSketch)  # bounded: no list per row
    wall_s: float = 0.0
    shards_written: int = 0
    stopped_early: bool = False
    stop_reason: str | None = None
    not_sent: int = 0

    def summary(self) -> dict[str, Any]:
        """Flat metadata dict: counts, rates and latency quantiles (ms)."""
        lat = self.latencies_s  # quantiles within 0.5% (figures.running.DurationSketch)

        def q(p: float) -> float:
            return 1000.0 * lat.at(min(len(lat) - 1, int(p * (len(lat) - 1) + 0.5))) if len(lat) else 0.0

        wall = max(self.wall_s, 1e-9)
        return {
            "prompts": self.prompts,
            "requested": self.requested,
            "skipped_done": self.skipped_done,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "retried": self.retried,
            "finish_reasons": dict(self.finish_reasons),
            "failure_kinds": dict(self.failure_kinds),
            "requests_per_s": round((self.succeeded + self.failed) / wall, 3),
            "output_tokens_per_s": round(self.output_tokens / wall, 1),
            "latency_p50_ms": round(q(0.5), 1),
            "latency_p99_ms": round(q(0.99), 1),
            "wall_s": round(self.wall_s, 2),
            "shards_written": self.shards_written,
            "stopped_early": self.stopped_early,
            "not_sent": self.not_sent,
        }


@contextlib.contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    # the storage layer's stage lock on .generation.lock, with the refusal a generation writer gives
    busy = (f"another process is generating into {out_dir} (it holds {out_dir / LOCK_FILE}); two writers would "
            "send every prompt twice and could write the same sample id to two shards. Wait for it to finish, "
            "or stop it: the lock is released as soon as that process exits, even when it is killed")
    with stage_lock(out_dir, "generation", busy=busy, lock_name=LOCK_FILE):
        yield


# Young-generation threshold of the cyclic garbage collector while requests are in flight. CPython's default (700
# container allocations) runs a collection every few replies at 1,024 in flight, and each one walks every young
# container, the replies' id lists included: measured here (bench_scale.py client, 8,000 requests) 340 us of GC per
# request at 700, 13 us at 20,000, and 1,640 -> 1,050 us of client CPU per request with the live monitor on.
# Cyclic garbage waits for 20,000 allocations instead of 700 (a few MB at most); reference counting frees the rest.
GC_YOUNG_THRESHOLD = 20_000


@contextlib.contextmanager
def _young_gc_threshold(young: int = GC_YOUNG_THRESHOLD) -> Iterator[None]:
    """Raise ``gc``'s generation-0 threshold to at least ``young`` for the block, then put back the thresholds
    found (process-wide, like every ``gc`` setting: other threads see it meanwhile)."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], young), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _remove_stale_temp_files(out_dir: Path) -> int:
    # write_parquet_atomic's temp names are ".<final name>.<random>.tmp"; a SIGKILL between write and rename
    # leaves one behind. Safe to delete while we hold the partition lock.
    removed = 0
    for p in out_dir.iterdir():
        if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def _read_failures(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist() if path.exists() else []


def run_generation(
    prompts: Sequence[tuple[str, list[int]]],
    out_dir: Path,
    client,
    sampling,
    vocab_size: int | None,
    *,
    flush_rows: int = 64,
    flush_seconds: float = 10.0,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = 5.0,
    regenerate: bool = False,
    monitor=None,
    alarm: Callable[[str], None] | None = None,
    control_ids: Collection[int] | None = None,
    well_formed: Callable[..., bool] | None = None,
) -> GenerationStats:
    """Generate every prompt not yet in ``out_dir``'s shards; append new shards; rewrite ``failures.parquet``.

    Args:
        prompts: (sample_id, prompt_ids) pairs, or a ``tokenized_prompts.prompts_file.PromptsFile`` (read one
            record batch at a time, so the partition's prompt ids are never all in memory); ids are ints of the
            target vocab; a repeated sample id is sent once (its first row).
        out_dir: the partition's generations directory (created if missing).
        client: an ``eagle_assets.serving.client.GenerateClient`` (or anything with the same ``generate_many``).
        sampling: ``SamplingParams`` with an explicit ``max_new_tokens``; a sampled one with a ``seed`` sends each
            row its own seed (:func:`row_seed`) instead.
        vocab_size: target vocab size, for validating ``output_ids`` (None skips the range check).
        flush_rows / flush_seconds: shard size, and the time bound on unflushed work (what a SIGKILL can lose).
        progress: called with a one-line progress message at most every ``progress_every_s`` seconds (a timer,
            never per request), and once with the totals at the end.
        regenerate: delete the existing shards and failures first (under the partition lock) and generate all.
        monitor: a fresh ``LiveQualityMonitor`` for this partition, or None (no live quality, no live_stats.json).
        alarm: called with one line per new live alarm (a figure's level changed) and once when the run is stopped;
            default ``progress``.
        control_ids: the target's special and added token ids (``target_model.render.control_token_ids``), passed
            to the client: the evidence for a prompt echo that the server counted in ``completion_tokens`` (None =
            unknown; ``protocol.prompt_echo_length``).
        well_formed: the family's structure check passed to the client (``serving.protocol.WellFormed``, e.g.
            ``structure.segment.StructureCheck``; the sample id is its ``rid``): a reply well-formed only without a
            head that repeats the prompt's tail is a ``prompt_echo`` (retried, then a failure row, never a shard
            row). None = off.
    Returns: ``GenerationStats`` (``stopped_early`` when the monitor stopped the run).
    Raises:
        PartitionBusyError: another process is generating into ``out_dir``.
        SymlinkRefusedError: ``out_dir`` or its lock file is a symbolic link (nothing deleted or written).
        Whatever ``progress`` or the client raise (the rows already received are flushed first).
    Files: ``shard-NNNNN.parquet`` (``GENERATION_SCHEMA``), ``failures.parquet`` (``FAILURE_SCHEMA``): the ids of
    ``prompts`` that have no row, with the kind of their last failure; rows of other ids are dropped from it;
    ``live_stats.json`` (with a monitor): ``monitor.snapshot()`` plus ``updated_at`` (UTC ISO 8601), ``final`` and
    ``generation`` (requested, succeeded, failed, not_sent of this run).
    """
    out_dir = refuse_symlink(Path(out_dir))  # before mkdir: nothing is created through a link
    out_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir):
        _remove_stale_temp_files(out_dir)
        if regenerate:
            clear_shards(out_dir, extra=[FAILURES_FILE, LIVE_STATS_FILE])
        return _run_locked(prompts, out_dir, client, sampling, vocab_size, flush_rows, flush_seconds, progress,
                           progress_every_s, monitor, alarm or progress,
                           None if control_ids is None else frozenset(control_ids), well_formed)


# A regeneration (other target, sampling or render settings; or ``regenerate=True``) of a partition that holds rows
# writes into this folder inside the partition's directory, so the rows stay until new ones exist to replace them.
STAGING_DIR = ".regenerating"


@contextlib.contextmanager
def exclusive_writer(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir``'s partition lock for the block (the one ``run_generation`` holds while it writes there).

    Raises: ``PartitionBusyError`` when another process holds it; ``SymlinkRefusedError`` when ``out_dir`` or its
    lock file is a symbolic link (checked before the folder is created)."""
    out_dir = refuse_symlink(Path(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir):
        yield


def staging_dir(out_dir: Path) -> Path:
    """Where a regeneration of ``out_dir`` writes until :func:`promote_staged` (``<out_dir>/.regenerating``; shard
    listings of ``out_dir`` do not look inside it)."""
    return Path(out_dir) / STAGING_DIR


def promote_staged(out_dir: Path) -> tuple[int, int]:
    """Replace the generation files of ``out_dir`` with those of its staging folder, under the partition lock.

    Order: the old shards and result files are removed, the staged files moved in (each an atomic rename), the
    staging folder removed last. A crash part-way leaves the staged files where the next regeneration resumes
    from them, so no new row is lost and the old rows are only gone once new ones are in place.

    Returns: (old rows removed, new rows in place).
    Raises: ``PartitionBusyError`` when another process is generating into ``out_dir``; ``FileNotFoundError`` when
    nothing is staged; ``SymlinkRefusedError`` when ``out_dir`` or its staging folder is a symbolic link (nothing is
    removed or moved: the files would be the link target's).
    """
    out_dir, stage = Path(out_dir), staging_dir(out_dir)
    refuse_symlink(out_dir)
    refuse_symlink(stage)
    if not stage.is_dir():
        raise FileNotFoundError(f"nothing staged under {stage}")
    with _exclusive(out_dir):
        staged = [p for p in stage.iterdir() if p.is_file() and p.name != LOCK_FILE and not p.name.endswith(".tmp")]
        names = {p.name for p in staged}
        old_rows = shard_row_count(out_dir)
        shards = set(shard_paths(out_dir))
        stale = [p for p in out_dir.iterdir() if p.is_file() and p.name != LOCK_FILE
                 and (p in shards or p.name in names or p.name in (FAILURES_FILE, LIVE_STATS_FILE))]
        for p in stale:
            p.unlink()
        for p in staged:
            os.replace(p, out_dir / p.name)
        for p in stage.iterdir():
            p.unlink()
        stage.rmdir()
        return old_rows, shard_row_count(out_dir)


def _live_json(snapshot: dict) -> bytes:
    """``snapshot`` as indented JSON with sorted keys (the layout ``write_json_atomic`` writes) by orjson, in C: json's
    indented encoder is pure Python and held the GIL ~1 ms per report in the writer thread (measured: 50 us per
    request of a 1,024-in-flight run, reports every 25 rows), stalling the event loop. json for what orjson refuses
    (integers over 64 bits); orjson writes a non-finite float as null."""
    try:
        return orjson.dumps(snapshot, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS, default=str)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(snapshot, indent=2, sort_keys=True, default=str).encode()


# At most one live_stats.json write per this many seconds while a run goes on: each write (temp file, write, rename)
# cost ~1 ms of CPU here, 40 us per request at 1,000 req/s with a report every 25 rows; the final one is always written.
LIVE_STATS_MIN_INTERVAL_S = 0.1


class _LatestJsonWriter:
    """Writes ``live_stats.json`` in a background thread, so its file I/O stays off the event loop: ``put``
    hands over a snapshot (the latest one wins; one the thread has not reached yet is skipped, so the file only
    moves forward), at most one write per ``min_interval_s``; ``wants()`` is False while a snapshot handed over
    waits for its turn (a newer one can wait for the next report); ``close`` waits for the last one handed over.
    Write errors are raised by ``close``."""

    def __init__(self, path: Path, min_interval_s: float = LIVE_STATS_MIN_INTERVAL_S):
        self.path = path
        self.min_interval_s = min_interval_s
        self._stop = threading.Event()  # set by close: cuts the pause between writes short
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: dict | None = None
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def put(self, snapshot: dict) -> None:
        with self._lock:
            self._pending = snapshot
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="live-stats-writer", daemon=True)
            self._thread.start()
        self._wake.set()

    def wants(self) -> bool:
        """True when no snapshot handed over is still waiting to be written."""
        return self._pending is None

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                snapshot, self._pending, closing = self._pending, None, self._closing
            if snapshot is not None:
                try:
                    write_bytes_atomic(_live_json(snapshot), self.path)
                except BaseException as exc:  # noqa: BLE001 - raised in the generating thread by close()
                    self._error = exc
            if closing:
                return
            self._stop.wait(self.min_interval_s)

    def close(self) -> None:
        if self._thread is not None:
            with self._lock:
                self._closing = True
            self._stop.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


# Parquet dictionary encoding for every column but output_ids: on ~1,000-id replies of a 150k vocab the id
# dictionary overflows its page and falls back to plain after the work is done (measured on a 1,024-row shard of
# Qwen3-shaped replies: 195 ms with it, 35 ms without, files 9% smaller with it: 200 us per request of the client)
_SHARD_DICTIONARY = [name for name in GENERATION_SCHEMA.names if name != "output_ids"]


def _generation_table(rows: list[dict]) -> pa.Table:
    """``rows`` (dicts of ``GENERATION_SCHEMA``'s columns, ``output_ids`` validated ints of the target vocab, as an
    int32 array or a list) as a table. The ids go through numpy, which converts Python ints ~15x faster than
    ``pa.Table.from_pylist`` (~1.8 ms per 1,000-id reply on this machine); ``on_result`` converts each reply once,
    for this table and the live monitor both."""
    ids = [np.asarray(r["output_ids"], dtype=np.int32) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in ids], out=offsets[1:])
    values = pa.array(np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32))
    columns = {name: pa.array([r[name] for r in rows], type=GENERATION_SCHEMA.field(name).type)
               for name in GENERATION_SCHEMA.names if name != "output_ids"}
    columns["output_ids"] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    return pa.table([columns[name] for name in GENERATION_SCHEMA.names], schema=GENERATION_SCHEMA)


def _seed_monitor(monitor, out_dir: Path, wanted: set[str]) -> None:
    # one shard at a time: a large partition's rows are never all in memory at once
    def rows() -> Iterator[dict]:
        wanted_columns = ["sample_id", "output_ids", "finish_reason", "matched_stop", "completion_tokens",
                          "prompt_tokens", "sampling_params"]
        for path in shard_paths(out_dir):
            present = set(pq.read_schema(path).names)  # shards of older versions may lack columns
            for row in pq.read_table(path, columns=[c for c in wanted_columns if c in present]).to_pylist():
                if row["sample_id"] in wanted:
                    yield row

    monitor.seed(rows())


def _first_rows(prompts) -> tuple[dict[str, int], Callable[[], Iterator[tuple[str, Sequence[int]]]]]:
    """(sample id -> index of its first row, a function returning a fresh iterator over the (sample_id, prompt_ids)
    rows) of ``prompts``: a ``PromptsFile``, a sequence, or any other iterable (then read into a list)."""
    from eagle_assets.tokenized_prompts.prompts_file import PromptsFile

    # Prompts stream from their file (a PromptsFile: one record batch at a time) or from the sequence given; only
    # sample ids are held for the whole partition. A repeated sample id is sent once (its first row).
    if isinstance(prompts, PromptsFile):
        return prompts.index, prompts.iter_prompts
    prompts = prompts if isinstance(prompts, Sequence) else list(prompts)
    first: dict[str, int] = {}
    for i, (sid, _) in enumerate(prompts):
        first.setdefault(sid, i)
    return first, lambda: iter(prompts)


class _LockedRun:
    """The state of one ``run_generation`` call while it holds the partition lock: the prompts to send, the rows not
    yet in a shard (``buffer``), this run's failures, the stats and the live-stats writer. ``on_result``,
    ``pending`` and the timer of ``generate`` all run on the event loop's thread; ``finish`` runs whatever happened.
    """

    def __init__(self, prompts, out_dir: Path, sampling, flush_rows: int, flush_seconds: float,
                 progress: Callable[[str], None] | None, progress_every_s: float, monitor=None,
                 alarm: Callable[[str], None] | None = None):
        self.out_dir, self.sampling = out_dir, sampling
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self.progress, self.progress_every_s = progress, progress_every_s
        self.monitor, self.alarm = monitor, alarm
        self.done = read_done_ids(out_dir)
        self.first, self._source = _first_rows(prompts)
        self.seen = self.first.keys()
        self.requested = sum(1 for sid in self.first if sid not in self.done)
        self.stats = GenerationStats(prompts=len(self.first), requested=self.requested,
                                     skipped_done=len(self.first) - self.requested)
        self.old_failures = [f for f in _read_failures(out_dir / FAILURES_FILE) if f["sample_id"] not in self.done]
        self.new_failures: dict[str, dict] = {}
        self.buffer: list[dict] = []
        self.sampling_json = json.dumps(sampling.to_json() if hasattr(sampling, "to_json") else dict(sampling),
                                        sort_keys=True)
        self.started = time.monotonic()
        self.last_flush = self.started
        self.sent = 0  # prompts handed to the client
        if monitor is not None:
            _seed_monitor(monitor, out_dir, self.seen)
        self.live_writer = _LatestJsonWriter(out_dir / LIVE_STATS_FILE)

    def _todo(self) -> Iterator[tuple[str, list[int]]]:
        """(sample_id, prompt_ids) of every first row of a sample id that has no row in a shard, in prompt order."""
        first, done = self.first, self.done
        for i, (sid, ids) in enumerate(self._source()):
            if first.get(sid) == i and sid not in done:
                yield sid, list(ids)

    def write_live(self, final: bool = False) -> None:
        """Hand the monitor's snapshot (plus ``updated_at``, ``final``, ``generation``) to the live-stats writer,
        unless one still waits; ``final``: close the writer and write it here. Nothing without a monitor."""
        monitor = self.monitor
        if monitor is None or not (final or self.live_writer.wants()):
            return
        stats = self.stats
        snap = monitor.snapshot()
        snap.update(
            updated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            final=final,
            generation={"requested": stats.requested, "succeeded": stats.succeeded, "failed": stats.failed,
                        "not_sent": stats.not_sent if final else None},
        )
        if final:  # the last figures: written here and now, after every earlier snapshot
            self.live_writer.close()
            write_json_atomic(snap, self.out_dir / LIVE_STATS_FILE)
        else:
            self.live_writer.put(snap)

    def live_report(self, final: bool = False) -> None:
        """Evaluate the monitor, write ``live_stats.json``, and pass its new alarms (and a stop) to ``alarm``."""
        monitor, alarm = self.monitor, self.alarm
        # the final evaluation covers the last rows but decides nothing: every prompt has been sent by then
        evaluation = monitor.evaluate(final=final)
        self.write_live(final)
        if evaluation is None:
            return
        for a in evaluation.new_alarms:
            if alarm is not None:
                alarm(f"live quality of {monitor.partition or self.out_dir.name}: {a.message()}")
        if evaluation.stop is not None and alarm is not None:
            alarm(f"stopping generation of {monitor.partition or self.out_dir.name} after {monitor.rows} rows: "
                  f"{evaluation.stop.message()}. No new request is sent; the requests in flight finish and are kept")

    def pending(self) -> Iterator[tuple[str, list[int]]]:
        """The prompts to send, counted in ``sent`` as the client takes them; ends once the monitor stops the run."""
        # the client pulls items lazily, one per free worker: ending this iterator is how a stop takes effect
        monitor = self.monitor
        sampling = self.sampling
        per_row_seed = not getattr(sampling, "greedy", True) and getattr(sampling, "seed", None) is not None
        for item in self._todo():
            if monitor is not None and monitor.stop is not None:
                return
            self.sent += 1
            # a sampled partition with a seed: each row draws from its own seed, so its reply does not depend on
            # which request took the server's next random number (resumes, retries, concurrency)
            yield (*item[:2], replace(sampling, seed=row_seed(sampling.seed, item[0]))) if per_row_seed else item

    def flush(self) -> None:
        """Write the buffered rows (if any) to a new shard and restart the flush clock."""
        if self.buffer:
            rows, self.buffer = self.buffer, []
            write_parquet_atomic(_generation_table(rows), next_shard_path(self.out_dir),
                                 use_dictionary=_SHARD_DICTIONARY)
            self.stats.shards_written += 1
        self.last_flush = time.monotonic()

    def report(self, final: bool = False) -> None:
        """Pass one progress line (done / requested, failures, retries, req/s, output tokens/s, ETA) to ``progress``."""
        progress, stats = self.progress, self.stats
        if progress is None:
            return
        finished = stats.succeeded + stats.failed
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = finished / elapsed
        head = "generation finished" if final else "generated"
        eta = ""
        if not final and rate > 0 and finished < stats.requested:
            eta = f", ~{(stats.requested - finished) / rate:.0f} s left"
        progress(
            f"{head} {finished}/{stats.requested} requested ({stats.skipped_done} already done; failed "
            f"{stats.failed}, retried {stats.retried}; {rate:.2f} req/s, {stats.output_tokens / elapsed:.0f} "
            f"output tokens/s{eta})"
        )

    def on_result(self, rid: str, result) -> None:
        """Take one client result: a reply becomes a buffered row (and a monitor observation), anything else a
        failure row; flush once ``flush_rows`` rows wait."""
        stats, monitor = self.stats, self.monitor
        attempts = int(getattr(result, "attempts", 1) or 0)
        stats.retried += max(0, attempts - 1)
        if hasattr(result, "output_ids"):
            fr = result.finish_reason
            latency = float(getattr(result, "latency_s", None) or result.e2e_latency or 0.0)
            # converted once (~25 us per 1,000 ids): the shard (_generation_table) and the live monitor's flat
            # arrays (segment_batch.segment_rows) both take this array as it is
            output_ids = np.array(result.output_ids, dtype=np.int32)
            self.buffer.append(
                {
                    "sample_id": rid,
                    "output_ids": output_ids,
                    "finish_reason": fr.type,
                    "matched_stop": fr.matched if isinstance(fr.matched, int) else None,
                    "completion_tokens": result.completion_tokens,
                    "prompt_tokens": result.prompt_tokens,
                    "latency_s": latency,
                    "attempts": attempts,
                    "sampling_params": self.sampling_json,
                }
            )
            stats.succeeded += 1
            stats.finish_reasons[fr.type] += 1
            stats.output_tokens += len(output_ids)
            stats.latencies_s.append(latency)
            self.new_failures.pop(rid, None)
            if monitor is not None:
                monitor.observe(self.buffer[-1])
                if monitor.report_due():
                    self.live_report()
        else:
            stats.failed += 1
            stats.failure_kinds[result.kind] += 1
            self.new_failures[rid] = {
                "sample_id": rid,
                "kind": result.kind,
                "attempts": attempts,
                "last_error": str(result.last_error)[:2000],
            }
        if len(self.buffer) >= self.flush_rows:
            self.flush()

    async def _timer(self) -> None:
        """Every quarter of the shortest period (at least 50 ms; runs until cancelled): flush a buffer older than
        ``flush_seconds``, report progress every ``progress_every_s`` s, log the monitor's line every
        ``live.log_every_s`` s when it has new rows."""
        # flushes a partial buffer and reports progress even while no reply arrives (long generations)
        monitor, progress = self.monitor, self.progress
        periods = [self.flush_seconds, self.progress_every_s] + ([monitor.live.log_every_s] if monitor is not None
                                                                 else [])
        tick = max(0.05, min(periods) / 4)
        last_report = last_live_log = time.monotonic()
        logged_rows = monitor.rows if monitor is not None else 0
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if self.buffer and now - self.last_flush >= self.flush_seconds:
                self.flush()
            if now - last_report >= self.progress_every_s:
                last_report = now
                self.report()
            if (monitor is not None and progress is not None and monitor.rows != logged_rows
                    and now - last_live_log >= monitor.live.log_every_s):
                last_live_log, logged_rows = now, monitor.rows
                progress(monitor.log_line())

    async def generate(self, client, vocab_size: int | None, control_ids: frozenset[int] | None,
                       well_formed: Callable[..., bool] | None) -> None:
        """Send ``pending()`` through ``client.generate_many`` (each result to ``on_result``) with the timer running."""
        ticker = asyncio.ensure_future(self._timer())
        try:
            # a client without the echo evidence (any object with the same generate_many) still works: only the
            # evidence given is passed
            evidence = {k: v for k, v in (("control_ids", control_ids), ("well_formed", well_formed))
                        if v is not None}
            await client.generate_many(self.pending(), self.sampling, vocab_size=vocab_size,
                                       on_result=self.on_result, **evidence)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    def finish(self) -> None:
        """Flush the buffer, complete the stats, rewrite ``failures.parquet`` (ids of ``prompts`` still without a
        row) and write the final live figures; stops the live-stats writer whatever happens."""
        stats, monitor, out_dir = self.stats, self.monitor, self.out_dir
        self.flush()
        stats.wall_s = time.monotonic() - self.started
        if monitor is not None and monitor.stop is not None:
            stats.stopped_early, stats.stop_reason = True, monitor.stop.message()
        stats.not_sent = self.requested - self.sent
        done_now = read_done_ids(out_dir)
        merged = {f["sample_id"]: f for f in self.old_failures
                  if f["sample_id"] in self.seen and f["sample_id"] not in done_now}
        merged.update({k: v for k, v in self.new_failures.items() if k not in done_now})
        write_parquet_atomic(pa.Table.from_pylist(list(merged.values()), schema=FAILURE_SCHEMA),
                             out_dir / FAILURES_FILE)
        try:
            if monitor is not None:
                self.live_report(final=True)  # closes the writer, then writes the final figures
        finally:
            self.live_writer.close()  # idempotent; stops the writer thread whatever happened above


def row_seed(seed: int, row_id: str) -> int:
    """The sampling seed of one row of a sampled partition: a keyed hash of the partition's ``seed`` and the row
    id, in ``[0, 2**31)`` (SGLang's ``sampling_seed``; the embedded server seeds the row's own generator with it)."""
    return int.from_bytes(hashlib.sha256(f"sampling:{seed}:{row_id}".encode()).digest()[:4], "big") >> 1


def _run_locked(prompts, out_dir: Path, client, sampling, vocab_size, flush_rows, flush_seconds, progress,
                progress_every_s, monitor=None, alarm=None, control_ids: frozenset[int] | None = None,
                well_formed: Callable[..., bool] | None = None) -> GenerationStats:
    """``run_generation`` once it holds the partition lock (arguments, files and errors as documented there): send
    the prompts not yet in a shard, then flush, record failures and final live figures, and report the totals."""
    from eagle_assets.serving.client import run_sync

    run = _LockedRun(prompts, out_dir, sampling, flush_rows, flush_seconds, progress, progress_every_s, monitor, alarm)
    run.write_live()
    try:
        if run.requested:
            with _young_gc_threshold():
                run_sync(run.generate(client, vocab_size, control_ids, well_formed))
    finally:
        run.finish()
    run.report(final=True)
    if monitor is not None and progress is not None:
        progress(monitor.log_line())
    return run.stats
