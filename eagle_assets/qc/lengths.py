"""Length statistics of generated responses, computed by DuckDB straight from the Parquet files.

Input: the per-row QC tables (``qc_shards/<partition>/rows.parquet``), one row per generated sample with columns
``partition`` (str), ``completion_tokens``, ``reasoning_tokens``, ``answer_tokens`` (int, tokens),
``finish_reason`` (str), ``max_new_tokens`` (int), ``kept`` (bool), ``drop_reason`` (str or null).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import duckdb
import pyarrow as pa

# The figures every report carries, per partition and per span (total, reasoning, answer).
REPORT_COLUMNS = (
    "partition", "span", "count", "mean", "median", "p10", "p90",
    "share_under_short", "share_over_long", "at_cap", "share_truncated",
)


@dataclass(frozen=True)
class LengthRow:
    """One line of the length report; lengths in tokens, shares in [0, 1]."""

    partition: str
    span: str  # "total" (completion_tokens), "reasoning" or "answer"
    count: int
    mean: float
    median: float
    p10: float
    p90: float
    share_under_short: float
    share_over_long: float
    at_cap: int
    share_truncated: float


def length_report(
    rows_files: Sequence[Path], short_tokens: int | Mapping[str, int] = 300, long_tokens: int = 1000,
    threads: int | None = None
) -> list[LengthRow]:
    """Compute the length table over ``rows_files`` with DuckDB.

    ``short_tokens``: the "short" line, one for all partitions or per partition (a partition missing from the
    mapping uses 300, the catalog's default), so each line's ``share_under_short`` is its own check's figure.

    Every generated row counts (kept or dropped), so truncation shows; ``at_cap`` counts rows whose
    ``completion_tokens`` reached ``max_new_tokens``. Quantiles are DuckDB's ``quantile_cont`` (linear).
    ``threads`` caps DuckDB's worker threads (None = DuckDB's default, one per core).
    Returns rows sorted by partition then span ("total", "reasoning", "answer"); empty for no files.
    Raises ``duckdb.Error`` when a file is not a readable rows table.
    """
    files = [str(Path(f)) for f in rows_files if Path(f).exists()]
    if not files:
        return []
    con = duckdb.connect(config={"threads": threads} if threads else {})
    shorts = dict(short_tokens) if isinstance(short_tokens, Mapping) else {}
    default_short = 300 if shorts else int(short_tokens)
    try:
        con.read_parquet(files, union_by_name=True).create_view("rows_in")
        con.register("shorts", pa.table({"partition": pa.array(list(shorts), pa.string()),
                                         "short": pa.array(list(shorts.values()), pa.int64())}))
        # a view cannot take a prepared parameter: the default is an int formatted into the statement
        con.execute(f"CREATE VIEW r AS SELECT rows_in.*, coalesce(shorts.short, {int(default_short)}) AS short_line "
                    "FROM rows_in LEFT JOIN shorts USING (partition)")
        spans = {"total": "completion_tokens", "reasoning": "reasoning_tokens", "answer": "answer_tokens"}
        parts = []
        for span, col in spans.items():
            parts.append(
                f"""
                SELECT partition, '{span}' AS span, count(*) AS count, avg({col}) AS mean,
                       quantile_cont({col}, 0.5) AS median, quantile_cont({col}, 0.1) AS p10,
                       quantile_cont({col}, 0.9) AS p90,
                       avg(CASE WHEN {col} < short_line THEN 1.0 ELSE 0.0 END) AS share_under_short,
                       avg(CASE WHEN {col} > $long THEN 1.0 ELSE 0.0 END) AS share_over_long,
                       sum(CASE WHEN completion_tokens >= max_new_tokens THEN 1 ELSE 0 END) AS at_cap,
                       avg(CASE WHEN finish_reason = 'length' THEN 1.0 ELSE 0.0 END) AS share_truncated,
                       {list(spans).index(span)} AS span_order
                FROM r GROUP BY partition"""
            )
        sql = " UNION ALL ".join(parts) + " ORDER BY partition, span_order"
        result = con.execute(sql, {"long": long_tokens}).fetchall()
    finally:
        con.close()
    return [
        LengthRow(p, s, int(c), float(m), float(md), float(a), float(b), float(u), float(o), int(cap), float(t))
        for (p, s, c, m, md, a, b, u, o, cap, t, _order) in result
    ]


def format_table(rows: Sequence[LengthRow], spans: Sequence[str] = ("total", "reasoning", "answer")) -> str:
    """Render the report as a Markdown table (printed by the CLI, shown in the Dagster UI)."""
    head = "| partition | span | count | mean | median | p10 | p90 | <short | >long | at cap | truncated |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if r.span not in spans:
            continue
        lines.append(
            f"| {r.partition} | {r.span} | {r.count} | {r.mean:.1f} | {r.median:.1f} | {r.p10:.1f} | {r.p90:.1f} "
            f"| {r.share_under_short:.1%} | {r.share_over_long:.1%} | {r.at_cap} | {r.share_truncated:.1%} |"
        )
    return "\n".join(lines)
