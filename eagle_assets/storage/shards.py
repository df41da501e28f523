"""Where each stage's files live, and how they are written so a crash never leaves a half-written shard.

Layout under the storage root (``$EAGLE_ASSETS_HOME``, default ``<cwd>/.eagle_assets``)::

    <root>/<catalog>/raw_prompts/<partition>/prompts.parquet, rejects.parquet
    <root>/<catalog>/tokenized_prompts/<partition>/prompts.parquet, rejects.parquet
    <root>/<catalog>/generations/<partition>/shard-00000.parquet ..., failures.parquet
    <root>/<catalog>/qc_shards/<partition>/shard-00000.parquet, rows.parquet, qc_status.json
    <root>/<catalog>/length_report/...
    <root>/<catalog>/draft_vocab/...
    <root>/<catalog>/drafter_checkpoint/...

Every file is written to a temporary name in the same directory and renamed into place (``os.replace`` is atomic
on POSIX within one filesystem), so readers see either the old file or the new one, never a torn one. The temp
names are ``.<final name>.<random>.tmp``: dotfiles ending ``.tmp``, which no shard listing or content version
matches.

The folders under ``<root>/<catalog>/`` are the pipeline's own: :meth:`Layout.stage_dir` refuses one that is a
symbolic link, and a stage writes its folder while holding its lock (:meth:`Layout.lock`; ``storage.guard``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.storage.guard import refuse_symlink, stage_lock

# a catalog, stage or dataset name, or a chunk's partition key (``catalog.CHUNK_KEY_RE``: "<dataset>.c<digits>")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*(\.c[0-9]+)?$")
_SHARD = re.compile(r"^shard-(\d{5})\.parquet$")


def default_storage_root() -> Path:
    """The storage root: ``$EAGLE_ASSETS_HOME`` if set, else ``<cwd>/.eagle_assets`` (absolute path)."""
    return Path(os.environ.get("EAGLE_ASSETS_HOME") or Path.cwd() / ".eagle_assets").resolve()


def safe_name(name: str, what: str = "partition key") -> str:
    """Return ``name`` if it is a safe single path component, else raise ``ValueError``.

    Partition keys and catalog names become directory names; a key with ``/`` or ``..`` could write outside the
    storage root, so they are refused here rather than trusted. The one dot allowed is a chunk key's ``.c<digits>``
    suffix (``B5.c03``), which names a directory of its own beside the dataset's other chunks.
    """
    if not isinstance(name, str) or not _SAFE_NAME.match(name):
        raise ValueError(
            f"{what} {name!r} is not allowed: use letters, digits, '_' and '-' only (no path separators or '..')"
        )
    return name


@dataclass(frozen=True)
class Layout:
    """Paths of one catalog's files under a storage root."""

    root: Path
    catalog_name: str

    def __post_init__(self) -> None:
        safe_name(self.catalog_name, "catalog name")

    @property
    def base(self) -> Path:
        return Path(self.root) / self.catalog_name

    def stage_dir(self, stage: str, partition: str | None = None) -> Path:
        """Directory of ``stage`` (and ``partition``); created on demand.

        Raises:
            SymlinkRefusedError: the catalog's folder, the stage's or the partition's is a symbolic link (checked
                before anything is created; ``storage.guard.refuse_symlink``): every stage deletes and rewrites
                files in these folders, and through a link it would delete what the link points to.
        """
        path = self.base / safe_name(stage, "stage")
        if partition is not None:
            path = path / safe_name(partition)
        refuse_symlink(path, self.root)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def lock(self, stage: str, partition: str | None = None, wait_s: float = 0.0) -> Iterator[Path]:
        """Hold the lock of ``stage``'s folder (of ``partition``) for the block: ``<folder>/.<stage>.lock``
        (``storage.guard.stage_lock``); yields the folder. Every stage that writes or deletes holds it around its
        whole write, so two runs of one partition never delete each other's working files. ``wait_s``: how long to
        wait for another holder before refusing (0: refuse at once).

        Raises:
            PartitionBusyError: another process holds it.
            SymlinkRefusedError: the folder, one above it under the root, or the lock file is a symbolic link.
        """
        with stage_lock(self.stage_dir(stage, partition), stage, root=self.root, wait_s=wait_s) as folder:
            yield folder


@contextlib.contextmanager
def atomic_file(path: Path, durable: bool = False) -> Iterator[str]:
    """A temp file beside ``path`` (its parent is created) to write in the block; renamed over ``path`` with
    ``os.replace`` when the block ends without error, removed otherwise, so readers see the old file or the new one,
    never half of one. The one temp-then-rename write of the package.

    ``durable``: fsync the file before the rename and the directory after it, so the new file survives a power loss
    once the block has returned (training checkpoints); otherwise the page cache decides when it reaches the disk.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory; a filesystem that refuses fsync on a directory is skipped (the rename that
    preceded it is atomic either way)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


class AtomicParquetWriter:
    """Streams tables into one Parquet file (zstd) through a temp file beside ``path``; ``commit`` renames it onto
    ``path`` (``os.replace``: readers see the old file or the whole new one), ``abort`` drops it. The one streaming
    Parquet writer of the package.

    Row groups: with ``group_rows`` None each non-empty ``write`` is one row group; with ``group_rows`` the rows are
    regrouped into groups of exactly that many (the last one shorter), each one ``write_table`` of one combined
    table, as ``pq.write_table`` writes a table. Memory holds at most one group. A file nothing was written to holds
    one empty row group, as ``pq.write_table`` writes an empty table.

    Attributes:
        rows, groups: rows and row groups written so far.
        committed: ``commit`` has run.
    """

    def __init__(self, path: Path, schema: pa.Schema, group_rows: int | None = None):
        self.path, self.schema, self.group_rows = Path(path), schema, group_rows
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self._writer = pq.ParquetWriter(self.tmp, schema, compression="zstd")
        self._parts: list[pa.Table] = []
        self._buffered = 0
        self.rows = 0
        self.groups = 0
        self.committed = False

    def write(self, table: pa.Table) -> None:
        """Append ``table``'s rows (its schema must equal the writer's)."""
        if self.group_rows is None:
            if table.num_rows:
                self._write_group(table)
            return
        while table.num_rows:
            take = min(table.num_rows, self.group_rows - self._buffered)
            self._parts.append(table.slice(0, take))
            self._buffered += take
            table = table.slice(take)
            if self._buffered == self.group_rows:
                self._flush()

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        """Append Python rows (dicts keyed by column name)."""
        if rows:
            self.write(pa.Table.from_pylist(rows, schema=self.schema))

    def _write_group(self, table: pa.Table) -> None:
        self._writer.write_table(table, row_group_size=max(table.num_rows, 1))
        self.rows += table.num_rows
        self.groups += 1

    def _flush(self) -> None:
        self._write_group(pa.concat_tables(self._parts).combine_chunks() if self._parts
                          else self.schema.empty_table())
        self._parts, self._buffered = [], 0

    def commit(self) -> Path:
        """Write what is buffered, close the file and rename it onto ``path``; returns ``path``."""
        if self._buffered or not self.groups:
            self._flush()
        self._writer.close()
        os.replace(self.tmp, self.path)
        self.committed = True
        return self.path

    def abort(self) -> None:
        """Drop the temp file; does nothing after ``commit``, so a ``finally`` can call it on every writer."""
        if self.committed:
            return
        self._writer.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


def write_parquet_atomic(table: pa.Table, path: Path, **options: Any) -> Path:
    """Write ``table`` to ``path`` via a temp file + ``os.replace``; returns ``path``. ``options`` go to
    ``pyarrow.parquet.write_table`` (e.g. ``use_dictionary``); compression is zstd."""
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp, **{"compression": "zstd", **options})
    return Path(path)


def write_bytes_atomic(data: bytes, path: Path) -> Path:
    """Write ``data`` to ``path`` via a temp file + ``os.replace``; returns ``path``."""
    with atomic_file(path) as tmp:
        Path(tmp).write_bytes(data)
    return Path(path)


def write_json_atomic(obj: Any, path: Path) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    return Path(path)


def write_text_atomic(text: str, path: Path) -> Path:
    """Write ``text`` (UTF-8) to ``path`` via a temp file + ``os.replace``; returns ``path``."""
    with atomic_file(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return Path(path)


@contextlib.contextmanager
def atomic_files(paths: Sequence[Path]) -> Iterator[list[str]]:
    """Temp files beside each of ``paths`` (in the same order) to write in the block; when it ends without error
    each is renamed over its path (``os.replace``, in order), otherwise every one is removed. So a failure while
    any of them is written leaves all the previous files as they were: files read together (the draft vocab's
    arrays, a report and its figure) are never a mix of two runs because one write failed. Raises what the block
    or a rename raises (a rename failing part way replaces the earlier paths only)."""
    paths = [Path(p) for p in paths]
    tmps: list[str] = []
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            tmps.append(tmp)
        yield list(tmps)
        for tmp, path in zip(tmps, paths):
            os.replace(tmp, path)
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)


def write_npy_atomic(arrays: Mapping[Path, np.ndarray]) -> None:
    """Write each array to its path as ``.npy`` (``np.save``'s bytes, no pickles) through :func:`atomic_files`: all
    of them are renamed into place only once every one is written.

    A temp path is given to ``np.save`` as an open file, since ``np.save`` appends ``.npy`` to a name without it.
    Raises what ``np.save`` or the filesystem raise (``OSError``, ``ValueError`` for an object array); then no file
    is replaced and no temp file is left.
    """
    with atomic_files(list(arrays)) as tmps:
        for tmp, array in zip(tmps, arrays.values()):
            with open(tmp, "wb") as fh:
                np.save(fh, array, allow_pickle=False)


def shard_paths(directory: Path) -> list[Path]:
    """Completed shards ``shard-NNNNN.parquet`` in ``directory``, in order (temp files are ignored)."""
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if _SHARD.match(p.name))


def next_shard_path(directory: Path) -> Path:
    """Path of the next shard number after the existing ones."""
    existing = [int(_SHARD.match(p.name).group(1)) for p in shard_paths(directory)]
    return Path(directory) / f"shard-{(max(existing) + 1) if existing else 0:05d}.parquet"


def read_shards(directory: Path, columns: list[str] | None = None) -> pa.Table | None:
    """Concatenate every shard of ``directory`` (None when there is none)."""
    paths = shard_paths(directory)
    if not paths:
        return None
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in paths], promote_options="default")


def shard_row_count(directory: Path) -> int:
    """Rows in the shards of ``directory``, from the Parquet footers (no column is read)."""
    return sum(pq.read_metadata(p).num_rows for p in shard_paths(directory))


def read_done_ids(directory: Path, column: str = "sample_id") -> set[str]:
    """Sample ids already written to the shards of ``directory`` (the resume set)."""
    table = read_shards(directory, columns=[column])
    return set() if table is None else set(table.column(column).to_pylist())


def clear_shards(directory: Path, extra: Iterable[str] = ()) -> None:
    """Remove every shard (and the named extra files) of ``directory``: used by an explicit regenerate.

    Raises:
        SymlinkRefusedError: ``directory`` is a symbolic link (nothing is removed: the files are the link
            target's).
    """
    refuse_symlink(directory)
    for p in shard_paths(directory):
        p.unlink()
    for name in extra:
        q = Path(directory) / name
        if q.exists():
            q.unlink()
