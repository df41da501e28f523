"""Resumable, exactly-once generation of one partition against SGLang ``/generate`` servers.

Results are buffered and flushed to a new shard (``shard-NNNNN.parquet``, atomic temp file + rename) every
``flush_rows`` rows or ``flush_seconds`` seconds. On start, the sample ids already in shards are read back and
skipped, so a killed run loses at most the unflushed buffer and never writes an id twice. Requests that still fail
after the client's retries go to ``failures.parquet`` (sample id, kind, attempts, last error) and are retried by the
next materialization.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.storage import next_shard_path, read_done_ids, write_parquet_atomic

GENERATION_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("output_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("matched_stop", pa.int64()),
        ("completion_tokens", pa.int32()),
        ("prompt_tokens", pa.int32()),
        ("latency_s", pa.float64()),
        ("attempts", pa.int32()),
        ("sampling_params", pa.string()),
    ]
)
FAILURE_SCHEMA = pa.schema(
    [("sample_id", pa.string()), ("kind", pa.string()), ("attempts", pa.int32()), ("last_error", pa.string())]
)
FAILURES_FILE = "failures.parquet"


@dataclass
class GenerationStats:
    """What one generation run did. Units: seconds, requests/s, tokens/s."""

    requested: int = 0
    skipped_done: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    failure_kinds: Counter = field(default_factory=Counter)
    output_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    shards_written: int = 0

    def summary(self) -> dict[str, Any]:
        """Flat metadata dict: counts, rates and latency quantiles (ms)."""
        lat = sorted(self.latencies_s)

        def q(p: float) -> float:
            return 1000.0 * lat[min(len(lat) - 1, int(p * (len(lat) - 1) + 0.5))] if lat else 0.0

        wall = max(self.wall_s, 1e-9)
        return {
            "requested": self.requested,
            "skipped_done": self.skipped_done,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "retried": self.retried,
            "finish_reasons": dict(self.finish_reasons),
            "failure_kinds": dict(self.failure_kinds),
            "requests_per_s": round((self.succeeded + self.failed) / wall, 3),
            "output_tokens_per_s": round(self.output_tokens / wall, 1),
            "latency_p50_ms": round(q(0.5), 1),
            "latency_p99_ms": round(q(0.99), 1),
            "wall_s": round(self.wall_s, 2),
            "shards_written": self.shards_written,
        }


def _read_failures(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist() if path.exists() else []


def run_generation(
    prompts: Sequence[tuple[str, list[int]]],
    out_dir: Path,
    client,
    sampling,
    vocab_size: int | None,
    *,
    flush_rows: int = 64,
    flush_seconds: float = 10.0,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = 5.0,
) -> GenerationStats:
    """Generate every prompt not yet in ``out_dir``'s shards; append new shards; rewrite ``failures.parquet``.

    Args:
        prompts: (sample_id, prompt_ids) pairs; ids are ints of the target vocab.
        out_dir: the partition's generations directory.
        client: an ``eagle_assets.serving.client.GenerateClient`` (or anything with the same ``generate_many``).
        sampling: ``SamplingParams`` with an explicit ``max_new_tokens``.
        vocab_size: target vocab size, for validating ``output_ids`` (None skips the range check).
        flush_rows / flush_seconds: shard size and time bound on unflushed work (what a SIGKILL can lose).
        progress: called with a one-line progress message at most every ``progress_every_s`` seconds.
    Returns: ``GenerationStats``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = read_done_ids(out_dir)
    todo, seen = [], set()
    for sid, ids in prompts:
        if sid in done or sid in seen:
            continue
        seen.add(sid)
        todo.append((sid, list(ids)))
    stats = GenerationStats(requested=len(todo), skipped_done=len(done & {s for s, _ in prompts}))
    old_failures = [f for f in _read_failures(out_dir / FAILURES_FILE) if f["sample_id"] not in done]
    new_failures: dict[str, dict] = {}
    buffer: list[dict] = []
    last_flush = time.monotonic()
    last_progress = [time.monotonic()]
    sampling_json = json.dumps(sampling.to_json() if hasattr(sampling, "to_json") else dict(sampling), sort_keys=True)
    started = time.monotonic()

    def flush() -> None:
        nonlocal buffer, last_flush
        if buffer:
            write_parquet_atomic(pa.Table.from_pylist(buffer, schema=GENERATION_SCHEMA), next_shard_path(out_dir))
            stats.shards_written += 1
            buffer = []
        last_flush = time.monotonic()

    def on_result(rid: str, result) -> None:
        attempts = int(getattr(result, "attempts", 1) or 1)
        stats.retried += max(0, attempts - 1)
        if hasattr(result, "output_ids"):
            fr = result.finish_reason
            buffer.append(
                {
                    "sample_id": rid,
                    "output_ids": list(result.output_ids),
                    "finish_reason": fr.type,
                    "matched_stop": fr.matched if isinstance(fr.matched, int) else None,
                    "completion_tokens": result.completion_tokens,
                    "prompt_tokens": result.prompt_tokens,
                    "latency_s": float(getattr(result, "latency_s", None) or result.e2e_latency or 0.0),
                    "attempts": attempts,
                    "sampling_params": sampling_json,
                }
            )
            stats.succeeded += 1
            stats.finish_reasons[fr.type] += 1
            stats.output_tokens += len(result.output_ids)
            stats.latencies_s.append(buffer[-1]["latency_s"])
            new_failures.pop(rid, None)
        else:
            stats.failed += 1
            stats.failure_kinds[result.kind] += 1
            new_failures[rid] = {
                "sample_id": rid,
                "kind": result.kind,
                "attempts": attempts,
                "last_error": str(result.last_error)[:2000],
            }
        now = time.monotonic()
        if len(buffer) >= flush_rows or now - last_flush >= flush_seconds:
            flush()
        if progress is not None and now - last_progress[0] >= progress_every_s:
            last_progress[0] = now
            finished = stats.succeeded + stats.failed
            progress(
                f"generated {finished}/{stats.requested} (failed {stats.failed}, retried {stats.retried}, "
                f"{finished / max(now - started, 1e-9):.2f} req/s)"
            )

    try:
        if todo:
            asyncio.run(client.generate_many(todo, sampling, vocab_size=vocab_size, on_result=on_result))
    finally:
        flush()
        stats.wall_s = time.monotonic() - started
        done_now = read_done_ids(out_dir)
        merged = {f["sample_id"]: f for f in old_failures if f["sample_id"] not in done_now}
        merged.update({k: v for k, v in new_failures.items() if k not in done_now})
        write_parquet_atomic(pa.Table.from_pylist(list(merged.values()), schema=FAILURE_SCHEMA),
                             out_dir / FAILURES_FILE)
    return stats
