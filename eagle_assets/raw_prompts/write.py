"""One streaming pass over a partition's sources -> ``raw_prompts``' ``prompts.parquet`` and ``rejects.parquet``.

``write_raw_prompts`` is the body of the ``raw_prompts`` asset (``assets.prompts``) without Dagster, so the bench and
the tests run the same code. Memory does not grow with the rows' size:

- records flow one at a time through ``raw_prompts.rows.iter_prompt_rows`` (which drops duplicates by a compact id
  set, ``SeenIds``: ~20 bytes per distinct record); kept rows are spilled in batches of ``SPILL_ROWS`` to one
  temporary Parquet file per source (beside the output, removed at the end), rejects go straight to their writer;
- the ``limit`` sample is the ``limit`` rows of smallest keyed hash ``sha256(f"{seed}:{sample_id}")`` (what the
  asset always drew: deterministic, seed-dependent, stable when records are added), chosen by a bounded selection
  (``_Smallest``: at most ``2 * limit + SPILL_ROWS`` 32-byte keys held) instead of sorting every row;
- the output is written in the order it always had, by ``(source_file, source_row)``, by streaming the spills in
  file-name order through a row-group writer of at most ``ROW_GROUP_ROWS`` rows.

A chunk of a dataset (``chunk=(index, chunks)``; catalog ``chunks: N``) runs the same pass over every source record:
duplicates and the ``limit`` sample are decided over the whole dataset exactly as unchunked, then only the sampled
rows :func:`chunk_of` assigns to ``index`` are written. So the chunks' rows are disjoint and their union is the
unchunked dataset's rows, ids included (sample ids are keyed by the dataset, not the chunk). Rejects are about the
dataset's records, not a chunk's rows: chunk 0 writes all of them (the unchunked ``rejects.parquet``), the other
chunks an empty file, so each reject is counted once. Done so (``write_raw_prompts`` without ``dataset_cache``),
every chunk reads the whole sources. :mod:`eagle_assets.raw_prompts.dataset_parse` (what the asset runs for a
chunk) parses the dataset once for all its chunks with this module's pass and writes each chunk's rows through the
same row-group writer: the same bytes as the full pass, at the cost of one parse for the dataset.

A partition of at most ``ROW_GROUP_ROWS`` rows is written as one row group, byte for byte the file the in-memory
path wrote (``pq.write_table`` of the whole table), so data versions of existing partitions do not change.
The one case read back into memory is a source file listed twice in one partition (both listings kept rows): its
rows are sorted together, as the order by ``(source_file, source_row)`` asks.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.raw_prompts.rows import KEPT, RAW_SCHEMA, REJECT_SCHEMA, iter_prompt_rows, shown_path
from eagle_assets.storage.guard import refuse_symlink, remove_tree
from eagle_assets.storage.shards import AtomicParquetWriter

ROW_GROUP_ROWS = 8192  # ~12 MB of raw prompt rows (~1.5 KB each) buffered per row group
SPILL_ROWS = 1024
_SPILL_PREFIX = ".raw_spill-"


def sample_order(seed: int, sid: str) -> str:
    """The keyed hash that orders a partition's rows for its ``limit`` sample (hex sha256 of ``"{seed}:{sid}"``):
    deterministic, seed-dependent, and stable when records are added."""
    return hashlib.sha256(f"{seed}:{sid}".encode()).hexdigest()


def chunk_of(sid: str, chunks: int) -> int:
    """The chunk (0 .. ``chunks`` - 1) of a sample id: the first 8 bytes of sha256 of ``"chunk:{sid}"`` as a
    big-endian integer, modulo ``chunks``. Independent of the ``limit`` sample's seed (a chunk is a slice of the
    same sample, whatever the seed) and of every other record, so a row stays in its chunk when records are added."""
    return int.from_bytes(hashlib.sha256(f"chunk:{sid}".encode()).digest()[:8], "big") % chunks


def _order_keys(seed: int, sids: Iterable[str]) -> np.ndarray:
    # the digest bytes sort exactly as their hex digests do (hex digits are in nibble order)
    return np.array([hashlib.sha256(f"{seed}:{s}".encode()).digest() for s in sids], dtype="S32")


class _Smallest:
    """The ``limit`` positions of smallest key among those added, holding at most ``2 * limit + batch`` keys."""

    def __init__(self, limit: int):
        self.limit = limit
        self._keys = np.empty(0, dtype="S32")
        self._pos = np.empty(0, dtype=np.int64)

    def add(self, keys: np.ndarray, positions: np.ndarray) -> None:
        self._keys = np.concatenate([self._keys, keys])
        self._pos = np.concatenate([self._pos, positions])
        if self._keys.size > 2 * self.limit:
            self._prune()

    def _prune(self) -> None:
        # keys are distinct (sample ids are), so the stable sort's tie order never decides
        keep = np.argsort(self._keys, kind="stable")[: self.limit]
        self._keys, self._pos = self._keys[keep], self._pos[keep]

    def positions(self) -> np.ndarray:
        """The selected positions, ascending."""
        self._prune()
        return np.sort(self._pos)


def row_group_writer(path: Path, schema: pa.Schema) -> AtomicParquetWriter:
    """The writer of a raw-prompts file: row groups of ``ROW_GROUP_ROWS`` rows (read when called), so a file of at
    most one group is the bytes ``pq.write_table`` writes for the table."""
    return AtomicParquetWriter(path, schema, ROW_GROUP_ROWS)


@dataclass
class RawPromptsSummary:
    """What one ``write_raw_prompts`` pass wrote: ``rows`` prompt rows (the sample), ``available`` distinct good
    records, ``rejected`` reject rows by ``reasons``, ``row_groups`` of ``prompts.parquet``; ``parsed``: whether
    this call read and parsed the sources (False for a chunk whose rows came from its dataset's cache, already
    parsed by another chunk's run)."""

    rows: int = 0
    available: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)
    row_groups: int = 0
    parsed: bool = False


class _Spill:
    """Kept rows of one source entry, in record order, in a temporary Parquet file."""

    def __init__(self, path: Path, start: int):
        self.path, self.start = path, start  # start: position of its first row among all kept rows
        self.rows = 0
        self.increasing = True  # source rows strictly increasing (always, for one listing of a file)
        self._last_row = -1
        self._writer: pq.ParquetWriter | None = None

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.increasing &= r["source_row"] > self._last_row
            self._last_row = r["source_row"]
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, RAW_SCHEMA, compression="lz4")
        self._writer.write_table(pa.Table.from_pylist(rows, schema=RAW_SCHEMA))
        self.rows += len(rows)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def batches(self, selected: np.ndarray | None):
        """Record batches of the selected rows (``selected``: ascending positions; None = every row)."""
        if not self.rows:
            return
        pos = self.start
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=SPILL_ROWS):
            lo, hi = pos, pos + batch.num_rows
            pos = hi
            if selected is not None:
                take = selected[np.searchsorted(selected, lo):np.searchsorted(selected, hi)] - lo
                if not take.size:
                    continue
                batch = batch.take(pa.array(take))
            yield batch


def parse_sources(
    partition_key: str,
    sources: list[tuple[Path, str]],
    policy: str,
    spill_dir: Path,
    rejects: AtomicParquetWriter,
    summary: RawPromptsSummary,
    *,
    seed: int,
    limit: int | None,
    chunk: tuple[int, int] | None,
) -> tuple[list[_Spill], np.ndarray | None]:
    """The reading half of a pass: every record of ``sources`` once; kept rows (all, or those of ``chunk``) spilled
    per source entry under ``spill_dir``, rejects (all, or none for a chunk other than 0) to ``rejects``, counts
    into ``summary``. Returns the closed spills and the ascending positions of the sampled rows among the spilled
    ones (None: every row)."""
    spills: list[_Spill] = []
    sample = _Smallest(limit) if limit is not None else None
    keep_rejects = chunk is None or chunk[0] == 0
    pending: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []

    def spill() -> None:
        start = spills[-1].start + spills[-1].rows
        if chunk is None:
            mine = pending
            positions = np.arange(start, start + len(pending), dtype=np.int64)
        else:  # the sample is drawn from every row; rows of other chunks take part with position -1
            inside = np.array([chunk_of(r["sample_id"], chunk[1]) == chunk[0] for r in pending], dtype=bool)
            mine = [r for r, k in zip(pending, inside) if k]
            positions = np.full(len(pending), -1, dtype=np.int64)
            positions[inside] = np.arange(start, start + len(mine), dtype=np.int64)
        if sample is not None:
            sample.add(_order_keys(seed, (r["sample_id"] for r in pending)), positions)
        if mine:
            spills[-1].write(mine)
        pending.clear()

    try:
        for kind, index, row in iter_prompt_rows(partition_key, sources, policy):
            while len(spills) <= index:  # a new source entry: close the last one's batch first
                if pending:
                    spill()
                start = spills[-1].start + spills[-1].rows if spills else 0
                spills.append(_Spill(spill_dir / f"source-{len(spills):05d}.parquet", start))
            if kind == KEPT:
                pending.append(row)
                summary.available += 1
                if len(pending) >= SPILL_ROWS:
                    spill()
            elif keep_rejects:
                bad.append(row)
                summary.rejected += 1
                summary.reasons[row["reason"]] += 1
                if len(bad) >= SPILL_ROWS:
                    rejects.write_rows(bad)
                    bad.clear()
        if pending:
            spill()
        rejects.write_rows(bad)
    finally:
        for s in spills:
            s.close()
    selected = sample.positions() if sample is not None else None
    if selected is not None:
        selected = selected[selected >= 0]  # sampled rows of other chunks
    return spills, selected


def emit_in_order(spills: list[_Spill], selected: np.ndarray | None, sources: list[tuple[Path, str]], seed: int,
                   sink) -> None:
    """The writing half of a pass: the selected spilled rows to ``sink`` (``write(table)`` / ``write_rows(rows)``)
    in the output order, by ``(source_file, source_row)``."""
    shown = [shown_path(p) for p, _ in sources]
    order = sorted(range(len(spills)), key=lambda k: shown[k])  # stable: listing order among equal names
    for _, group in itertools.groupby(order, key=lambda k: shown[k]):
        group = [spills[k] for k in group if spills[k].rows]
        if len(group) == 1 and group[0].increasing:
            for batch in group[0].batches(selected):
                sink.write(pa.Table.from_batches([batch], schema=RAW_SCHEMA))
        elif group:
            # the same file listed twice: sort its rows as the order by (source_file, source_row) asks, ties
            # in the sample order (what sorting every row by sample order first, then stably, gave)
            rows = [r for s in group for b in s.batches(selected) for r in b.to_pylist()]
            rows.sort(key=lambda r: (r["source_row"], sample_order(seed, r["sample_id"])))
            sink.write_rows(rows)


def write_raw_prompts(
    partition_key: str,
    sources: list[tuple[Path, str]],
    policy: str,
    out_dir: Path,
    *,
    seed: int = 0,
    limit: int | None = None,
    chunk: tuple[int, int] | None = None,
) -> RawPromptsSummary:
    """Read every record of ``sources`` (``[(path, format)]``) once and write ``out_dir/prompts.parquet``
    (``RAW_SCHEMA``: the ``limit`` rows of smallest :func:`sample_order`, all when ``limit`` is None, ordered by
    ``(source_file, source_row)``) and ``out_dir/rejects.parquet`` (``REJECT_SCHEMA``, in record order).

    ``partition_key`` keys the sample ids: the dataset's key, for a chunk too. ``chunk``: ``(index, chunks)`` to
    write only the sampled rows whose :func:`chunk_of` is ``index`` (rejects: all in chunk 0, none in the others;
    ``available`` stays the dataset's count). None = the whole dataset.

    A chunk done so reads and parses the whole sources itself; ``raw_prompts.dataset_parse.dataset_chunk_rows``
    writes the same bytes from one parse shared by the dataset's chunks.

    Raises ``FormatError`` for a source file unusable as a whole and ``OSError`` for unwritable output; nothing is
    replaced then (both files are renamed into place only after the pass). ``SymlinkRefusedError`` when ``out_dir``
    or a leftover spill folder in it is a symbolic link (nothing deleted: the files would be the link target's).
    """
    if chunk is not None and not 0 <= chunk[0] < chunk[1]:
        raise ValueError(f"chunk {chunk[0]} of {chunk[1]}: the index must be in 0 .. {chunk[1] - 1}")
    out_dir = refuse_symlink(Path(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(_SPILL_PREFIX + "*"):  # left by a killed run
        remove_tree(stale, ignore_errors=True)
    spill_dir = Path(tempfile.mkdtemp(prefix=_SPILL_PREFIX, dir=out_dir))
    summary = RawPromptsSummary(parsed=True)
    sources = list(sources)
    rejects = row_group_writer(out_dir / "rejects.parquet", REJECT_SCHEMA)
    prompts: AtomicParquetWriter | None = None
    try:
        spills, selected = parse_sources(partition_key, sources, policy, spill_dir, rejects, summary, seed=seed,
                                          limit=limit, chunk=chunk)
        prompts = row_group_writer(out_dir / "prompts.parquet", RAW_SCHEMA)
        emit_in_order(spills, selected, sources, seed, prompts)
        prompts.commit()
        rejects.commit()
        summary.rows, summary.row_groups = prompts.rows, prompts.groups
    finally:
        for w in (prompts, rejects):
            if w is not None:  # not committed: an error above
                w.abort()
        shutil.rmtree(spill_dir, ignore_errors=True)
    return summary
