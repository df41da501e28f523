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
every chunk reads the whole sources. With ``dataset_cache`` (what the asset passes), :func:`dataset_chunk_rows`
parses the dataset once for all its chunks: the first chunk run to need it runs the same pass with every sampled
row split into one file per chunk (``_ChunkFiles``, bounded buffers, at most ``MAX_OPEN_CHUNK_FILES`` files per pass
over the spills), under a file lock, and each chunk then writes its own rows from its file through the same
row-group writer: the same bytes as the full pass, at the cost of one parse for the dataset.

A partition of at most ``ROW_GROUP_ROWS`` rows is written as one row group, byte for byte the file the in-memory
path wrote (``pq.write_table`` of the whole table), so data versions of existing partitions do not change.
The one case read back into memory is a source file listed twice in one partition (both listings kept rows): its
rows are sorted together, as the order by ``(source_file, source_row)`` asks.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import stat
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.raw_prompts.rows import KEPT, RAW_SCHEMA, REJECT_SCHEMA, shown_path, iter_prompt_rows
from eagle_assets.storage.shards import write_json_atomic

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


class _RowGroupWriter:
    """Tables in, row groups of ``ROW_GROUP_ROWS`` rows out, to a temp file renamed onto ``path`` by ``commit``.

    Each row group is one ``ParquetWriter.write_table`` of one combined table, as ``pq.write_table`` writes a
    table: a file of at most one group is the same bytes as ``pq.write_table(table, path, compression="zstd")``.
    """

    def __init__(self, path: Path, schema: pa.Schema, group_rows: int | None = None):
        self.path, self.schema, self.group_rows = Path(path), schema, group_rows or ROW_GROUP_ROWS
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self._writer = pq.ParquetWriter(self.tmp, schema, compression="zstd")
        self._parts: list[pa.Table] = []
        self._buffered = 0
        self.rows = 0
        self.groups = 0

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            take = min(table.num_rows, self.group_rows - self._buffered)
            self._parts.append(table.slice(0, take))
            self._buffered += take
            table = table.slice(take)
            if self._buffered == self.group_rows:
                self._flush()

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.write(pa.Table.from_pylist(rows, schema=self.schema))

    def _flush(self) -> None:
        table = pa.concat_tables(self._parts).combine_chunks() if self._parts else self.schema.empty_table()
        self._writer.write_table(table)
        self.rows += table.num_rows
        self.groups += 1
        self._parts, self._buffered = [], 0

    def commit(self) -> None:
        if self._buffered or not self.groups:  # an empty file is written as pq.write_table writes an empty table
            self._flush()
        self._writer.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._writer.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


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


def _parse_sources(
    partition_key: str,
    sources: list[tuple[Path, str]],
    policy: str,
    spill_dir: Path,
    rejects: _RowGroupWriter,
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


def _emit_in_order(spills: list[_Spill], selected: np.ndarray | None, sources: list[tuple[Path, str]], seed: int,
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
    dataset_cache: Path | None = None,
) -> RawPromptsSummary:
    """Read every record of ``sources`` (``[(path, format)]``) once and write ``out_dir/prompts.parquet``
    (``RAW_SCHEMA``: the ``limit`` rows of smallest :func:`sample_order`, all when ``limit`` is None, ordered by
    ``(source_file, source_row)``) and ``out_dir/rejects.parquet`` (``REJECT_SCHEMA``, in record order).

    ``partition_key`` keys the sample ids: the dataset's key, for a chunk too. ``chunk``: ``(index, chunks)`` to
    write only the sampled rows whose :func:`chunk_of` is ``index`` (rejects: all in chunk 0, none in the others;
    ``available`` stays the dataset's count). None = the whole dataset.

    ``dataset_cache`` (with ``chunk``): a directory shared by the dataset's chunks (shared storage for runs on
    several machines): the first chunk to need it parses the dataset once into it and every chunk then reads only
    its own rows from it (:func:`dataset_chunk_rows`); the files written are the same bytes either way. Without it,
    a chunk reads and parses the whole sources itself.

    Raises ``FormatError`` for a source file unusable as a whole and ``OSError`` for unwritable output; nothing is
    replaced then (both files are renamed into place only after the pass).
    """
    if chunk is not None and not 0 <= chunk[0] < chunk[1]:
        raise ValueError(f"chunk {chunk[0]} of {chunk[1]}: the index must be in 0 .. {chunk[1] - 1}")
    if chunk is not None and dataset_cache is not None:
        return dataset_chunk_rows(partition_key, sources, policy, out_dir, Path(dataset_cache), chunk,
                                  seed=seed, limit=limit)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(_SPILL_PREFIX + "*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    spill_dir = Path(tempfile.mkdtemp(prefix=_SPILL_PREFIX, dir=out_dir))
    summary = RawPromptsSummary(parsed=True)
    sources = list(sources)
    rejects = _RowGroupWriter(out_dir / "rejects.parquet", REJECT_SCHEMA)
    prompts: _RowGroupWriter | None = None
    try:
        spills, selected = _parse_sources(partition_key, sources, policy, spill_dir, rejects, summary, seed=seed,
                                          limit=limit, chunk=chunk)
        prompts = _RowGroupWriter(out_dir / "prompts.parquet", RAW_SCHEMA)
        _emit_in_order(spills, selected, sources, seed, prompts)
        prompts.commit()
        rejects.commit()
        summary.rows, summary.row_groups = prompts.rows, prompts.groups
    finally:
        for w in (prompts, rejects):
            if w is not None and os.path.exists(w.tmp):  # not committed: an error above
                w.abort()
        shutil.rmtree(spill_dir, ignore_errors=True)
    return summary


# --- a chunked dataset, parsed once for all its chunks --------------------------------------------------------------

DATASET_CACHE_FORMAT = "2"  # bump when the files of a dataset's parse change meaning (2: Arrow IPC chunk files)
MAX_OPEN_CHUNK_FILES = 64  # chunk files one pass over the sampled rows writes at once (more chunks: more passes)
CHUNK_BUFFER_ROWS = ROW_GROUP_ROWS  # rows held over all open chunk files before every buffer is flushed
_LOCK_FILE = ".lock"
_BUILD_PREFIX = ".build-"
_SOURCE_HASHES = "source_hashes.json"
_PARSE_SUMMARY = "summary.json"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _code_digest() -> str:
    """sha256 hex over the code that turns records into rows: the ``formats`` package's ``.py`` files (relative
    path and bytes) and this module's bytes. A changed loader makes every dataset's parse stale."""
    import eagle_assets.formats as formats

    root = Path(formats.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f"{f.relative_to(root)}\0".encode())
        h.update(f.read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def _source_hashes(sources: list[tuple[Path, str]], memo_path: Path) -> list[str]:
    """sha256 hex of each source file's bytes; a file whose ``(size, mtime_ns)`` match the memo at ``memo_path``
    (JSON ``{path: [size, mtime_ns, sha256]}``, the rule of the sources sensor) is not read again, so a chunk run
    does not hash a large dataset that an earlier chunk already hashed. Raises OSError for a missing, unreadable or
    non-regular source."""
    try:
        memo = json.loads(memo_path.read_text())
        memo = memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        memo = {}
    shas, changed = [], False
    for path, _ in sources:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{path} is not a file")
        hit = memo.get(str(path))
        if isinstance(hit, list) and len(hit) == 3 and hit[:2] == [st.st_size, st.st_mtime_ns]:
            shas.append(hit[2])
            continue
        sha = _file_sha256(path)
        memo[str(path)] = [st.st_size, st.st_mtime_ns, sha]
        shas.append(sha)
        changed = True
    if changed:  # two chunks may both write it: either file is right
        write_json_atomic(memo, memo_path)
    return shas


def dataset_parse_key(partition_key: str, sources: list[tuple[Path, str]], policy: str, shas: list[str], *,
                      seed: int, limit: int | None, chunks: int) -> str:
    """The name of a dataset's parse: the first 32 hex digits of sha256 over canonical JSON of everything that
    decides its chunks' rows (the dataset key, each source's path, format and content sha256 in catalog order, the
    prompt policy, ``seed``, ``limit``, the chunk count, the cache format and :func:`_code_digest`)."""
    facts = {"cache_format": DATASET_CACHE_FORMAT, "code": _code_digest(), "dataset": partition_key,
             "sources": [[str(p), fmt, sha] for (p, fmt), sha in zip(sources, shas)], "prompt_policy": policy,
             "seed": seed, "limit": limit, "chunks": chunks}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


class _ChunkFiles:
    """Sampled rows in output order in, one Arrow IPC file per chunk ``lo`` .. ``hi - 1`` out (``chunk-NNNNN.arrow``
    under ``directory``, ``RAW_SCHEMA``, uncompressed: each chunk's run reads its file once, and the IPC format costs
    a copy where Parquet costs an encode and a decode); rows of other chunks are
    skipped. At most ``CHUNK_BUFFER_ROWS`` rows wait over all chunks (a chunk's buffer is written as a row group when
    it reaches ``SPILL_ROWS`` rows, every buffer when the total does), and ``hi - lo`` files are open at once."""

    def __init__(self, directory: Path, lo: int, hi: int, chunks: int):
        self.directory, self.lo, self.hi, self.chunks = directory, lo, hi, chunks
        self.rows = [0] * (hi - lo)
        self._writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
        self._parts: dict[int, list[pa.Table]] = {c: [] for c in range(lo, hi)}
        self._held = [0] * (hi - lo)
        self._total = 0

    def write(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        of = np.fromiter((chunk_of(s, self.chunks) for s in table.column("sample_id").to_pylist()),
                         dtype=np.int64, count=table.num_rows)
        order = np.argsort(of, kind="stable")  # stable: each chunk's rows keep the output order
        bounds = np.searchsorted(of[order], np.arange(self.lo, self.hi + 1))
        if bounds[-1] == bounds[0]:
            return
        table = table.take(pa.array(order[bounds[0]:bounds[-1]]))
        for c in range(self.lo, self.hi):
            a, b = bounds[c - self.lo] - bounds[0], bounds[c - self.lo + 1] - bounds[0]
            if b > a:
                self._parts[c].append(table.slice(a, b - a))
                self._held[c - self.lo] += b - a
                self._total += b - a
                if self._held[c - self.lo] >= SPILL_ROWS:
                    self._flush(c)
        if self._total >= CHUNK_BUFFER_ROWS:
            for c in range(self.lo, self.hi):
                self._flush(c)

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.write(pa.Table.from_pylist(rows, schema=RAW_SCHEMA))

    def _flush(self, c: int) -> None:
        if not self._parts[c]:
            return
        table = pa.concat_tables(self._parts[c]).combine_chunks()
        writer = self._writers.get(c)
        if writer is None:
            writer = self._writers[c] = pa.ipc.new_file(str(self.directory / f"chunk-{c:05d}.arrow"), RAW_SCHEMA)
        writer.write_table(table)
        self.rows[c - self.lo] += table.num_rows
        self._total -= self._held[c - self.lo]
        self._parts[c], self._held[c - self.lo] = [], 0

    def close(self) -> None:
        for c in range(self.lo, self.hi):
            self._flush(c)
        for w in self._writers.values():
            w.close()


def _build_dataset_parse(partition_key: str, sources: list[tuple[Path, str]], policy: str, cache: Path, name: str,
                         *, seed: int, limit: int | None, chunks: int) -> None:
    """Parse the dataset once into ``cache/name/`` (the caller holds the cache's lock exclusively): the sampled
    rows of chunk ``c`` in ``chunk-NNNNN.arrow`` (Arrow IPC; absent for an empty chunk), every reject in
    ``rejects.parquet`` (the bytes an unchunked pass writes), and ``summary.json`` (``available``, ``rejected``,
    ``reasons``, ``rows_by_chunk``, the key's ``facts``). Built in a temporary directory renamed into place, so
    ``cache/name/`` exists only complete; parses of other keys (stale) and builds left by killed runs are removed."""
    for left in cache.glob(_BUILD_PREFIX + "*"):  # a killed build (no other builder runs: the lock is held)
        shutil.rmtree(left, ignore_errors=True)
    build = Path(tempfile.mkdtemp(prefix=_BUILD_PREFIX, dir=cache))
    try:
        spill_dir = build / "spill"
        spill_dir.mkdir()
        summary = RawPromptsSummary(parsed=True)
        rejects = _RowGroupWriter(build / "rejects.parquet", REJECT_SCHEMA)
        try:
            spills, selected = _parse_sources(partition_key, sources, policy, spill_dir, rejects, summary,
                                              seed=seed, limit=limit, chunk=None)
            rejects.commit()
        finally:
            if os.path.exists(rejects.tmp):
                rejects.abort()
        rows_by_chunk: list[int] = []
        for lo in range(0, chunks, MAX_OPEN_CHUNK_FILES):  # one pass over the spills per group of chunk files
            files = _ChunkFiles(build, lo, min(chunks, lo + MAX_OPEN_CHUNK_FILES), chunks)
            try:
                _emit_in_order(spills, selected, sources, seed, files)
            finally:
                files.close()
            rows_by_chunk += files.rows
        shutil.rmtree(spill_dir)
        (build / _PARSE_SUMMARY).write_text(json.dumps({
            "available": summary.available, "rejected": summary.rejected, "reasons": dict(summary.reasons),
            "rows_by_chunk": rows_by_chunk, "dataset": partition_key, "chunks": chunks, "seed": seed,
            "limit": limit, "prompt_policy": policy, "sources": [[str(p), fmt] for p, fmt in sources]}, indent=1))
        for old in cache.iterdir():  # parses of other sources or settings: stale (their readers hold the lock)
            if old.is_dir() and not old.name.startswith(".") and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        os.rename(build, cache / name)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _write_chunk_from_parse(parse: Path, out_dir: Path, chunk: tuple[int, int], parsed: bool) -> RawPromptsSummary:
    """``out_dir/prompts.parquet`` and ``rejects.parquet`` of chunk ``chunk`` from the dataset's parse at ``parse``:
    the same bytes the full pass of :func:`write_raw_prompts` writes for it (the same rows, in the same order,
    through the same row-group writer; chunk 0's rejects are the parse's file, the others' an empty one)."""
    meta = json.loads((parse / _PARSE_SUMMARY).read_text())
    index = chunk[0]
    summary = RawPromptsSummary(available=meta["available"], parsed=parsed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = _RowGroupWriter(out_dir / "prompts.parquet", RAW_SCHEMA)
    rejects: _RowGroupWriter | None = None
    copied: str | None = None
    try:
        part = parse / f"chunk-{index:05d}.arrow"
        if part.exists():
            with pa.memory_map(str(part)) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    prompts.write(pa.Table.from_batches([reader.get_batch(i)], schema=RAW_SCHEMA))
        if index == 0:  # the dataset's rejects: the parse's file as it is
            fd, copied = tempfile.mkstemp(prefix=".rejects.parquet.", suffix=".tmp", dir=out_dir)
            os.close(fd)
            shutil.copyfile(parse / "rejects.parquet", copied)
            summary.rejected, summary.reasons = meta["rejected"], Counter(meta["reasons"])
            prompts.commit()
            os.replace(copied, out_dir / "rejects.parquet")
        else:
            rejects = _RowGroupWriter(out_dir / "rejects.parquet", REJECT_SCHEMA)
            prompts.commit()
            rejects.commit()
        summary.rows, summary.row_groups = prompts.rows, prompts.groups
    finally:
        for w in (prompts, rejects):
            if w is not None and os.path.exists(w.tmp):  # not committed: an error above
                w.abort()
        if copied is not None and os.path.exists(copied):
            os.unlink(copied)
    return summary


def dataset_chunk_rows(partition_key: str, sources: list[tuple[Path, str]], policy: str, out_dir: Path,
                       cache: Path, chunk: tuple[int, int], *, seed: int = 0,
                       limit: int | None = None) -> RawPromptsSummary:
    """Chunk ``chunk = (index, chunks)`` of a dataset through the dataset's parse in ``cache`` (one directory per
    dataset, shared by its chunks' runs): the first run to need the parse builds it (:func:`_build_dataset_parse`)
    while holding ``cache/.lock`` exclusively (``flock``), so concurrent chunk runs wait for that one parse instead
    of each parsing; every run then reads only its own chunk's rows under a shared lock (a rebuild for changed
    sources or settings waits for it). The parse is named by :func:`dataset_parse_key`: an edited source, another
    ``limit``, ``seed``, policy or chunk count, or changed loader code is a new parse and the old one is removed.
    Writes and returns what :func:`write_raw_prompts` with ``chunk`` writes, byte for byte; ``parsed`` says whether
    this call did the parse.

    A source that is missing or not a file falls back to :func:`write_raw_prompts` without the cache, which raises
    the ``FormatError`` naming it. Raises ``FormatError`` for a source unusable as a whole (nothing cached then),
    ``OSError`` for unwritable output or cache, and for a cache on storage without ``flock`` (ENOLCK): the lock is
    what keeps concurrent chunk runs to one parse, across machines too on shared storage that supports it (NFSv4,
    CephFS, Lustre with flock enabled).
    """
    sources = list(sources)
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        shas = _source_hashes(sources, cache / _SOURCE_HASHES)
    except OSError:
        return write_raw_prompts(partition_key, sources, policy, out_dir, seed=seed, limit=limit, chunk=chunk)
    name = dataset_parse_key(partition_key, sources, policy, shas, seed=seed, limit=limit, chunks=chunk[1])
    parse = cache / name
    parsed = False
    with open(cache / _LOCK_FILE, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        while not (parse / _PARSE_SUMMARY).is_file():
            fcntl.flock(lock, fcntl.LOCK_EX)  # a conversion: drops the shared lock, then waits for the others
            if not (parse / _PARSE_SUMMARY).is_file():
                try:
                    _build_dataset_parse(partition_key, sources, policy, cache, name, seed=seed, limit=limit,
                                         chunks=chunk[1])
                    parsed = True
                except OSError:
                    if not (parse / _PARSE_SUMMARY).is_file():  # not a race that another builder won
                        raise
            fcntl.flock(lock, fcntl.LOCK_SH)
        return _write_chunk_from_parse(parse, out_dir, chunk, parsed)
