"""Write the training mix's rows as pre-tokenized JSON lines that speculators and SpecForge read as they are.

The rows are the ones ``drafter_checkpoint`` trains on: ``training_mix/mix.parquet`` says which rows, in which
order (``order``, ``partition``, ``sample_id``); each partition's ``qc_shards/<partition>/shard-*.parquet`` holds
their ``input_ids`` (int32 [T], prompt then completion, exactly the ids the target saw and produced) and
``loss_mask`` (int8 [T], 1 on the completion tokens the target generated, stop token included). DuckDB joins the
two and writes each row as one JSON object (its ``COPY ... (FORMAT JSON)`` writer: streaming, with bounded
memory that spills to a temp directory)::

    {"input_ids": [151644, 872, ...], "loss_mask": [0, 0, ..., 1, 1], "partition": "B4_mixturethoughts",
     "sample_id": "..."}

``partition`` and ``sample_id`` are provenance: speculators removes every column but the two lists, SpecForge
reads only the two lists (see :mod:`eagle_assets.exports.formats`). Nothing is rendered, decoded or tokenized
again, so what the trainers load is exactly what the target produced, reasoning and tool calls included.

Every row of the mix is checked before it is written; a row a trainer would refuse or silently drop is quarantined
in ``rejects.parquet`` (partition, sample_id, reason) and counted, never written. Reasons: ``empty_input_ids``,
``loss_mask_length_mismatch``, ``null_element``, ``loss_mask_not_binary``, ``negative_token_id``,
``no_loss_tokens``. A mix that names rows the QC shards no longer hold is stale: :class:`ExportError`.

Files are written under a staging directory, read back with DuckDB's JSON reader and compared row by row with the
source (ids and mask equal, no row missing or doubled) and only then moved into place with ``os.replace``: a
reader sees the previous export or the new one, never a mix of both or a torn file. (The ``shards`` layout swaps a
directory with two renames, so for an instant ``data/`` may be absent; it is never partly new.)
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from eagle_assets.exports.formats import TrainerFormat
from eagle_assets.storage.guard import refuse_symlink, remove_tree
from eagle_assets.storage.shards import write_json_atomic, write_parquet_atomic

RECORD_KEYS: tuple[str, ...] = ("input_ids", "loss_mask", "partition", "sample_id")
REJECT_REASONS: dict[str, str] = {
    "empty_input_ids": "the row has no tokens",
    "loss_mask_length_mismatch": "loss_mask and input_ids differ in length (speculators raises, SpecForge refuses)",
    "null_element": "input_ids or loss_mask holds a null",
    "loss_mask_not_binary": "loss_mask holds a value other than 0 or 1",
    "negative_token_id": "input_ids holds a negative id",
    "no_loss_tokens": "no supervised token (both trainers drop such a row)",
}
DEFAULT_ROWS_PER_SHARD = 20_000
_STAGING_PREFIX = ".staging-"


class ExportError(RuntimeError):
    """The export cannot be written as asked (stale mix, no row left, a read-back mismatch); says what to do."""


@dataclass
class ExportReport:
    """What one export wrote.

    Attributes:
        format: the trainer (``TrainerFormat.name``).
        data_path: absolute path to hand the trainer (a directory for ``shards``, a file for ``file``).
        rows / tokens / loss_tokens: rows written, their tokens, their supervised (loss_mask 1) tokens.
        max_tokens: the longest row written (tokens); ``rows_over_default_max_length`` rows are longer than the
            trainer's default window, which would clip them.
        rows_per_partition: rows written per partition.
        rejected: quarantined rows per reason (see :data:`REJECT_REASONS`).
        files: one entry per written file: ``path`` (relative to the export directory), ``rows``, ``bytes``,
            ``sha256``.
        verified_rows: rows read back from the files and found equal to their source rows.
    """

    format: str
    data_path: str
    rows: int
    tokens: int
    loss_tokens: int
    max_tokens: int
    rows_over_default_max_length: int
    default_max_length: int
    rows_per_partition: dict[str, int]
    rejected: dict[str, int]
    files: list[dict[str, Any]]
    verified_rows: int
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_mixed_rows(
    mix_file: Path,
    qc_shards: Mapping[str, Sequence[Path]],
    out_dir: Path,
    fmt: TrainerFormat,
    *,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    provenance: Mapping[str, Any] | None = None,
    threads: int | None = None,
) -> ExportReport:
    """Write the rows ``mix_file`` names, in its order, as ``fmt`` under ``out_dir``; returns the report.

    Args:
        mix_file: ``training_mix/mix.parquet`` (``order`` int32, ``partition``, ``sample_id``).
        qc_shards: partition -> its QC shard files (``sample_id``, ``input_ids`` list<int32>, ``loss_mask``
            list<int8>); the partitions the mix was built over.
        out_dir: the export directory; gets ``fmt.data_path``, ``rejects.parquet`` and ``summary.json``.
        rows_per_shard: rows per ``shard-NNNNN.jsonl`` (``shards`` layout only); bounds each file.
        provenance: extra facts for ``summary.json`` (catalog, target model, partitions).
        threads: DuckDB threads (default: up to 4 of the machine's cores).
    Raises:
        ExportError: the mix names rows the QC shards do not hold (re-materialize ``training_mix``), a QC shard
            holds a sample id twice, no row is left to write, or the read-back differs from the source (the
            previous export is then left untouched).
        ValueError: ``rows_per_shard`` < 1.
        SymlinkRefusedError: ``out_dir``, its published data folder or a leftover staging folder is a symbolic
            link (checked before anything is deleted or replaced: through a link those would be its target's files).
    """
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    out_dir = refuse_symlink(Path(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    if fmt.layout == "shards":  # the data folder _publish replaces (a file layout's link is replaced, not followed)
        refuse_symlink(out_dir / fmt.data_path)
    for stale in out_dir.glob(f"{_STAGING_PREFIX}*"):  # left by a killed run; never read by a trainer
        remove_tree(stale, ignore_errors=True)
    staging = out_dir / f"{_STAGING_PREFIX}{secrets.token_hex(6)}"
    staging.mkdir()
    try:
        con = _connect(staging / "duckdb-tmp", threads)
        try:
            _select_mixed_rows(con, Path(mix_file), qc_shards)
            files = _write(con, staging, fmt, rows_per_shard)
            mismatches, verified = _compare_with_files(con, [staging / f for f in files])
            if mismatches:
                raise ExportError(
                    f"{fmt.name} export: the files written do not read back as the mixed rows ({'; '.join(mismatches)})"
                    "; the previous export is left as it was. Check the disk (full? another writer?) and rerun")
            stats = _stats(con, fmt)
            rejects = con.sql("SELECT partition, sample_id, reject AS reason FROM mixed WHERE reject IS NOT NULL "
                              "ORDER BY pos").to_arrow_table()
        finally:
            con.close()
        file_info = [{"path": f, **_file_facts(staging / f)} for f in files]
        data_path = _publish(staging, out_dir, fmt)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_parquet_atomic(rejects, out_dir / "rejects.parquet")
    report = ExportReport(format=fmt.name, data_path=str(data_path), files=file_info, verified_rows=verified,
                          default_max_length=fmt.default_max_length, provenance=dict(provenance or {}), **stats)
    write_json_atomic({**report.to_dict(), "layout": fmt.layout, "record_keys": list(RECORD_KEYS),
                       "verified_with": fmt.verified_with, "max_length_option": fmt.max_length_option,
                       "mix_sha256": _sha256(Path(mix_file)),
                       "train": fmt.train_hint.format(data=data_path, max=max(report.max_tokens, 1))},
                      out_dir / "summary.json")
    return report


def verify_export(mix_file: Path, qc_shards: Mapping[str, Sequence[Path]], out_dir: Path,
                  fmt: TrainerFormat, threads: int | None = None) -> list[str]:
    """Compare a published export with the rows the mix names now: ``[]`` when every row is exact.

    Each entry names a row (``partition/sample_id``) and what differs (missing, extra, written twice, ids or mask
    differ), at most 10, then a count of the rest. Raises ExportError when the mix is stale (as
    :func:`export_mixed_rows`) or the export is absent.
    """
    out_dir = Path(out_dir)
    target = out_dir / fmt.data_path
    files = sorted(target.glob("shard-*.jsonl")) if fmt.layout == "shards" else [target]
    if not files or not all(f.is_file() for f in files):
        raise ExportError(f"no {fmt.name} export at {target}: materialize {fmt.name}_export first")
    scratch = out_dir / f"{_STAGING_PREFIX}verify-{secrets.token_hex(6)}"
    try:
        con = _connect(scratch, threads)
        try:
            _select_mixed_rows(con, Path(mix_file), qc_shards)
            mismatches, _ = _compare_with_files(con, files)
        finally:
            con.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return mismatches


def _connect(temp_dir: Path, threads: int | None):
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads TO {int(threads or min(os.cpu_count() or 1, 4))}")
    con.execute(f"SET temp_directory = {_sql_str(str(temp_dir))}")
    con.execute("SET preserve_insertion_order = true")
    return con


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _sql_list(paths: Sequence[Path]) -> str:
    return "[" + ", ".join(_sql_str(str(p)) for p in paths) + "]"


def _select_mixed_rows(con, mix_file: Path, qc_shards: Mapping[str, Sequence[Path]]) -> None:
    """Temp table ``mixed`` (pos, partition, sample_id, input_ids, loss_mask, reject): the mix joined to QC."""
    if not mix_file.is_file():
        raise ExportError(f"{mix_file} does not exist: materialize training_mix first (training_job does)")
    con.execute(f'CREATE TEMP TABLE mix AS SELECT "order" AS pos, partition, sample_id '
                f"FROM read_parquet({_sql_str(str(mix_file))})")
    selects = [f"SELECT {_sql_str(key)} AS partition, sample_id, input_ids, loss_mask "
               f"FROM read_parquet({_sql_list(paths)})" for key, paths in qc_shards.items() if paths]
    if not selects:
        selects = ["SELECT NULL::VARCHAR AS partition, NULL::VARCHAR AS sample_id, NULL::INTEGER[] AS input_ids, "
                   "NULL::TINYINT[] AS loss_mask WHERE false"]
    con.execute("CREATE TEMP VIEW qc AS " + " UNION ALL ".join(selects))
    doubled = con.sql("SELECT partition, sample_id, count(*) AS n FROM mix GROUP BY ALL HAVING n > 1 "
                      "LIMIT 3").fetchall()
    if doubled:
        raise ExportError(f"training_mix names rows twice (e.g. {doubled}): re-materialize training_mix")
    con.execute("""
        CREATE TEMP TABLE mixed AS
        SELECT m.pos, m.partition, m.sample_id, q.input_ids, q.loss_mask, q.sample_id IS NULL AS missing,
               CASE
                 WHEN q.sample_id IS NULL THEN NULL
                 WHEN q.input_ids IS NULL OR len(q.input_ids) = 0 THEN 'empty_input_ids'
                 WHEN q.loss_mask IS NULL OR len(q.loss_mask) <> len(q.input_ids) THEN 'loss_mask_length_mismatch'
                 WHEN list_count(q.input_ids) <> len(q.input_ids) OR list_count(q.loss_mask) <> len(q.loss_mask)
                   THEN 'null_element'
                 WHEN list_min(q.loss_mask) < 0 OR list_max(q.loss_mask) > 1 THEN 'loss_mask_not_binary'
                 WHEN list_min(q.input_ids) < 0 THEN 'negative_token_id'
                 WHEN list_sum(q.loss_mask) = 0 THEN 'no_loss_tokens'
               END AS reject
        FROM mix m LEFT JOIN qc q ON q.partition = m.partition AND q.sample_id = m.sample_id
        ORDER BY m.pos
    """)
    n_mix = con.sql("SELECT count(*) FROM mix").fetchall()[0][0]
    n_mixed = con.sql("SELECT count(*) FROM mixed").fetchall()[0][0]
    if n_mixed != n_mix:
        twice = con.sql("SELECT partition, sample_id FROM qc GROUP BY ALL HAVING count(*) > 1 LIMIT 3").fetchall()
        raise ExportError(f"QC shards hold sample ids more than once (e.g. {twice}): re-materialize qc_shards "
                          "for those partitions")
    missing, examples = con.sql("SELECT count(*), list(partition || '/' || sample_id ORDER BY pos)[1:3] "
                                "FROM mixed WHERE missing").fetchall()[0]
    if missing:
        raise ExportError(f"training_mix names {missing} rows that the QC shards no longer hold (e.g. {examples}): "
                          "re-materialize training_mix after qc_shards changed")
    if not con.sql("SELECT count(*) FROM mixed WHERE reject IS NULL").fetchall()[0][0]:
        reasons = dict(con.sql("SELECT reject, count(*) FROM mixed GROUP BY ALL").fetchall())
        raise ExportError(f"no mixed row can be exported: every row was quarantined ({reasons}); see "
                          "REJECT_REASONS and fix the QC rows, or materialize training_mix with other partitions")
    con.execute("CREATE TEMP TABLE export_rows AS SELECT row_number() OVER (ORDER BY pos) - 1 AS n, "
                "input_ids, loss_mask, partition, sample_id FROM mixed WHERE reject IS NULL ORDER BY pos")


def _write(con, staging: Path, fmt: TrainerFormat, rows_per_shard: int) -> list[str]:
    """Write ``export_rows`` under ``staging`` in ``fmt``'s layout; returns the file paths relative to it."""
    cols = ", ".join(RECORD_KEYS)
    n_rows = con.sql("SELECT count(*) FROM export_rows").fetchall()[0][0]
    if fmt.layout == "file":
        bounds = [(0, n_rows, fmt.data_path)]
    else:
        (staging / fmt.data_path).mkdir(parents=True)
        bounds = [(lo, min(lo + rows_per_shard, n_rows), f"{fmt.data_path}/shard-{i:05d}.jsonl")
                  for i, lo in enumerate(range(0, n_rows, rows_per_shard))]
    for lo, hi, rel in bounds:
        con.execute(f"COPY (SELECT {cols} FROM export_rows WHERE n >= {lo} AND n < {hi} ORDER BY n) "
                    f"TO {_sql_str(str(staging / rel))} (FORMAT JSON)")
    return [rel for _lo, _hi, rel in bounds]


def _compare_with_files(con, files: Sequence[Path]) -> tuple[list[str], int]:
    """Read ``files`` back with DuckDB's JSON reader and compare each row with ``mixed``; (mismatches, equal rows)."""
    columns = "{'input_ids': 'INTEGER[]', 'loss_mask': 'TINYINT[]', 'partition': 'VARCHAR', 'sample_id': 'VARCHAR'}"
    con.execute("DROP VIEW IF EXISTS back")
    con.execute(f"CREATE TEMP VIEW back AS SELECT * FROM read_json({_sql_list(files)}, "
                f"format = 'newline_delimited', columns = {columns})")
    rows = con.sql("""
        WITH src AS (SELECT partition, sample_id, input_ids, loss_mask FROM mixed WHERE reject IS NULL),
             dst AS (SELECT partition, sample_id, any_value(input_ids) AS input_ids,
                            any_value(loss_mask) AS loss_mask, count(*) AS copies FROM back GROUP BY ALL)
        SELECT coalesce(s.partition, d.partition) || '/' || coalesce(s.sample_id, d.sample_id) AS row_id,
               CASE WHEN d.sample_id IS NULL THEN 'not in the export'
                    WHEN s.sample_id IS NULL THEN 'in the export but not in the training mix'
                    WHEN d.copies > 1 THEN 'written ' || d.copies || ' times'
                    WHEN s.input_ids IS DISTINCT FROM d.input_ids THEN 'input_ids differ'
                    WHEN s.loss_mask IS DISTINCT FROM d.loss_mask THEN 'loss_mask differs'
               END AS what
        FROM src s FULL OUTER JOIN dst d ON s.partition = d.partition AND s.sample_id = d.sample_id
        ORDER BY row_id
    """).fetchall()
    bad = [f"{row_id}: {what}" for row_id, what in rows if what is not None]
    shown = bad[:10] + ([f"... and {len(bad) - 10} more"] if len(bad) > 10 else [])
    return shown, len(rows) - len(bad)


def _stats(con, fmt: TrainerFormat) -> dict[str, Any]:
    rows, tokens, loss_tokens, max_tokens, over = con.sql(f"""
        SELECT count(*), sum(len(input_ids)), sum(list_sum(loss_mask)), max(len(input_ids)),
               count(*) FILTER (WHERE len(input_ids) > {int(fmt.default_max_length)}) FROM export_rows
    """).fetchall()[0]
    per_partition = dict(con.sql("SELECT partition, count(*) FROM export_rows GROUP BY ALL ORDER BY 1").fetchall())
    rejected = dict(con.sql("SELECT reject, count(*) FROM mixed WHERE reject IS NOT NULL GROUP BY ALL "
                            "ORDER BY 1").fetchall())
    return {"rows": int(rows), "tokens": int(tokens), "loss_tokens": int(loss_tokens), "max_tokens": int(max_tokens),
            "rows_over_default_max_length": int(over),
            "rows_per_partition": {k: int(v) for k, v in per_partition.items()},
            "rejected": {k: int(v) for k, v in rejected.items()}}


def _publish(staging: Path, out_dir: Path, fmt: TrainerFormat) -> Path:
    """Move the staged data into place (atomic per file; a directory swap is two renames); returns its path."""
    new, final = staging / fmt.data_path, out_dir / fmt.data_path
    if fmt.layout == "file":
        os.replace(new, final)
        return final.resolve()
    previous = staging / "previous"
    if final.exists():
        os.rename(final, previous)
    try:
        os.rename(new, final)
    except OSError:
        if previous.exists():
            os.rename(previous, final)
        raise
    return final.resolve()


def _file_facts(path: Path) -> dict[str, Any]:
    """Rows (newlines), bytes and sha256 of a written file, in one pass."""
    digest, rows = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
            rows += chunk.count(b"\n")
    return {"rows": rows, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _sha256(path: Path) -> str:
    return _file_facts(path)["sha256"]
