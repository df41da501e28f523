"""One streaming pass ``raw_prompts`` -> ``tokenized_prompts``: record batches in, bounded row groups out.

``tokenize_partition`` is the body of the ``tokenized_prompts`` asset (``assets.prompts``) without Dagster, so the
bench and the tests run the same code. The raw prompts file is read ``batch_rows`` records at a time; each batch is
rendered by ``target_model.render.render_prompts`` (batched ``apply_chat_template`` calls, the texts tokenized in
one batch encode) and written as one row group of ``prompts.parquet`` (``TOKENIZED_SCHEMA``) through one Parquet
writer to a temp file that is renamed into place at the end, so readers see the old file or the whole new one.
Rejected records go to ``rejects.parquet`` the same way. The row groups are what
``tokenized_prompts.prompts_file.PromptsFile`` reads one at a time downstream (generation requests, the live
monitor, QC's join).

In one process the pass runs as a two-stage pipeline: this thread renders batch k+1 through the chat template
(Python, holding the GIL) while a second thread batch-encodes batch k (Rust, without the GIL) and finishes it.
On machines with ``MIN_CPUS_FOR_WORKERS`` or more CPUs, batches are rendered by ``workers`` spawned processes when
the partition is large enough to repay their start-up (``default_workers``: one per CPU, from
``MIN_RECORDS_PER_WORKER`` records each), each holding the tokenizer it was sent once. Either way results are
written in file order, so the files are the same whatever ``workers`` is (``_render_texts`` + ``_finish_batch``
are the one code path; a test compares them). Measured in ``bench/bench_render.py``.

Memory: at most ``2 * workers`` (one process: 2) batches of records and their rendered ids, plus a length
histogram; independent of the partition's size.
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.figures.running import LengthHistogram
from eagle_assets.raw_prompts.rows import REJECT_SCHEMA
from eagle_assets.storage.shards import AtomicParquetWriter
from eagle_assets.tokenized_prompts.prompts_file import PROMPT_ROW_GROUP_ROWS

TOKENIZED_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("n_prompt_tokens", pa.int32()),
        ("template_hash", pa.string()),
        ("prompt_opens_think", pa.bool_()),
        ("render_flags", pa.string()),
    ]
)


@dataclass
class TokenizeSummary:
    """What one pass wrote: ``rows`` prompts, ``rejected`` records by ``reasons``, ``opens_think`` prompts that
    open a reasoning block, ``template_hash`` (of the first prompt), ``lengths`` (prompt tokens), ``batches``."""

    rows: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)
    opens_think: int = 0
    template_hash: str = ""
    lengths: LengthHistogram = field(default_factory=LengthHistogram)
    max_tokens: int = 0
    batches: int = 0

    @property
    def median_tokens(self) -> int:
        """The upper middle prompt length (``sorted(lengths)[n // 2]``); 0 when empty."""
        return self.lengths.at(self.rows // 2) if self.rows else 0


def _turn_one(messages: list) -> list:
    from eagle_assets.tokenized_prompts.walk import first_turn_messages

    return first_turn_messages(messages)


@dataclass
class _RenderSettings:
    """What every batch is rendered with (sent once to each worker process)."""

    tokenizer: Any
    profile: Any
    enable_thinking: bool | None
    max_prompt_tokens: int | None
    first_turn: bool


@dataclass
class _BatchResult:
    """One rendered batch: its ``prompts`` (TOKENIZED_SCHEMA) and ``rejects`` (REJECT_SCHEMA) tables, the prompt
    lengths (int64), the reject reasons, how many prompts open a reasoning block, the first prompt's template hash."""

    prompts: pa.Table
    rejects: pa.Table
    lengths: np.ndarray
    reasons: Counter
    opens_think: int
    template_hash: str


def _render_texts(settings: _RenderSettings, batch: pa.RecordBatch) -> tuple[list[dict], list[Any]]:
    """First half of one batch (Python, holds the GIL): its records and ``render.render_texts_batch`` of them."""
    from eagle_assets.target_model.render import render_texts_batch

    records = batch.to_pylist()  # one bounded batch of records, never the partition
    return records, render_texts_batch(
        settings.tokenizer,
        [(_turn_one(json.loads(r["messages"])) if settings.first_turn else json.loads(r["messages"]),
          json.loads(r["tools"]) if r["tools"] else None) for r in records],
        enable_thinking=settings.enable_thinking)


def _render_batch(settings: _RenderSettings, batch: pa.RecordBatch) -> _BatchResult:
    """Render one record batch (RAW_SCHEMA) into its output tables: the one code path of every pass."""
    return _finish_batch(settings, *_render_texts(settings, batch))


def _finish_batch(settings: _RenderSettings, records: list[dict], texts: list[Any]) -> _BatchResult:
    """Second half of one batch: the batch encode (``render.finish_rendered``; the GIL is released while the Rust
    tokenizer runs), the id-level checks and the output tables."""
    from eagle_assets.target_model.render import RenderError, finish_rendered

    results = finish_rendered(settings.tokenizer, texts, enable_thinking=settings.enable_thinking,
                              max_prompt_tokens=settings.max_prompt_tokens, profile=settings.profile)
    rows, bad = [], []
    reasons: Counter = Counter()
    opens = 0
    t_hash = ""
    for r, rendered in zip(records, results):
        if isinstance(rendered, RenderError):
            bad.append({"source_file": r["source_file"], "source_row": r["source_row"],
                        "source_line": r["source_row"] + 1, "sample_id": r["sample_id"], "reason": rendered.reason,
                        "detail": str(rendered)[:1000]})
            reasons[rendered.reason] += 1
            continue
        ids = rendered.prompt_ids
        rows.append({
            "sample_id": r["sample_id"],
            "prompt_ids": ids,
            "n_prompt_tokens": len(ids),
            "template_hash": rendered.template_hash,
            # the renderer's rule (render.opens_think_block), never a second one: QC, live quality and
            # the client read this column
            "prompt_opens_think": rendered.opens_think,
            "render_flags": json.dumps(rendered.flags, sort_keys=True, default=str),
        })
        opens += bool(rendered.opens_think)
        t_hash = t_hash or rendered.template_hash
    return _BatchResult(prompts=pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA),
                        rejects=pa.Table.from_pylist(bad, schema=REJECT_SCHEMA),
                        lengths=np.fromiter((row["n_prompt_tokens"] for row in rows), dtype=np.int64,
                                            count=len(rows)),
                        reasons=reasons, opens_think=opens, template_hash=t_hash)


_WORKER_SETTINGS: _RenderSettings | None = None


def _worker_init(settings: _RenderSettings) -> None:
    global _WORKER_SETTINGS
    # one Python thread per worker: the workers, not the tokenizer's Rust thread pool, share out the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_SETTINGS = settings


def _worker_render(batch: pa.RecordBatch) -> _BatchResult:
    assert _WORKER_SETTINGS is not None, "worker started without _worker_init"
    return _render_batch(_WORKER_SETTINGS, batch)


# Below this many records one process is faster: starting a worker (a fresh interpreter importing transformers
# and unpickling the tokenizer) costs a few seconds, about what one process renders ~4-8k prompts in.
MIN_RECORDS_PER_WORKER = 8192


# Below this many CPUs the one-process pass (rendering and encoding overlapped on two threads) fills the machine;
# measured on 2 cores (bench/bench_render.py): 2 spawned workers rendered slower than it at 16k-20k records.
MIN_CPUS_FOR_WORKERS = 4


def default_workers(n_records: int, batch_rows: int = PROMPT_ROW_GROUP_ROWS, cpus: int | None = None) -> int:
    """Worker processes for a pass over ``n_records``: 1 (this process, pipelined) on fewer than
    ``MIN_CPUS_FOR_WORKERS`` CPUs, else one per CPU this process may run on (at most 8), no more than there are
    batches, and 1 below ``MIN_RECORDS_PER_WORKER`` records per worker."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus < MIN_CPUS_FOR_WORKERS:
        return 1
    batches = -(-n_records // max(1, batch_rows))
    return max(1, min(cpus, 8, batches, n_records // MIN_RECORDS_PER_WORKER))


def _rendered_batches(raw_path: Path, settings: _RenderSettings, batch_rows: int, workers: int
                      ) -> Iterator[_BatchResult]:
    """The rendered batches of ``raw_path`` in file order, from this process (``workers`` 1) or from a pool of
    ``workers`` spawned processes with at most ``2 * workers`` batches in flight (bounded memory)."""
    batches = pq.ParquetFile(raw_path).iter_batches(batch_size=batch_rows)
    if workers <= 1:
        # two stages on two threads: this one renders batch k+1 (jinja, GIL-bound) while the other encodes batch k
        # (Rust, without the GIL) and finishes it, so rendering and encoding overlap on two cores
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as encoder:
            pending = None
            for batch in batches:
                staged = _render_texts(settings, batch)
                if pending is not None:
                    yield pending.result()
                pending = encoder.submit(_finish_batch, settings, *staged)
            if pending is not None:
                yield pending.result()
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the asset runs inside Dagster's (threaded) process, and the tokenizer's Rust thread pool
    # must not be inherited mid-use
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init, initargs=(settings,)) as pool:
        in_flight: deque = deque()
        for batch in batches:
            in_flight.append(pool.submit(_worker_render, batch))
            if len(in_flight) >= 2 * workers:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()


def tokenize_partition(
    raw_path: Path,
    out_dir: Path,
    tokenizer: Any,
    profile: Any,
    *,
    enable_thinking: bool | None = None,
    max_prompt_tokens: int | None = None,
    batch_rows: int = PROMPT_ROW_GROUP_ROWS,
    first_turn: bool = False,
    workers: int | None = None,
) -> TokenizeSummary:
    """Render every record of ``raw_path`` (``raw_prompts.rows.RAW_SCHEMA``) into ``out_dir/prompts.parquet`` and
    ``out_dir/rejects.parquet`` (``REJECT_SCHEMA``: ``target_model.render.RENDER_REASONS``), in record order.

    Args: tokenizer / profile / enable_thinking / max_prompt_tokens as in ``render_prompt``; ``batch_rows``: records
    rendered together, and the most rows of one row group; ``first_turn``: render only the messages before the
    first assistant message (prompt policy ``all_turns``: turn 1 here, the later turns in ``generations.rollout``);
    ``workers``: processes rendering batches (None: ``default_workers``; 1: this process only). The files are the
    same whatever the worker count (batches are written in file order).
    Returns: a ``TokenizeSummary``. Raises ``OSError`` for unreadable files; nothing is replaced then.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = TokenizeSummary()
    prompts = AtomicParquetWriter(out_dir / "prompts.parquet", TOKENIZED_SCHEMA)
    rejects = AtomicParquetWriter(out_dir / "rejects.parquet", REJECT_SCHEMA)
    try:
        if workers is None:
            workers = default_workers(pq.ParquetFile(raw_path).metadata.num_rows, batch_rows)
        settings = _RenderSettings(tokenizer, profile, enable_thinking, max_prompt_tokens, first_turn)
        for result in _rendered_batches(raw_path, settings, batch_rows, workers):
            prompts.write(result.prompts)
            rejects.write(result.rejects)
            summary.lengths.add_many(result.lengths)
            if len(result.lengths):
                summary.max_tokens = max(summary.max_tokens, int(result.lengths.max()))
            summary.reasons.update(result.reasons)
            summary.opens_think += result.opens_think
            summary.template_hash = summary.template_hash or result.template_hash
            summary.rows += result.prompts.num_rows
            summary.rejected += result.rejects.num_rows
            summary.batches += 1
        prompts.commit()
        rejects.commit()
    finally:
        for part in (prompts, rejects):
            if os.path.exists(part.tmp):  # not committed: an error above
                part.abort()
    return summary
