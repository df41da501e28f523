"""Length and QC figures of ``all_turns`` partitions by thinking mode and turn index, computed by DuckDB.

Inputs: a partition's QC rows (``qc_shards/<key>/rows.parquet``, ``qc.qc_pass.ROWS_SCHEMA``: one row per
generated row, ``sample_id`` = the turn's row id) and its turn table (``generations/<key>/turns.parquet``,
``generations.rollout.TURN_SCHEMA``: row id -> sample id, thinking, turn), joined on the row id. Rows of
single-turn partitions have no turn table and are not in these figures (the partition-wide length report has them).
Units: tokens; shares are fractions 0..1 of the rows of the group (kept and dropped, so truncation shows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import duckdb

_SPANS = {"total": "completion_tokens", "reasoning": "reasoning_tokens", "answer": "answer_tokens"}


def _connect(threads: int | None):
    return duckdb.connect(config={"threads": threads} if threads else {})


def turn_length_report(pairs: Sequence[tuple[Path, Path]], short_tokens: int = 300,
                       threads: int | None = None) -> list[dict[str, Any]]:
    """The length table by (partition, thinking, turn, span) over ``pairs`` of (rows.parquet, turns.parquet).

    Returns dicts with keys partition, thinking, turn, span ("total" | "reasoning" | "answer"), count, kept, mean,
    median, p10, p90 (DuckDB ``quantile_cont``), share_under_short, share_truncated, share_dropped; sorted by
    partition, thinking, turn, span. Missing files are skipped; empty for none.
    """
    pairs = [(str(r), str(t)) for r, t in pairs if Path(r).exists() and Path(t).exists()]
    if not pairs:
        return []
    con = _connect(threads)
    try:
        con.read_parquet([r for r, _ in pairs], union_by_name=True).create_view("r")
        con.read_parquet([t for _, t in pairs], union_by_name=True).create_view("t")
        parts = []
        for order, (span, col) in enumerate(_SPANS.items()):
            parts.append(f"""
                SELECT r.partition, t.thinking, t.turn, '{span}' AS span, count(*) AS count,
                       sum(CASE WHEN r.kept THEN 1 ELSE 0 END) AS kept, avg(r.{col}) AS mean,
                       quantile_cont(r.{col}, 0.5) AS median, quantile_cont(r.{col}, 0.1) AS p10,
                       quantile_cont(r.{col}, 0.9) AS p90,
                       avg(CASE WHEN r.{col} < $short THEN 1.0 ELSE 0.0 END) AS share_under_short,
                       avg(CASE WHEN r.finish_reason = 'length' THEN 1.0 ELSE 0.0 END) AS share_truncated,
                       avg(CASE WHEN r.kept THEN 0.0 ELSE 1.0 END) AS share_dropped, {order} AS span_order
                FROM r JOIN t ON r.sample_id = t.row_id GROUP BY r.partition, t.thinking, t.turn""")
        sql = " UNION ALL ".join(parts) + " ORDER BY partition, thinking, turn, span_order"
        cur = con.execute(sql, {"short": short_tokens})
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, values)) for values in cur.fetchall()]
    finally:
        con.close()
    for row in rows:
        row.pop("span_order")
        row["turn"], row["count"], row["kept"] = int(row["turn"]), int(row["count"]), int(row["kept"])
    return rows


def qc_by_turn(rows_file: Path, turns_file: Path, threads: int | None = None) -> dict[str, dict[str, Any]]:
    """QC figures of one partition by ``"<thinking>/<turn>"``: rows, kept, dropped, share_dropped and the drop
    reasons (counts). Empty when either file is missing."""
    if not (Path(rows_file).exists() and Path(turns_file).exists()):
        return {}
    con = _connect(threads)
    try:
        result = con.execute(
            """SELECT t.thinking, t.turn, r.drop_reason, count(*) FROM read_parquet($rows) r
               JOIN read_parquet($turns) t ON r.sample_id = t.row_id
               GROUP BY t.thinking, t.turn, r.drop_reason ORDER BY t.thinking, t.turn""",
            {"rows": str(rows_file), "turns": str(turns_file)}).fetchall()
    finally:
        con.close()
    out: dict[str, dict[str, Any]] = {}
    for thinking, turn, reason, n in result:
        cell = out.setdefault(f"{thinking}/{int(turn)}", {"rows": 0, "kept": 0, "dropped": 0, "drop_reasons": {}})
        cell["rows"] += int(n)
        if reason is None:
            cell["kept"] += int(n)
        else:
            cell["dropped"] += int(n)
            cell["drop_reasons"][reason] = int(n)
    for cell in out.values():
        cell["share_dropped"] = cell["dropped"] / cell["rows"] if cell["rows"] else 0.0
    return out


def format_turn_table(rows: Sequence[dict[str, Any]], spans: Sequence[str] = ("total", "reasoning", "answer")) -> str:
    """The by-turn length table as Markdown (the length report's ``report_by_turn.md``)."""
    lines = ["| partition | thinking | turn | span | rows | kept | mean | median | p10 | p90 | <short | truncated "
             "| dropped |", "|" + "---|" * 13]
    for r in rows:
        if r["span"] not in spans:
            continue
        lines.append(f"| {r['partition']} | {r['thinking']} | {r['turn']} | {r['span']} | {r['count']} | {r['kept']} "
                     f"| {r['mean']:.1f} | {r['median']:.1f} | {r['p10']:.1f} | {r['p90']:.1f} "
                     f"| {r['share_under_short']:.1%} | {r['share_truncated']:.1%} | {r['share_dropped']:.1%} |")
    return "\n".join(lines)
