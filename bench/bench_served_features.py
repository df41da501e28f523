"""Served-features throughput: what the JSON transport of aux hidden states costs, per stage, and end to end.

Prints, side by side, for a width ``W`` (default Kimi-K2.5 / DeepSeek-V3's 3H = 21,504):

- the server-side stages SGLang 0.5.23 runs in single Python processes for every row (``tensor.cpu().tolist()`` in
  the scheduler, ``batch_result_processor.py``; the IPC encode to the detokenizer and the tokenizer manager,
  ``io_struct.sock_send``, msgpack or pickle, timed here with pickle as a stand-in; ``orjson.dumps`` of the HTTP
  reply), and the client's ``orjson.loads`` + ``np.asarray``: millions of values per second and tokens per second
  at ``W``;
- JSON bytes per value (bfloat16-exact and float32-exact values) against 2 bytes in a bfloat16 shard;
- with ``--url`` (a server launched with ``--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states``) or
  ``--demo`` (the embedded demo target in this process): rows fetched through
  :class:`eagle_assets.drafter.features.served_client.ServedFeatureSource`, tokens per second and reply bytes per token.

Usage: ``.venv/bin/python bench/bench_served_features.py [--width 21504] [--tokens 256]``
``[--url http://HOST:PORT --model-dir DIR --rows 8 --row-tokens 2048] [--demo]``. On a GPU host, run it once
against the real server before sizing a partition (docs/served_features.md, "First GPU run"). The stage numbers
depend on how free the core is; say how they were taken.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rate(fn, values: int) -> float:
    t = time.perf_counter()
    fn()
    return values / (time.perf_counter() - t) / 1e6


def stages(width: int, tokens: int) -> None:
    import orjson
    import torch

    x = (torch.randn(tokens, width) * 0.5).bfloat16()
    n = x.numel()
    box: dict = {}
    rates = {
        "tolist (scheduler)": _rate(lambda: box.__setitem__("l", x.tolist()), n),
        "pickle.dumps (IPC send, stand-in)": _rate(lambda: box.__setitem__("p", pickle.dumps(box["l"])), n),
        "pickle.loads (IPC recv, stand-in)": _rate(lambda: box.__setitem__("l2", pickle.loads(box["p"])), n),
        "orjson.dumps (HTTP reply)": _rate(lambda: box.__setitem__("j", orjson.dumps([box["l2"]])), n),
        "orjson.loads + np.asarray (client)": _rate(
            lambda: np.asarray(orjson.loads(box["j"])[0], dtype=np.float32), n),
    }
    f32 = orjson.dumps([(torch.randn(64, width) * 0.5).float().double().tolist()])
    print(f"W = {width} values per token, {tokens} tokens per reply")
    print(f"{'stage':38s} {'M values/s':>11s} {'tokens/s':>10s}")
    for name, r in rates.items():
        print(f"{name:38s} {r:11.1f} {r * 1e6 / width:10.0f}")
    print(f"JSON bytes/value: {len(box['j']) / n:.1f} (bfloat16 values), {len(f32) / (64 * width):.1f} (float32 "
          f"values); a bfloat16 shard stores 2.0 -> {len(box['j']) / n / 2:.1f}x less than the JSON")


def end_to_end(url: str, model_dir: str, rows: int, row_tokens: int) -> None:
    from eagle_assets.drafter.features.served_cache import served_features
    from eagle_assets.drafter.features.served_client import ServedFeatureSource, ServedFeaturesSpec

    source = ServedFeatureSource(model_dir, ServedFeaturesSpec(source="served", url=url, teacher="topk", top_k=20))
    rng = np.random.default_rng(0)
    vocab = source.vocab_size
    data = []
    for _ in range(rows):
        ids = rng.integers(0, min(vocab, 30000), row_tokens)
        mask = np.zeros(row_tokens, np.int8)
        mask[row_tokens // 4:] = 1
        data.append((ids, mask))
    t = time.perf_counter()
    got = list(served_features(data, source))
    dt = time.perf_counter() - t
    ok = sum(1 for g in got if not hasattr(g, "reason"))
    s = source.stats
    print(f"end to end ({url}): {ok}/{rows} rows of {row_tokens} tokens in {dt:.1f}s = {rows * row_tokens / dt:.0f} "
          f"tokens/s, {s.reply_bytes / max(1, s.tokens) / 1e3:.0f} KB of JSON per token, refused {dict(s.refused)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=21504)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--url", default=None)
    p.add_argument("--model-dir", default=None, help="the served target's directory (its config.json is read)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--row-tokens", type=int, default=2048)
    p.add_argument("--demo", action="store_true", help="serve the embedded demo target in this process")
    args = p.parse_args()
    stages(args.width, args.tokens)
    if args.demo:
        from eagle_assets.demo.shipped import demo_target
        from eagle_assets.serving.server import serve_in_thread

        target = str(demo_target())
        with serve_in_thread(target, enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3") as srv:
            end_to_end(srv.url, target, args.rows, min(args.row_tokens, 512))
    elif args.url:
        if not args.model_dir:
            p.error("--url needs --model-dir (the target's config.json gives layers and hidden size)")
        end_to_end(args.url, args.model_dir, args.rows, args.row_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
