"""One streaming QC pass over a partition's generations: record batches in, bounded training shards out.

``qc_partition`` is the body of the ``qc_shards`` asset (``assets.qc``) without Dagster, so the bench and the tests
run the same code. Generations are read shard by shard in record batches of ``batch_rows`` rows, segmented by
``segment_batch.segment_batch`` (the vectorised ``segment_row``), and the kept rows (``input_ids = prompt_ids +
output_ids``, ``loss_mask`` 0 over the prompt, 1 over the output) are written to ``shard-NNNNN.parquet`` files of at
most ``rows_per_shard`` rows and about ``bytes_per_shard`` bytes of Arrow data each, every one atomically (temp file +
``os.replace``), streamed row group by row group; ``rows.parquet`` (one small row per generated row, for the
checks and the length report) is written as it goes through one Parquet writer and renamed at the end. Memory: one
record batch, a few row groups of the prompts (``tokenized_prompts.prompts_file.PromptsFile``; a table passed in is
held whole), per prompt its sample id, and per generated row a few bytes of figures (drop code, lengths) plus its
sample id (for the duplicate rule), independent of the number of output tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_assets.catalog import Thresholds
from eagle_assets.qc.segment_batch import FLAG_BIT, FLAG_ORDER, KEPT, list_parts, segment_batch
from eagle_assets.storage.guard import refuse_symlink
from eagle_assets.storage.shards import AtomicParquetWriter, shard_paths
from eagle_assets.structure.segment import DROP_REASONS, FLAGS
from eagle_assets.tokenized_prompts.prompts_file import PromptsFile

QC_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("n_prompt_tokens", pa.int32()),
        ("reasoning_tokens", pa.int32()),
        ("answer_tokens", pa.int32()),
        ("tool_call_tokens", pa.int32()),
        ("flags", pa.list_(pa.string())),
    ]
)
ROWS_SCHEMA = pa.schema(
    [
        ("partition", pa.string()),
        ("sample_id", pa.string()),
        ("completion_tokens", pa.int32()),
        ("reasoning_tokens", pa.int32()),
        ("answer_tokens", pa.int32()),
        ("tool_call_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("max_new_tokens", pa.int32()),
        ("kept", pa.bool_()),
        ("short", pa.bool_()),
        ("drop_reason", pa.string()),
    ]
)
# Rows QC does not segment, counted beside DROP_REASONS: generated from a prompt that is no longer in the partition,
# or a second row of a sample id that already has one (two producers wrote the same sample).
QC_SKIP_REASONS: tuple[str, ...] = ("stale_prompt", "duplicate_row")
ROWS_PER_SHARD = 100_000
BYTES_PER_SHARD = 256 * 1024 * 1024  # Arrow bytes of one shard's rows (input_ids + loss_mask dominate)
BATCH_ROWS = 4096
_FLAG_LISTS = [[f for f in FLAG_ORDER if bits & FLAG_BIT[f]] for bits in range(1 << len(FLAGS))]


@dataclass
class QcSummary:
    """What one pass found: counts, per-row figures (numpy, one entry per segmented row, in row order) and files.

    ``drop_code``: int8 (``segment_batch.KEPT`` or an index into ``DROP_REASONS``); ``completion_tokens``,
    ``reasoning_tokens``, ``answer_tokens``: int32 tokens; ``finish_reasons``: finish reason (str or None) -> rows
    (counts, not one entry per row); ``reasons``: drop reason / skip reason -> rows; ``flags``: flag -> rows;
    ``shards``: QC shard paths written.
    """

    rows: int = 0
    kept: int = 0
    short: int = 0
    reasons: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)
    drop_code: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    completion_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    reasoning_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    answer_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    finish_reasons: Counter = field(default_factory=Counter)
    shards: list[Path] = field(default_factory=list)
    output_tokens: int = 0

    def count(self, seg, finish: pa.Array, short: np.ndarray, kept: int) -> None:
        """Add one segmented batch's finish reasons, kept and short rows, output tokens, drop reasons and flags."""
        self.finish_reasons.update(dict(zip(*(c.to_pylist() for c in pc.value_counts(finish).flatten()))))
        self.kept += kept
        self.short += int(short.sum())
        self.output_tokens += int(seg.completion_tokens.sum(dtype=np.int64))
        for c, k in zip(*np.unique(seg.drop_code[~seg.kept], return_counts=True)):
            self.reasons[DROP_REASONS[c]] += int(k)
        self.flags.update({f: k for f, k in seg.flag_counts().items() if k})

    def drop_reasons(self) -> list[str | None]:
        return [None if c < 0 else DROP_REASONS[c] for c in self.drop_code.tolist()]

    def response_length(self, thresholds: Thresholds):
        """The ``response_length`` outcome of every segmented row, the figures of
        ``qc.thresholds.evaluate_response_length`` (same median, p10, share under ``short_tokens``, share
        truncated) from an exact length histogram and the finish-reason counts, without a list per row."""
        from eagle_assets.figures.running import LengthHistogram
        from eagle_assets.qc.thresholds import response_length_outcome

        n = int(self.completion_tokens.size)
        if not n:
            return response_length_outcome(0, 0.0, 0.0, 0, 0, thresholds)
        short = thresholds.short_tokens
        hist = LengthHistogram()
        hist.add_many(self.completion_tokens)
        return response_length_outcome(n, float(hist.median()), hist.index_quantile(0.1), hist.below(short),
                                       self.finish_reasons["length"], thresholds)


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat indices ``[s, s+1, ..., s+len-1]`` of every (start, length), concatenated (int64)."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(total, dtype=np.int64)


def training_rows(sample_ids: pa.Array, prompt_ids: pa.Array, output_ids: pa.Array, seg, keep: np.ndarray) -> pa.Table:
    """``QC_SCHEMA`` rows of the ``keep`` rows (indices): ``input_ids = prompt_ids + output_ids`` (int32),
    ``loss_mask`` 0 over the prompt and 1 over the output (int8), spans and flags from ``seg``."""
    p_vals, p_off, _ = list_parts(prompt_ids)
    o_vals, o_off, _ = list_parts(output_ids)
    lp = (p_off[1:] - p_off[:-1])[keep]
    lo = (o_off[1:] - o_off[:-1])[keep]
    new_off = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(lp + lo, out=new_off[1:])
    values = np.empty(int(new_off[-1]), dtype=np.int32)
    mask = np.ones(len(values), dtype=np.int8)
    dest = _ragged(new_off[:-1], lp)
    values[dest] = p_vals[_ragged(p_off[:-1][keep], lp)]
    mask[dest] = 0
    values[_ragged(new_off[:-1] + lp, lo)] = o_vals[_ragged(o_off[:-1][keep], lo)]
    if len(new_off) and new_off[-1] >= 2**31:
        raise ValueError("one QC batch holds 2**31 tokens or more: lower batch_rows")
    offsets = pa.array(new_off.astype(np.int32))
    return pa.Table.from_arrays([
        sample_ids.take(pa.array(keep)),
        pa.ListArray.from_arrays(offsets, pa.array(values)),
        pa.ListArray.from_arrays(offsets, pa.array(mask)),
        pa.array(lp.astype(np.int32)),
        pa.array(seg.reasoning_tokens[keep]),
        pa.array(seg.answer_tokens[keep]),
        pa.array(seg.tool_call_tokens[keep]),
        pa.array([_FLAG_LISTS[b] for b in seg.flags[keep].tolist()], type=pa.list_(pa.string())),
    ], schema=QC_SCHEMA)


class ShardWriter:
    """Writes ``shard-NNNNN.parquet`` files of at most ``rows_per_shard`` rows and about ``bytes_per_shard`` Arrow
    bytes each. Tables are streamed into the open shard (one Parquet row group per ``add``) through a temp file that
    is renamed into place when the shard is full (``os.replace``: readers never see a partial shard), so memory
    holds one table, not one shard. ``close`` finishes the last shard (an empty ``shard-00000`` when nothing was
    written, so readers always find one) and removes shards of an earlier, longer pass."""

    def __init__(self, out_dir: Path, schema: pa.Schema, rows_per_shard: int = ROWS_PER_SHARD,
                 bytes_per_shard: int = BYTES_PER_SHARD):
        if rows_per_shard < 1 or bytes_per_shard < 1:
            raise ValueError(f"rows_per_shard and bytes_per_shard must be >= 1, got {rows_per_shard}, "
                             f"{bytes_per_shard}")
        self.out_dir, self.schema = Path(out_dir), schema
        self.rows_cap, self.bytes_cap = rows_per_shard, bytes_per_shard
        self._shard: AtomicParquetWriter | None = None
        self._rows = self._bytes = 0
        self.written: list[Path] = []

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        per_row = max(table.nbytes / table.num_rows, 1.0)  # Arrow bytes per row of this table (an estimate)
        while table.num_rows:
            # rows that fit both budgets, at least one (a single row over the byte cap is a shard of its own)
            room = max(1, min(self.rows_cap - self._rows, int((self.bytes_cap - self._bytes) / per_row)))
            head, table = table.slice(0, room), table.slice(room)
            self._open().write(head)
            self._rows += head.num_rows
            self._bytes += int(head.num_rows * per_row)
            if self._rows >= self.rows_cap or self._bytes >= self.bytes_cap:
                self._finish()

    def _open(self) -> AtomicParquetWriter:
        if self._shard is None:
            self._shard = AtomicParquetWriter(self.out_dir / f"shard-{len(self.written):05d}.parquet", self.schema)
        return self._shard

    def _finish(self) -> None:
        self.written.append(self._open().commit())
        self._shard, self._rows, self._bytes = None, 0, 0

    def close(self) -> list[Path]:
        if self._shard is not None or not self.written:
            self._finish()
        keep = set(self.written)
        for old in shard_paths(self.out_dir):
            if old not in keep:
                old.unlink()
        return self.written

    def abort(self) -> None:
        """Drop the shard being written (its temp file); finished shards stay."""
        if self._shard is not None:
            self._shard.abort()
            self._shard = None


def qc_partition(
    generation_shards: list[Path],
    prompts: "pa.Table | PromptsFile",
    out_dir: Path,
    profile,
    *,
    partition: str,
    blank_ids: Collection[int],
    vocab_size: int | None,
    control_ids: Collection[int] | None,
    tool_call_in_reasoning: str = "drop",
    short_tokens: int = 300,
    max_new_tokens: int | None = None,
    rows_per_shard: int = ROWS_PER_SHARD,
    bytes_per_shard: int = BYTES_PER_SHARD,
    batch_rows: int = BATCH_ROWS,
) -> QcSummary:
    """Segment every generations row of ``generation_shards`` against ``prompts`` and write the QC shards.

    Args:
        generation_shards: Parquet files of ``generation.GENERATION_SCHEMA`` rows (other producers' columns and
            types are accepted: ``segment_batch`` falls back to the reference for odd types).
        prompts: ``tokenized_prompts`` rows as a ``tokenized_prompts.prompts_file.PromptsFile`` (read a row group at
            a time) or a table: ``sample_id``, ``prompt_ids`` (list of int) and, when present, ``prompt_opens_think``
            (bool; absent = ``target_model.render.opens_think_block`` of the ids).
        out_dir: where ``shard-NNNNN.parquet`` (``QC_SCHEMA``) and ``rows.parquet`` (``ROWS_SCHEMA``) go.
        profile, blank_ids, vocab_size, control_ids, tool_call_in_reasoning: as in ``segment_row``.
        short_tokens: a kept row with fewer output ids is counted ``short``; max_new_tokens: the partition's cap,
            written to ``rows.parquet``.
    Returns: a ``QcSummary``. Raises ``OSError`` for unreadable files (a broken shard is not skipped silently),
    ``SymlinkRefusedError`` when ``out_dir`` is a symbolic link (its stale shards are deleted: they would be the
    link target's files).
    """
    out_dir = refuse_symlink(Path(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(prompts, pa.Table):
        prompts = PromptsFile.from_table(prompts)
    summary = QcSummary()
    codes, n_out, reasoning, answer = [], [], [], []
    seen: set[str] = set()
    rules = dict(tool_call_in_reasoning=tool_call_in_reasoning, blank_ids=blank_ids, vocab_size=vocab_size,
                 control_ids=control_ids)
    shards = ShardWriter(out_dir, QC_SCHEMA, rows_per_shard, bytes_per_shard)
    rows_out = AtomicParquetWriter(out_dir / "rows.parquet", ROWS_SCHEMA)
    try:
        for path in generation_shards:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
                picked = _new_rows(batch, prompts.index, seen, summary)
                if picked is None:
                    continue
                sub, sid_col, pidx = picked
                pcol = prompts.take(pidx)
                seg = segment_batch(sub, profile, prompt_opens_think=_opens(prompts, pidx, pcol, profile),
                                    prompt_ids=pcol, **rules)
                short = seg.kept & (seg.completion_tokens < short_tokens)
                finish = _finish_reasons(sub)
                rows_out.write(_rows_table(partition, sid_col, seg, finish, short, max_new_tokens))
                keep = np.flatnonzero(seg.kept)
                if len(keep):
                    shards.add(training_rows(sid_col, pcol, sub.column("output_ids").combine_chunks(), seg, keep))
                codes.append(seg.drop_code)
                n_out.append(seg.completion_tokens)
                reasoning.append(seg.reasoning_tokens)
                answer.append(seg.answer_tokens)
                summary.count(seg, finish, short, len(keep))
        summary.shards = shards.close()
        rows_out.commit()
    finally:
        shards.abort()
        rows_out.abort()
    cat = (lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dtype=dt))
    summary.drop_code = cat(codes, np.int8)
    summary.completion_tokens = cat(n_out, np.int32)
    summary.reasoning_tokens = cat(reasoning, np.int32)
    summary.answer_tokens = cat(answer, np.int32)
    summary.rows = len(summary.drop_code)
    assert summary.kept == int((summary.drop_code == KEPT).sum())
    return summary


def _new_rows(batch: pa.RecordBatch, index: dict[str, int], seen: set[str], summary: QcSummary):
    """The rows of ``batch`` that are this partition's and not seen before: ``(rows table, their sample ids,
    their prompts' positions int64 [n])``, or None when there is none. Rows of an older prompt set count as
    ``stale_prompt``, repeats as ``duplicate_row`` (one training row per sample, whoever wrote the shards)."""
    names = batch.schema.names
    sids = batch.column(names.index("sample_id")).to_pylist() if "sample_id" in names else [None] * batch.num_rows
    take, pidx = [], []
    for j, sid in enumerate(sids):
        p = index.get(sid)
        if p is None:
            summary.reasons["stale_prompt"] += 1
        elif sid in seen:
            summary.reasons["duplicate_row"] += 1
        else:
            seen.add(sid)
            take.append(j)
            pidx.append(p)
    if not take:
        return None
    sub = pa.Table.from_batches([batch]).take(pa.array(take, type=pa.int64()))
    return sub, pa.array([sids[j] for j in take], type=pa.string()), np.array(pidx, dtype=np.int64)


def _opens(prompts: PromptsFile, pidx: np.ndarray, pcol: pa.Array, profile) -> np.ndarray:
    """Whether each picked prompt opens a reasoning block (bool [n]): the stored flag, or, where an older
    ``tokenized_prompts`` has none (-1), the renderer's rule on the prompt's ids."""
    opens = prompts.opens[pidx]
    unknown = np.flatnonzero(opens < 0)
    if len(unknown):
        from eagle_assets.target_model.render import opens_think_block

        opens[unknown] = [opens_think_block(p, profile) for p in pcol.take(pa.array(unknown)).to_pylist()]
    return opens.astype(bool)


def _finish_reasons(sub: pa.Table) -> pa.Array:
    """The rows' ``finish_reason`` as one string array (null where absent or not a string)."""
    finish = sub.column("finish_reason") if "finish_reason" in sub.schema.names else pa.nulls(sub.num_rows, pa.string())
    finish = finish.combine_chunks()
    if not pa.types.is_string(finish.type):
        finish = pa.array([v if isinstance(v, str) else None for v in finish.to_pylist()], type=pa.string())
    return finish


def _rows_table(partition: str, sid_col: pa.Array, seg, finish: pa.Array, short: np.ndarray,
                max_new_tokens: int | None) -> pa.Table:
    """One ``rows.parquet`` batch (``ROWS_SCHEMA``): every picked row's lengths, finish reason, cap and verdict."""
    n = len(sid_col)
    drop_names = pa.array([None if c < 0 else DROP_REASONS[c] for c in seg.drop_code.tolist()], type=pa.string())
    return pa.Table.from_arrays([
        pa.array([partition] * n, type=pa.string()), sid_col, pa.array(seg.completion_tokens),
        pa.array(seg.reasoning_tokens), pa.array(seg.answer_tokens), pa.array(seg.tool_call_tokens),
        finish, pa.array([max_new_tokens] * n, type=pa.int32()), pa.array(seg.kept), pa.array(short), drop_names,
    ], schema=ROWS_SCHEMA)
