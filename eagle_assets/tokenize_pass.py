"""One streaming pass ``raw_prompts`` -> ``tokenized_prompts``: record batches in, bounded row groups out.

``tokenize_partition`` is the body of the ``tokenized_prompts`` asset (``assets.prompts``) without Dagster, so the
bench and the tests run the same code. The raw prompts file is read ``batch_rows`` records at a time; each batch is
rendered by ``target_model.render.render_prompts`` (the chat template once per record, the texts tokenized in one
batch encode) and written as one row group of ``prompts.parquet`` (``TOKENIZED_SCHEMA``) through one Parquet
writer to a temp file that is renamed into place at the end, so readers see the old file or the whole new one.
Rejected records go to ``rejects.parquet`` the same way. The row groups are what ``prompts_file.PromptsFile`` reads
one at a time downstream (generation requests, the live monitor, QC's join).

Memory: one batch of records and its rendered ids, plus a length histogram; independent of the partition's size.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.formats.rows import REJECT_SCHEMA
from eagle_assets.prompts_file import PROMPT_ROW_GROUP_ROWS
from eagle_assets.quality.running import LengthHistogram

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


class _AtomicParquet:
    """A Parquet writer to a temp file beside ``path``, renamed onto it by ``commit``."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path, self.schema = Path(path), schema
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self.writer = pq.ParquetWriter(self.tmp, schema, compression="zstd")

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self.writer.write_table(table, row_group_size=max(table.num_rows, 1))

    def commit(self) -> None:
        self.writer.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.writer.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


def _turn_one(messages: list) -> list:
    from eagle_assets.conversation.walk import first_turn_messages

    return first_turn_messages(messages)


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
) -> TokenizeSummary:
    """Render every record of ``raw_path`` (``formats.rows.RAW_SCHEMA``) into ``out_dir/prompts.parquet`` and
    ``out_dir/rejects.parquet`` (``REJECT_SCHEMA``: ``target_model.render.RENDER_REASONS``), in record order.

    Args: tokenizer / profile / enable_thinking / max_prompt_tokens as in ``render_prompt``; ``batch_rows``: records
    rendered together, and the most rows of one row group; ``first_turn``: render only the messages before the
    first assistant message (prompt policy ``all_turns``: turn 1 here, the later turns in ``conversation.rollout``).
    Returns: a ``TokenizeSummary``. Raises ``OSError`` for unreadable files; nothing is replaced then.
    """
    from eagle_assets.target_model.render import RenderError, render_prompts

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = TokenizeSummary()
    prompts = _AtomicParquet(out_dir / "prompts.parquet", TOKENIZED_SCHEMA)
    rejects = _AtomicParquet(out_dir / "rejects.parquet", REJECT_SCHEMA)
    try:
        for batch in pq.ParquetFile(raw_path).iter_batches(batch_size=batch_rows):
            records = batch.to_pylist()  # one bounded batch of records, never the partition
            results = render_prompts(
                tokenizer, [(_turn_one(json.loads(r["messages"])) if first_turn else json.loads(r["messages"]),
                             json.loads(r["tools"]) if r["tools"] else None) for r in records],
                enable_thinking=enable_thinking, max_prompt_tokens=max_prompt_tokens, profile=profile)
            rows, bad = [], []
            for r, rendered in zip(records, results):
                if isinstance(rendered, RenderError):
                    bad.append({"source_file": r["source_file"], "source_row": r["source_row"],
                                "sample_id": r["sample_id"], "reason": rendered.reason,
                                "detail": str(rendered)[:1000]})
                    summary.reasons[rendered.reason] += 1
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
                summary.lengths.add(len(ids))
                summary.max_tokens = max(summary.max_tokens, len(ids))
                summary.opens_think += bool(rendered.opens_think)
                if not summary.template_hash:
                    summary.template_hash = rendered.template_hash
            prompts.write(pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA))
            rejects.write(pa.Table.from_pylist(bad, schema=REJECT_SCHEMA))
            summary.rows += len(rows)
            summary.rejected += len(bad)
            summary.batches += 1
        prompts.commit()
        rejects.commit()
    finally:
        for part in (prompts, rejects):
            if os.path.exists(part.tmp):  # not committed: an error above
                part.abort()
    return summary
