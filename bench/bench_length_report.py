"""Length-report benchmark: DuckDB over Parquet shards vs the same statistics in pandas, side by side.

Issue "Token structure and data quality", item 7. Writes 1,000,000 synthetic QC rows (``rows.parquet`` schema of
``eagle_assets.assets.qc.ROWS_SCHEMA``: four partitions with reasoning-model-like length distributions, a cap at
``max_new_tokens`` with ``finish_reason`` "length") as 20 shards of 50,000 rows, then computes the length report
(count, mean, median, p10, p90, share under 300, share over 1,000, count at the cap, share truncated; for the total,
reasoning and answer spans of every partition) three ways from the same files:

  duckdb     ``eagle_assets.qc.lengths.length_report`` as the pipeline runs it (DuckDB's default threads)
  duckdb-1t  the same with DuckDB limited to one thread
  pandas     ``pd.read_parquet`` of the needed columns + ``groupby`` aggregates (linear quantiles, as
             DuckDB's ``quantile_cont``), single-threaded as pandas is

Every figure of the pandas table is checked against DuckDB's (relative tolerance 1e-9) before any time is
reported. Each method runs ``--repeats`` times in alternating order; the table shows the median wall time. All
three run in one process, so only time is compared, not memory.

Usage: ``.venv/bin/pip install -e '.[bench]' && .venv/bin/python bench/bench_length_report.py [--rows 1000000]
[--shards 20] [--repeats 3] [--keep DIR]``. Takes about a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from eagle_assets.qc.lengths import REPORT_COLUMNS, length_report  # noqa: E402
from eagle_assets.qc.qc_pass import ROWS_SCHEMA  # noqa: E402

# (partition, median reasoning tokens, median answer tokens, max_new_tokens): short tool calls to long chains.
PARTITIONS = (("B1_glaive", 40, 60, 1024), ("B2_opencodeinstruct", 300, 250, 2048),
              ("B4_mixturethoughts", 2500, 400, 8192), ("B5_openthoughts", 3500, 500, 8192))
SHORT, LONG = 300, 1000


def write_shards(root: Path, rows: int, shards: int, seed: int = 0) -> list[Path]:
    """``shards`` Parquet files of ``rows`` rows in total; each file holds one partition's slice (as in the
    pipeline, where a partition's rows live in its own directory)."""
    rng = np.random.default_rng(seed)
    per_shard = rows // shards
    files = []
    for i in range(shards):
        name, med_r, med_a, cap = PARTITIONS[i % len(PARTITIONS)]
        n = per_shard + (rows - per_shard * shards if i == shards - 1 else 0)
        reasoning = np.rint(rng.lognormal(np.log(med_r), 0.6, n)).astype(np.int64)
        answer = np.rint(rng.lognormal(np.log(med_a), 0.5, n)).astype(np.int64) + 1
        total = reasoning + answer + 1  # + think-end
        cut = total >= cap
        total = np.minimum(total, cap)
        answer = np.where(cut & (reasoning >= cap - 1), 0, np.minimum(answer, np.maximum(cap - reasoning - 1, 0)))
        reasoning = np.minimum(reasoning, cap - 1)
        drop = np.where(cut, np.where(answer == 0, "truncated_in_reasoning", "truncated_in_answer"), None)
        table = pa.table({
            "partition": pa.array([name] * n, pa.string()),
            "sample_id": pa.array([f"{name}-{i}-{j}" for j in range(n)], pa.string()),
            "completion_tokens": pa.array(total, pa.int32()),
            "reasoning_tokens": pa.array(reasoning, pa.int32()),
            "answer_tokens": pa.array(answer, pa.int32()),
            "tool_call_tokens": pa.array(np.zeros(n, np.int32), pa.int32()),
            "finish_reason": pa.array(np.where(cut, "length", "stop"), pa.string()),
            "max_new_tokens": pa.array(np.full(n, cap, np.int32), pa.int32()),
            "kept": pa.array(~cut, pa.bool_()),
            "short": pa.array(~cut & (total < SHORT), pa.bool_()),
            "drop_reason": pa.array(drop, pa.string()),
        }, schema=ROWS_SCHEMA)
        path = root / name / f"rows-{i:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        files.append(path)
    return files


def pandas_report(files: list[Path]) -> list[tuple]:
    """The same table as ``length_report``, computed with pandas from the same files."""
    import pandas as pd

    cols = ["partition", "completion_tokens", "reasoning_tokens", "answer_tokens", "finish_reason", "max_new_tokens"]
    df = pd.concat([pd.read_parquet(f, columns=cols) for f in files], ignore_index=True)
    df["at_cap"] = (df["completion_tokens"] >= df["max_new_tokens"]).astype("int64")
    df["truncated"] = (df["finish_reason"] == "length").astype("float64")
    out = []
    for span, col in (("total", "completion_tokens"), ("reasoning", "reasoning_tokens"), ("answer", "answer_tokens")):
        v = df[col]
        frame = pd.DataFrame({"partition": df["partition"], "v": v, "short": (v < SHORT).astype("float64"),
                              "long": (v > LONG).astype("float64"), "at_cap": df["at_cap"], "trunc": df["truncated"]})
        g = frame.groupby("partition", sort=True)
        agg = g.agg(count=("v", "size"), mean=("v", "mean"), median=("v", "median"),
                    short=("short", "mean"), long=("long", "mean"), at_cap=("at_cap", "sum"), trunc=("trunc", "mean"))
        q = g["v"].quantile([0.1, 0.9]).unstack()
        for part, r in agg.iterrows():
            out.append((part, span, int(r["count"]), float(r["mean"]), float(r["median"]), float(q.loc[part, 0.1]),
                        float(q.loc[part, 0.9]), float(r["short"]), float(r["long"]), int(r["at_cap"]),
                        float(r["trunc"])))
    order = {"total": 0, "reasoning": 1, "answer": 2}
    return sorted(out, key=lambda t: (t[0], order[t[1]]))


def duckdb_report(files: list[Path], threads: int | None = None) -> list[tuple]:
    return [tuple(getattr(r, c) for c in REPORT_COLUMNS)
            for r in length_report(files, short_tokens=SHORT, long_tokens=LONG, threads=threads)]


def same(a: list[tuple], b: list[tuple]) -> None:
    """Raise AssertionError naming the first figure where the two tables differ."""
    assert len(a) == len(b), f"{len(a)} vs {len(b)} report rows"
    for ra, rb in zip(a, b):
        for name, x, y in zip(REPORT_COLUMNS, ra, rb):
            ok = x == y if isinstance(x, str) else abs(float(x) - float(y)) <= 1e-9 * max(1.0, abs(float(x)))
            assert ok, f"{ra[0]} {ra[1]} {name}: duckdb {x} vs pandas {y}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="write the shards here and keep them")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        t0 = time.perf_counter()
        files = write_shards(root, args.rows, args.shards)
        size = sum(f.stat().st_size for f in files)
        print(f"wrote {args.rows:,} rows in {len(files)} shards ({size / 2**20:.1f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s; {os.cpu_count()} CPUs")
        methods = {"duckdb": lambda: duckdb_report(files), "duckdb-1t": lambda: duckdb_report(files, threads=1),
                   "pandas": lambda: pandas_report(files)}
        reference = methods["duckdb"]()
        same(reference, methods["pandas"]())
        same(reference, methods["duckdb-1t"]())
        times: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(args.repeats):
            for name in (list(methods) if rep % 2 == 0 else list(reversed(methods))):
                t = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t)
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"\nlength report over {args.rows:,} rows, {len(reference)} table rows, identical figures "
              f"(pandas vs DuckDB to 1e-9)")
        print("| method | median s | runs (s) | pandas / method |")
        print("|---|---|---|---|")
        for m in methods:
            print(f"| {m} | {med[m]:.3f} | {', '.join(f'{x:.3f}' for x in times[m])} | {med['pandas'] / med[m]:.2f}x |")
        by_part = {r[0]: r for r in reference if r[1] == "total"}
        print("\ntotal-span figures (DuckDB):")
        for part, r in by_part.items():
            print(f"  {part}: n {r[2]:,} median {r[4]:.0f} p10 {r[5]:.0f} p90 {r[6]:.0f} "
                  f"<{SHORT} {r[7]:.1%} >{LONG} {r[8]:.1%} at cap {r[9]:,} truncated {r[10]:.1%}")
        print(f"\nDuckDB is {med['pandas'] / med['duckdb']:.2f}x faster than pandas "
              f"({med['pandas'] / med['duckdb-1t']:.2f}x on one thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
