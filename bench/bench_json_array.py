"""Reading one large JSON-array source (issue 16: glaive-function-calling-v2 ships as a single ~113k-record array):
seconds and peak RSS of ``formats.reader.iter_raw_records`` over every record, this tree against another tree
(``--baseline DIR``, e.g. ``git worktree add /tmp/base <commit before the streaming reader>``), side by side in one
run, each in a fresh process (its own ``VmHWM``).

The file: ``--records N`` glaive-shaped records (a system prompt with a function schema, a chat of 2-6 turns, ~1.5 KB
each), written once as one JSON array with ``json.dump`` (one line, as ``datasets`` exports it).

Usage: ``.venv/bin/python bench/bench_json_array.py [--records 113000] [--baseline DIR]``
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec from the forking parent (which built the file)
CHILD = """
import sys, time
def hwm_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
sys.path.insert(0, sys.argv[1])
from eagle_assets.formats.reader import iter_raw_records
imported = hwm_kb()
t = time.perf_counter()
n = sum(1 for _ in iter_raw_records(sys.argv[2]))
print(n, time.perf_counter() - t, hwm_kb(), imported)
"""


def write_array(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    schema = {"name": "get_weather", "description": "Get the weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    records = []
    for i in range(n):
        turns = rng.randrange(2, 7)
        chat = " ".join(f"USER: question {i}.{t} " + "word " * rng.randrange(20, 80) + "ASSISTANT: answer "
                        + "word " * rng.randrange(20, 80) for t in range(turns // 2 + 1))
        records.append({"system": "SYSTEM: You are a helpful assistant with access to the following functions. "
                                  + json.dumps(schema), "chat": chat})
    with open(path, "w") as fh:
        json.dump(records, fh)


def measure(tree: Path, path: Path) -> tuple[int, float, float, float]:
    """(records, seconds, peak RSS in MB, RSS in MB once the reader is imported) of one fresh process reading
    ``path`` with ``tree``'s reader."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(path)], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), float(out[1]), int(out[2]) / 1024, int(out[3]) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=113_000)
    ap.add_argument("--baseline", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "glaive.json"
        t = time.perf_counter()
        write_array(path, args.records)
        print(f"{args.records:,} records, {path.stat().st_size / 1e6:.0f} MB, one JSON array "
              f"(written in {time.perf_counter() - t:.1f} s)")
        rows = [("this tree (streamed)", REPO)]
        if args.baseline:
            rows.append(("baseline", args.baseline.resolve()))
        results = []
        for name, tree in rows:
            results.append((name, *measure(tree, path)))
        print(f"{'reader':<24}{'records':>10}{'seconds':>10}{'peak RSS MB':>13}{'of it imports':>15}")
        for name, n, sec, rss, base in results:
            print(f"{name:<24}{n:>10,}{sec:>10.2f}{rss:>13.0f}{base:>15.0f}")
        if len(results) == 2:
            (_, n0, s0, r0, _), (_, n1, s1, r1, _) = results
            assert n0 == n1, "the readers disagree on the number of records"
            print(f"ratio baseline/this: seconds {s1 / s0:.2f}x, peak RSS {r1 / r0:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
