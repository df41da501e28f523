"""Rendering throughput of the ``tokenized_prompts`` stage (issue 16, item 4: >= 2,000 prompts/s on 2 cores).

Writes N synthetic ShareGPT-like raw prompts (``raw_prompts.rows.RAW_SCHEMA``: one to three user turns, a system prompt
on 1 in 4, a weather tool on 1 in 6, a control-token smuggler on 1 in 500; the last user turn lognormal around
150 words (40-600, as ``bench_scale.write_sharegpt``), earlier turns around 30-40 words) and renders
them with the real Qwen3 tokenizer (/work/shared/data/tokenizers/qwen3-0.6b; EAGLE_SHARED_DATA overrides
/work/shared/data) through ``tokenized_prompts.write.tokenize_partition`` (the body of the asset), once per
``--workers`` value, and, on ``--reference`` of the records, through the per-record reference
``render.render_prompt`` (one ``apply_chat_template`` + one encode per call). Prints prompts/s, CPU seconds per
1,000 prompts (this process and its workers: ``resource.getrusage``), the ratio to the reference, the load average,
and checks that every run wrote the same ``prompts.parquet`` / ``rejects.parquet`` rows.

``--layout sharegpt`` writes one user turn per record instead (``bench_scale.write_sharegpt``'s conversations).

Usage: ``.venv/bin/python bench/bench_render.py [--records 20000] [--workers 1 2] [--reference 2000]``
       ``[--layout mixed|sharegpt] [--repeat R]``
       ``[--profile]`` (cProfile of the one-process pass, top 25 by cumulative time)
       ``[--baseline DIR]`` (the same records through an older tree's ``tokenize_partition``, e.g. ``git archive
       75d4b92 | tar -x -C DIR``: the one-process pass before worker processes and batched rendering).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARED = Path(os.environ.get("EAGLE_SHARED_DATA", "/work/shared/data"))
QWEN = SHARED / "tokenizers" / "qwen3-0.6b"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
WORDS = np.array(["the", "model", "explain", "data", "function", "value", "python", "list", "why", "when",
                  "compute", "number", "proof", "step", "write", "code", "test", "error", "graph", "memory",
                  "train", "token", "answer", "question", "reason", "because", "example", "table", "sort",
                  "search", "tree", "matrix", "vector", "probability", "integral", "server", "request"])


def write_raw(path: Path, n: int, seed: int = 0, layout: str = "mixed") -> None:
    """``n`` synthetic raw prompts (RAW_SCHEMA) in record batches of 4,096; ``layout`` ``sharegpt``: one user turn
    only (``bench_scale.write_sharegpt``'s conversations, the partition job's bench)."""
    from eagle_assets.raw_prompts.rows import RAW_SCHEMA

    rng = np.random.default_rng(seed)
    writer = pq.ParquetWriter(path, RAW_SCHEMA, compression="zstd")
    for lo in range(0, n, 4096):
        rows = []
        for i in range(lo, min(n, lo + 4096)):
            def text(median: int = 150, lo: int = 40) -> str:
                k = int(np.clip(rng.lognormal(np.log(median), 0.6), lo, 600))
                return " ".join(WORDS[rng.integers(0, len(WORDS), k)].tolist()).capitalize() + "?"

            if layout == "sharegpt":
                rows.append({"sample_id": f"c{i:07d}", "messages": json.dumps([{"role": "user", "content": text()}]),
                             "tools": None, "reference_reply": None, "source_file": "bench.jsonl", "source_row": i})
                continue
            messages = [{"role": "system", "content": "You are a careful assistant."}] if i % 4 == 0 else []
            for turn in range(1 + i % 3):
                if turn:
                    messages.append({"role": "assistant", "content": text(40, 10)})
                last = turn == i % 3
                messages.append({"role": "user", "content": text() if last else text(30, 5)})
            if i % 500 == 7:
                messages[-1]["content"] += " <|im_end|>"
            rows.append({"sample_id": f"c{i:07d}", "messages": json.dumps(messages),
                         "tools": json.dumps(WEATHER) if i % 6 == 1 else None, "reference_reply": None,
                         "source_file": "bench.jsonl", "source_row": i})
        writer.write_table(pa.Table.from_pylist(rows, schema=RAW_SCHEMA))
    writer.close()


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reference", type=int, default=2_000, help="records through render_prompt one by one")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of (baseline, each --workers), alternated")
    ap.add_argument("--layout", choices=["mixed", "sharegpt"], default="mixed")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a tree of the code before (git archive <commit> | tar -x -C DIR): its tokenize_partition "
                         "over the same records in a child process, as a ratio")
    args = ap.parse_args()

    from eagle_assets.target_model.profile import detect_profile
    from eagle_assets.target_model.render import RenderError, render_prompt
    from eagle_assets.target_model.tokenizer import load_tokenizer
    from eagle_assets.tokenized_prompts.write import tokenize_partition

    if not QWEN.is_dir():
        print(f"{QWEN} is absent: set EAGLE_SHARED_DATA to the shared data directory")
        return 2
    tok = load_tokenizer(QWEN)
    profile = detect_profile(tok, None)
    tmp = Path(tempfile.mkdtemp(prefix="bench_render."))
    raw = tmp / "raw.parquet"
    write_raw(raw, args.records, layout=args.layout)
    print(f"{args.records:,} records ({args.layout}), Qwen3 tokenizer, {os.cpu_count()} CPUs; load before: "
          f"{open('/proc/loadavg').read().split()[:3]}")

    # the per-record reference path, on the first --reference records
    recs = pq.read_table(raw).slice(0, args.reference).to_pylist()
    t0, c0 = time.perf_counter(), _cpu_s()
    for r in recs:
        try:
            render_prompt(tok, json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None,
                          profile=profile)
        except RenderError:
            pass
    ref_wall, ref_cpu = time.perf_counter() - t0, _cpu_s() - c0
    ref_rate = len(recs) / ref_wall
    print(f"{'path':<34}{'prompts/s':>11}{'CPU s/1k':>10}{'vs ref':>8}  load")
    print(f"{'render_prompt per record':<34}{ref_rate:>11,.0f}{1000 * ref_cpu / len(recs):>10.2f}{1.0:>8.2f}  "
          f"{open('/proc/loadavg').read().split()[0]}")

    outputs = {}
    for _ in range(args.repeat):  # alternated, so load changes hit every path alike
        if args.baseline is not None:
            code = ("import sys, json, time, resource; sys.path.insert(0, sys.argv[1]); from pathlib import Path\n"
                    "from eagle_assets.target_model.profile import detect_profile\n"
                    "from eagle_assets.target_model.tokenizer import load_tokenizer\n"
                    "from eagle_assets.tokenized_prompts.write import tokenize_partition\n"
                    "tok = load_tokenizer(sys.argv[2]); prof = detect_profile(tok, None)\n"
                    "ru = lambda: sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF, "
                    "resource.RUSAGE_CHILDREN) for a in ('ru_utime', 'ru_stime'))\n"
                    "t, c = time.perf_counter(), ru()\n"
                    "s = tokenize_partition(Path(sys.argv[3]), Path(sys.argv[4]), tok, prof)\n"
                    "print(json.dumps([s.rows + s.rejected, time.perf_counter() - t, ru() - c]))\n")
            import subprocess

            out = tmp / "tok_base"
            res = subprocess.run([sys.executable, "-c", code, str(args.baseline), str(QWEN), str(raw), str(out)],
                                 capture_output=True, text=True, check=True)
            n, wall, cpu = json.loads(res.stdout.strip().splitlines()[-1])
            base_rate = n / wall
            print(f"{'baseline tokenize_partition':<34}{base_rate:>11,.0f}{1000 * cpu / n:>10.2f}"
                  f"{base_rate / ref_rate:>8.2f}  {open('/proc/loadavg').read().split()[0]}")
            outputs["baseline"] = (pq.read_table(out / "prompts.parquet"), pq.read_table(out / "rejects.parquet"))
        for workers in args.workers:
            out = tmp / f"tok_w{workers}"
            t0, c0 = time.perf_counter(), _cpu_s()
            if args.profile and workers == 1:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                summary = prof.runcall(tokenize_partition, raw, out, tok, profile, workers=workers)
            else:
                summary = tokenize_partition(raw, out, tok, profile, workers=workers)
            wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
            n = summary.rows + summary.rejected
            print(f"{f'tokenize_partition workers={workers}':<34}{n / wall:>11,.0f}{1000 * cpu / n:>10.2f}"
                  f"{n / wall / ref_rate:>8.2f}  {open('/proc/loadavg').read().split()[0]}")
            outputs[workers] = (pq.read_table(out / "prompts.parquet"), pq.read_table(out / "rejects.parquet"))
            if args.profile and workers == 1:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    first = next(iter(outputs.values()))
    same = all(p.equals(first[0]) and r.equals(first[1]) for p, r in outputs.values())
    print(f"rows {first[0].num_rows:,}, rejects {first[1].num_rows:,}; identical files across runs "
          f"({', '.join(map(str, outputs))}): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
