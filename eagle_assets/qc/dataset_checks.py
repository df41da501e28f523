"""The blocking checks' figures of a whole dataset, from the QC rows of all its chunks.

A dataset split into chunks (catalog ``chunks: N``) is QC'd chunk by chunk: each ``qc_shards`` partition checks its
own rows. Its thresholds are the dataset's, so the figures that decide whether the dataset trains are taken over
the union of its chunks' ``rows.parquet`` (``qc.qc_pass.ROWS_SCHEMA``: one row per segmented generation, its
``drop_reason``, ``completion_tokens`` and ``finish_reason``). They are the figures the unchunked dataset's own
``qc_shards`` checks would compute, bit for bit: the same rows (chunks are disjoint, their union is the dataset),
the same counts, and the same exact length histogram (``figures.running.LengthHistogram``: ``statistics.median``
and the index rule for p10) judged by the same rules (``qc.thresholds``). Memory: one record batch of four
small columns at a time and one counter per token length, whatever the dataset's size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_assets.catalog import Thresholds
from eagle_assets.figures.running import LengthHistogram
from eagle_assets.qc.thresholds import Outcome, response_length_outcome, token_structure_outcome

COLUMNS = ["completion_tokens", "finish_reason", "kept", "drop_reason"]


@dataclass
class DatasetChecks:
    """``token_structure`` and ``response_length`` outcomes over every row of ``files``; ``rows`` generated rows
    checked, ``kept`` of them kept, ``reasons`` drop reason -> rows, ``rows_by_file`` rows per file."""

    token_structure: Outcome
    response_length: Outcome
    rows: int = 0
    kept: int = 0
    reasons: Counter = field(default_factory=Counter)
    rows_by_file: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Both checks passed (a WARN finding passes) and at least one row is kept."""
        return self.token_structure.passed and self.response_length.passed and self.kept > 0


def dataset_checks(rows_files: Sequence[Path], thresholds: Thresholds, batch_rows: int = 65536) -> DatasetChecks:
    """The two blocking checks over the QC rows of ``rows_files`` (every chunk's ``rows.parquet``).

    ``thresholds``: the dataset's ``Thresholds`` (or its ``model_dump()``). Raises ``FileNotFoundError`` for a
    missing file (a chunk without QC yet: the caller says which) and ``OSError`` / ``pyarrow`` errors for an
    unreadable one.
    """
    hist = LengthHistogram()
    reasons: Counter = Counter()
    truncated = kept = 0
    by_file: dict[str, int] = {}
    for path in rows_files:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: materialize qc_shards for that partition first")
        n_file = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=COLUMNS):
            hist.add_many(batch.column(0).to_numpy(zero_copy_only=False))
            truncated += int(pc.sum(pc.equal(batch.column(1), "length")).as_py() or 0)
            kept += int(pc.sum(batch.column(2)).as_py() or 0)
            counts = pc.value_counts(batch.column(3).drop_null()).flatten() if batch.num_rows else None
            if counts is not None:
                reasons.update(dict(zip(counts[0].to_pylist(), counts[1].to_pylist())))
            n_file += batch.num_rows
        by_file[str(path)] = n_file
    n = hist.n
    short = thresholds.short_tokens
    if n:
        length = response_length_outcome(n, hist.median(), hist.index_quantile(0.1), hist.below(short), truncated,
                                         thresholds)
    else:
        length = response_length_outcome(0, 0.0, 0.0, 0, 0, thresholds)
    structure = token_structure_outcome(n, reasons, thresholds)
    return DatasetChecks(structure, length, rows=n, kept=kept, reasons=reasons, rows_by_file=by_file)
