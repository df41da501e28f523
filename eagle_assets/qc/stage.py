"""The QC stage as the pipeline runs it, without Dagster: one partition's ``qc_shards`` (:func:`qc_partition_stage`),
a chunked dataset's checks over all its chunks (:func:`dataset_qc_stage`) and the catalog's length report
(:func:`length_report_stage`). Each writes its files under the storage layout (every file atomically: a temp file
renamed into place) and returns the figures the ``assets`` layer reports as metadata and check results; the
``assets`` layer calls each while holding its folder's lock (``storage.shards.Layout.lock``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.catalog import Catalog, Thresholds
from eagle_assets.qc.dataset_checks import DatasetChecks, dataset_checks
from eagle_assets.qc.lengths import LengthRow, format_table, length_report
from eagle_assets.qc.qc_pass import QC_SKIP_REASONS, QcSummary, qc_partition
from eagle_assets.qc.status import QC_STATUS_FILE, ROWS_FILE, dataset_rows_files, findings_json, verdict_word
from eagle_assets.qc.thresholds import Outcome, evaluate_token_structure
from eagle_assets.storage.shards import (
    Layout,
    shard_paths,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
    write_text_atomic,
)
from eagle_assets.structure.segment import DROP_REASONS, FLAGS
from eagle_assets.target_model.setup import TargetSetup


@dataclass
class QcPartitionResult:
    """One partition's QC: ``summary`` (rows, kept, drop reasons, lengths), the two checks' outcomes, every drop
    reason and flag with its count (zeros included: a table of what was checked), the histogram PNG and the
    thinking-mode / turn figures of an ``all_turns`` partition (None otherwise)."""

    out: Path
    summary: QcSummary
    token_structure: Outcome
    response_length: Outcome
    thresholds: Thresholds
    reasons: dict[str, int]
    flags: dict[str, int]
    png: bytes
    by_turn: dict[str, Any] | None


def qc_partition_stage(layout: Layout, catalog: Catalog, key: str, target: TargetSetup) -> QcPartitionResult:
    """QC of partition ``key``'s generation shards into ``qc_shards/<key>/`` (shards, ``rows.parquet``,
    ``qc_status.json``, ``lengths.png``), against its prompts (``all_turns``: the rollout's turn prompts)."""
    from eagle_assets.figures.plots import length_histogram_png  # matplotlib: ~0.7 s to import
    from eagle_assets.generations.rollout import TURNS_FILE, turn_prompts
    from eagle_assets.tokenized_prompts.prompts_file import PromptsFile

    spec = catalog.partition(key)
    thresholds = spec.thresholds
    generations = layout.stage_dir("generations", key)
    # the prompts a row group at a time: their ids never all in memory
    prompts = (turn_prompts(generations) if spec.prompt_policy == "all_turns"
               else PromptsFile(layout.stage_dir("tokenized_prompts", key) / "prompts.parquet"))
    out = layout.stage_dir("qc_shards", key)
    # QC holds every row to the client's rules itself (shards may come from any producer); the rows' partition
    # column names the dataset, so the length report and the training mix read a chunk's rows as the dataset's
    summary = qc_partition(
        shard_paths(generations), prompts, out, target.profile, partition=spec.dataset, blank_ids=target.blank_ids,
        vocab_size=target.vocab_size, control_ids=target.control_ids,
        tool_call_in_reasoning=spec.tool_call_in_reasoning, short_tokens=thresholds.short_tokens,
        max_new_tokens=spec.sampling.max_new_tokens)
    structure = evaluate_token_structure(summary.drop_reasons(), thresholds)
    length = summary.response_length(thresholds)
    levels = {"token_structure": structure.level, "response_length": length.level}
    # the verdict and the findings it stands on are recorded with the levels, so every reader (the CLI, the UI's
    # QC table, the evaluation report) says the same thing without re-running the checks (qc.status.qc_verdict)
    write_json_atomic(
        {"partition": key, **levels, "passed": structure.passed and length.passed,
         "verdict": verdict_word(levels, summary.kept), "kept": summary.kept, "rows": summary.rows,
         "dropped": summary.rows - summary.kept,
         "findings": findings_json({"token_structure": structure, "response_length": length}),
         "shards": len(summary.shards), "dataset": spec.dataset,
         **({"chunk": [spec.chunk, spec.chunks]} if spec.chunk is not None else {})},
        out / QC_STATUS_FILE)
    png = length_histogram_png(
        {"reasoning": summary.reasoning_tokens, "answer": summary.answer_tokens, "total": summary.completion_tokens},
        f"{key}: response lengths", short_tokens=thresholds.short_tokens, cap=spec.sampling.max_new_tokens)
    write_bytes_atomic(png, out / "lengths.png")
    by_turn = None
    if spec.prompt_policy == "all_turns":
        from eagle_assets.qc.turn_report import qc_by_turn

        by_turn = qc_by_turn(out / ROWS_FILE, generations / TURNS_FILE)
    return QcPartitionResult(
        out=out, summary=summary, token_structure=structure, response_length=length, thresholds=thresholds,
        reasons={r: summary.reasons.get(r, 0) for r in (*DROP_REASONS, *QC_SKIP_REASONS)},
        flags={f: summary.flags.get(f, 0) for f in FLAGS}, png=png, by_turn=by_turn)


@dataclass
class DatasetQcResult:
    """A chunked dataset's checks over all its chunks (``checks``), its files' folder and each chunk's shard count;
    ``missing``: chunks without QC rows yet (then nothing was checked or written)."""

    out: Path | None
    checks: DatasetChecks | None
    shards_by_chunk: dict[str, int]
    missing: list[str]


def dataset_qc_stage(layout: Layout, catalog: Catalog, dataset: str) -> DatasetQcResult:
    """The blocking checks' figures over the union of a chunked dataset's QC rows (``qc.dataset_checks``), written
    to ``dataset_qc/<dataset>/qc_status.json``."""
    spec = catalog.partitions[dataset]
    files = dataset_rows_files(layout, catalog, dataset)
    missing = [f.parent.name for f in files if not f.exists()]
    if missing:
        return DatasetQcResult(None, None, {}, missing)
    checks = dataset_checks(files, spec.thresholds)
    out = layout.stage_dir("dataset_qc", dataset)
    levels = {"token_structure": checks.token_structure.level, "response_length": checks.response_length.level}
    write_json_atomic(
        {"dataset": dataset, "chunks": spec.chunks, **levels, "passed": checks.passed,
         "verdict": verdict_word(levels, checks.kept), "kept": checks.kept, "rows": checks.rows,
         "dropped": checks.rows - checks.kept,
         "findings": findings_json({"token_structure": checks.token_structure,
                                    "response_length": checks.response_length}),
         "rows_by_chunk": {Path(f).parent.name: n for f, n in checks.rows_by_file.items()},
         "figures": {**checks.token_structure.figures, **checks.response_length.figures}},
        out / QC_STATUS_FILE)
    return DatasetQcResult(out, checks, {f.parent.name: len(shard_paths(f.parent)) for f in files}, [])


@dataclass
class LengthReportResult:
    """The length report: its rows, the Markdown table, the histogram PNG, the by-turn table ("" when no partition
    has turns), the partitions without QC rows yet and the chunked datasets only some of whose chunks have them."""

    out: Path
    rows: list[LengthRow]
    table_md: str
    png: bytes
    partitions: list[str]
    missing: list[str]
    incomplete: list[str]
    by_turn_md: str


def length_report_stage(layout: Layout, catalog: Catalog) -> LengthReportResult:
    """The DuckDB length table of every training dataset (total, reasoning, answer tokens) over the QC rows
    materialized so far, written to ``length_report/`` (``report.md``, ``report.parquet``, ``lengths.png``,
    ``report_by_turn.md``)."""
    from eagle_assets.figures.plots import length_histogram_png

    files = [layout.stage_dir("qc_shards", k) / ROWS_FILE for k in catalog.training_partition_keys]
    present = [f for f in files if f.exists()]
    short = min((p.thresholds.short_tokens for p in catalog.partitions.values()), default=300)  # the plot's line
    rows = length_report(present, short_tokens=catalog.short_tokens())
    out = layout.stage_dir("length_report")
    table_md = format_table(rows)
    write_text_atomic(table_md + "\n", out / "report.md")
    write_parquet_atomic(pa.Table.from_pylist([r.__dict__ for r in rows]), out / "report.parquet")
    series: dict[str, list[int]] = {}
    for f in present:
        t = pq.read_table(f, columns=["partition", "completion_tokens"])
        if t.num_rows:
            series.setdefault(t.column("partition")[0].as_py(), []).extend(t.column("completion_tokens").to_pylist())
    png = length_histogram_png(series, "completion tokens by partition", short_tokens=short)
    write_bytes_atomic(png, out / "lengths.png")
    missing = [k for k, f in zip(catalog.training_partition_keys, files) if not f.exists()]
    incomplete = sorted({catalog.resolve(k)[0] for k in missing} & set(catalog.chunked_datasets) & set(series))
    return LengthReportResult(out, rows, table_md, png, sorted(series), missing, incomplete,
                              _turn_length_table(layout, catalog, out, short))


def _turn_length_table(layout: Layout, catalog: Catalog, out: Path, short: int) -> str:
    """The length table by thinking mode and turn of the ``all_turns`` partitions, written as
    ``report_by_turn.md`` ("" when no partition has turns)."""
    from eagle_assets.generations.rollout import TURNS_FILE
    from eagle_assets.qc.turn_report import format_turn_table, turn_length_report

    pairs = [(layout.stage_dir("qc_shards", k) / ROWS_FILE, layout.stage_dir("generations", k) / TURNS_FILE)
             for d, p in catalog.partitions.items() if p.prompt_policy == "all_turns"
             for k in catalog.dataset_partition_keys(d)]
    rows = turn_length_report(pairs, short_tokens=short)
    if not rows:
        return ""
    table = format_turn_table(rows)
    write_text_atomic(table + "\n", out / "report_by_turn.md")
    return table
