"""A chunked dataset's sources parsed once for all its chunks (``raw_prompts`` of a chunk partition).

The first chunk run to need the parse runs the pass of :mod:`eagle_assets.raw_prompts.write` over the whole dataset
with every sampled row split into one file per chunk (``_ChunkFiles``, bounded buffers, at most
``MAX_OPEN_CHUNK_FILES`` files per pass over the spills), under a file lock; each chunk then writes its own rows from
its file through the same row-group writer: the same bytes as :func:`~eagle_assets.raw_prompts.write.write_raw_prompts`
with ``chunk`` writes, at the cost of one parse for the dataset.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_assets.raw_prompts.rows import RAW_SCHEMA, REJECT_SCHEMA
from eagle_assets.raw_prompts.write import (
    ROW_GROUP_ROWS,
    SPILL_ROWS,
    RawPromptsSummary,
    chunk_of,
    emit_in_order,
    parse_sources,
    row_group_writer,
    write_raw_prompts,
)
from eagle_assets.storage.guard import open_lock_file, refuse_symlink, remove_tree
from eagle_assets.storage.shards import AtomicParquetWriter, atomic_file, write_json_atomic

# bump when the files of a dataset's parse change meaning (2: Arrow IPC chunk files; 3: rejects carry source_line)
DATASET_CACHE_FORMAT = "3"
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
    path and bytes), the pass (``raw_prompts.write``) and this module. A changed loader makes every dataset's parse
    stale."""
    import eagle_assets.formats as formats
    import eagle_assets.raw_prompts.write as raw_pass

    root = Path(formats.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f"{f.relative_to(root)}\0".encode())
        h.update(f.read_bytes())
    h.update(Path(raw_pass.__file__).read_bytes())
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
        remove_tree(left, ignore_errors=True)  # a link is refused, never followed
    build = Path(tempfile.mkdtemp(prefix=_BUILD_PREFIX, dir=cache))
    try:
        spill_dir = build / "spill"
        spill_dir.mkdir()
        summary = RawPromptsSummary(parsed=True)
        rejects = row_group_writer(build / "rejects.parquet", REJECT_SCHEMA)
        try:
            spills, selected = parse_sources(partition_key, sources, policy, spill_dir, rejects, summary,
                                              seed=seed, limit=limit, chunk=None)
            rejects.commit()
        finally:
            rejects.abort()  # nothing after its commit
        rows_by_chunk: list[int] = []
        for lo in range(0, chunks, MAX_OPEN_CHUNK_FILES):  # one pass over the spills per group of chunk files
            files = _ChunkFiles(build, lo, min(chunks, lo + MAX_OPEN_CHUNK_FILES), chunks)
            try:
                emit_in_order(spills, selected, sources, seed, files)
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
                remove_tree(old, ignore_errors=True)  # a link is refused, never followed
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
    prompts = row_group_writer(out_dir / "prompts.parquet", RAW_SCHEMA)
    rejects: AtomicParquetWriter | None = None
    try:
        part = parse / f"chunk-{index:05d}.arrow"
        if part.exists():
            with pa.memory_map(str(part)) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    prompts.write(pa.Table.from_batches([reader.get_batch(i)], schema=RAW_SCHEMA))
        if index == 0:  # the dataset's rejects: the parse's file as it is
            with atomic_file(out_dir / "rejects.parquet") as copied:
                shutil.copyfile(parse / "rejects.parquet", copied)
                summary.rejected, summary.reasons = meta["rejected"], Counter(meta["reasons"])
                prompts.commit()
        else:
            rejects = row_group_writer(out_dir / "rejects.parquet", REJECT_SCHEMA)
            prompts.commit()
            rejects.commit()
        summary.rows, summary.row_groups = prompts.rows, prompts.groups
    finally:
        for w in (prompts, rejects):
            if w is not None:  # nothing after its commit
                w.abort()
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
    CephFS, Lustre with flock enabled). ``SymlinkRefusedError`` when ``cache``, its lock file or a parse folder to
    remove is a symbolic link (nothing is deleted through it).
    """
    sources = list(sources)
    cache = refuse_symlink(Path(cache))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        shas = _source_hashes(sources, cache / _SOURCE_HASHES)
    except OSError:
        return write_raw_prompts(partition_key, sources, policy, out_dir, seed=seed, limit=limit, chunk=chunk)
    name = dataset_parse_key(partition_key, sources, policy, shas, seed=seed, limit=limit, chunks=chunk[1])
    parse = cache / name
    parsed = False
    with os.fdopen(open_lock_file(cache / _LOCK_FILE), "r+b") as lock:
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
