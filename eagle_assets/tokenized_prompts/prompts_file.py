"""Lazy reading of a ``tokenized_prompts`` file: its sample-id index, and the prompt ids of given rows.

``generations`` (the requests and the live monitor) and ``qc_shards`` (the join of each generated row with its
prompt) both need a partition's prompt ids, which are the largest thing a partition has before generation (~4 bytes
per prompt token in Arrow, ~36 as Python ints). ``PromptsFile`` never holds them all: it keeps the small columns
(``sample_id`` -> row index, ``prompt_opens_think``) and reads ``prompt_ids`` one Parquet row group at a time,
caching the last few row groups it read. ``tokenized_prompts`` writes row groups of ``PROMPT_ROW_GROUP_ROWS`` rows,
and generations arrive in about prompt order (the client takes prompts in file order), so a batch of generated rows
touches one or two row groups. Files of older versions (one row group) still work; they are read whole once.

Memory: per prompt its sample id string and an int (about 100-150 bytes), plus ``cache_groups`` row groups.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PROMPT_ROW_GROUP_ROWS = 4096


class PromptsFile:
    """One ``tokenized_prompts`` Parquet file (``sample_id``, ``prompt_ids`` list<int32>, optional
    ``prompt_opens_think``), read lazily.

    Attributes:
        path: the file; ``rows``: its row count; ``index``: sample id -> row (the first row of a repeated id);
        ``opens``: ``prompt_opens_think`` per row (int8 ndarray [rows]: 1, 0, or -1 where the file has no value).
    Raises: ``OSError`` / ``pyarrow.ArrowInvalid`` for a missing or unreadable file.
    """

    def __init__(self, path: Path | None, cache_groups: int = 4, *, _table: pa.Table | None = None):
        self.path = None if path is None else Path(path)
        self._table = _table
        if _table is None:
            self._pf = pq.ParquetFile(self.path)
            meta = self._pf.metadata
            sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            schema = self._pf.schema_arrow
        else:  # an in-memory table (tests, the bench): one "row group"
            self._pf, sizes, schema = None, [_table.num_rows], _table.schema
        self.rows = int(sum(sizes))
        self._ids_type = schema.field("prompt_ids").type
        self._group_start = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self._group_start[1:])
        small = ["sample_id"] + (["prompt_opens_think"] if "prompt_opens_think" in schema.names else [])
        table = self._pf.read(columns=small) if _table is None else _table.select(small)
        self.sample_ids: list[str] = table.column("sample_id").to_pylist()
        self.index: dict[str, int] = {}
        for i, sid in enumerate(self.sample_ids):
            self.index.setdefault(sid, i)
        # 1 / 0, or -1 where unknown (tokenized by a version without the column): callers apply opens_think_block
        self.opens = np.full(self.rows, -1, dtype=np.int8)
        if "prompt_opens_think" in small:
            col = table.column("prompt_opens_think")
            known = col.is_valid().to_numpy(zero_copy_only=False)
            self.opens[known] = col.fill_null(False).to_numpy(zero_copy_only=False)[known].astype(np.int8)
        self._cache: OrderedDict[int, pa.Array] = OrderedDict()
        self._flat: dict[int, tuple] = {}  # the last row group ids_of read: (array, flat values, offsets)
        self._cache_groups = max(1, int(cache_groups))

    @classmethod
    def from_table(cls, table: pa.Table) -> "PromptsFile":
        """The same interface over a table already in memory (``sample_id``, ``prompt_ids``[,
        ``prompt_opens_think``])."""
        return cls(None, _table=table)

    def __len__(self) -> int:
        return self.rows

    def _group(self, g: int) -> pa.Array:
        hit = self._cache.get(g)
        if hit is not None:
            self._cache.move_to_end(g)
            return hit
        if self._pf is None:
            arr = self._table.column("prompt_ids").combine_chunks()
        else:
            arr = self._pf.read_row_group(g, columns=["prompt_ids"]).column(0).combine_chunks()
        self._cache[g] = arr
        if len(self._cache) > self._cache_groups:
            self._cache.popitem(last=False)
        return arr

    def take(self, rows: np.ndarray) -> pa.Array:
        """``prompt_ids`` of the file rows ``rows`` (int array, any order, repeats allowed), in that order, as one
        list array (the file's list type)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return pa.array([], type=self._ids_type)
        groups = np.searchsorted(self._group_start, rows, side="right") - 1
        order = np.argsort(groups, kind="stable")
        parts = []
        for g in np.unique(groups):
            sel = order[groups[order] == g]
            local = rows[sel] - self._group_start[g]
            parts.append((sel, self._group(int(g)).take(pa.array(local))))
        if len(parts) == 1:
            return parts[0][1]
        joined = pa.concat_arrays([p for _, p in parts])
        positions = np.concatenate([s for s, _ in parts])
        inverse = np.empty_like(positions)
        inverse[positions] = np.arange(len(positions))
        return joined.take(pa.array(inverse))

    def ids_of(self, sid: str) -> list[int] | None:
        """Prompt ids of one sample id (None when it is not in the file): one row group read at most."""
        ids = self.ids_array_of(sid)
        return None if ids is None else ids.tolist()

    def ids_array_of(self, sid: str) -> np.ndarray | None:
        """``ids_of`` as a 1-d integer numpy slice of the cached row group (the file's int type, no copy: do not
        write to it): what the live monitor segments, with no Python ints in between."""
        i = self.index.get(sid)
        if i is None:
            return None
        g = int(np.searchsorted(self._group_start, i, side="right") - 1)
        flat = self._flat.get(g)
        if flat is None or self._group(g) is not flat[0]:
            arr = self._group(g)
            # numpy's tolist is ~30x faster than a ListScalar's as_py for a few hundred ids
            flat = (arr, arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy())
            self._flat = {g: flat}
        j = i - int(self._group_start[g])
        if flat[0].null_count and not flat[0][j].is_valid:  # a null prompt_ids value
            return None
        return flat[1][flat[2][j]:flat[2][j + 1]]

    def ids_arrays_of(self, sids: list[str]) -> list[np.ndarray | None]:
        """``ids_array_of`` of many sample ids at once (one lookup of their row groups): the live monitor's call
        when it segments its queued rows."""
        rows = [self.index.get(sid) for sid in sids]
        out: list[np.ndarray | None] = [None] * len(rows)
        known = [k for k, i in enumerate(rows) if i is not None]
        if not known:
            return out
        idx = np.array([rows[k] for k in known], dtype=np.int64)
        groups = np.searchsorted(self._group_start, idx, side="right") - 1
        for g in np.unique(groups).tolist():
            arr = self._group(g)
            values, offsets = arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy()
            sel = np.flatnonzero(groups == g)
            local = idx[sel] - self._group_start[g]
            valid = arr.is_valid().to_numpy(zero_copy_only=False)[local].tolist() if arr.null_count else None
            for n, (k, lo, hi) in enumerate(zip(sel.tolist(), offsets[local].tolist(), offsets[local + 1].tolist())):
                if valid is None or valid[n]:
                    out[known[k]] = values[lo:hi]
        return out

    def iter_prompts(self, batch_rows: int = PROMPT_ROW_GROUP_ROWS) -> Iterator[tuple[str, list[int]]]:
        """``(sample_id, prompt_ids)`` of every row in file order; one record batch of Python lists at a time."""
        batches = (self._table.select(["sample_id", "prompt_ids"]).to_batches(max_chunksize=batch_rows)
                   if self._pf is None else
                   self._pf.iter_batches(batch_size=batch_rows, columns=["sample_id", "prompt_ids"]))
        for batch in batches:
            yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())

    def ids_map(self, arrays: bool = False) -> Mapping[str, list[int] | np.ndarray]:
        """A read-only mapping sample id -> prompt ids over the file (``ids_of`` per lookup; with ``arrays``,
        ``ids_array_of``: numpy views, for the live monitor)."""
        return _Lookup(self, self.ids_array_of, many=self.ids_arrays_of) if arrays else _Lookup(self, self.ids_of)

    def opens_map(self, profile: Any) -> Mapping[str, bool]:
        """A read-only mapping sample id -> ``prompt_opens_think``; where the file has no value, the renderer's
        rule (``target_model.render.opens_think_block``) over the prompt ids with ``profile``."""
        def opens(sid: str) -> bool | None:
            i = self.index.get(sid)
            if i is None:
                return None
            if self.opens[i] >= 0:
                return bool(self.opens[i])
            from eagle_assets.target_model.render import opens_think_block

            return opens_think_block(self.ids_of(sid), profile)

        return _Lookup(self, opens)


class _Lookup(Mapping):
    def __init__(self, prompts: PromptsFile, get_one, many=None):
        self._prompts, self._get_one = prompts, get_one
        if many is not None:
            self.get_many = many  # values of many keys at once (None where missing), for the live monitor

    def __getitem__(self, sid: str):
        value = self._get_one(sid)
        if value is None:
            raise KeyError(sid)
        return value

    def get(self, sid, default=None):
        value = self._get_one(sid)
        return default if value is None else value

    def __contains__(self, sid) -> bool:
        return sid in self._prompts.index

    def __iter__(self):
        return iter(self._prompts.index)

    def __len__(self) -> int:
        return len(self._prompts.index)
