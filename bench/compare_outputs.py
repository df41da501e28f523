"""Byte-for-byte comparison of two ``eagle-assets run`` outputs (issue 26: a redesign must not change them).

Hashes (sha256) every Parquet shard, the draft vocab, the training mix and the drafter's ``model.safetensors``
under two storage roots and prints the files that differ or exist on one side only. Exit status 0 when all are
equal, 1 otherwise.

Usage (a run before and after a change, each in its own root)::

    git worktree add /tmp/before <old commit>   # and install it in its own venv
    EAGLE_ASSETS_HOME=/tmp/out-before /tmp/before/.venv/bin/eagle-assets run
    EAGLE_ASSETS_HOME=/tmp/out-after .venv/bin/eagle-assets run
    .venv/bin/python bench/compare_outputs.py /tmp/out-before/default /tmp/out-after/default
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

# What the pipeline produces; run metadata (provenance.json, live_stats.json, logs) carries times and paths.
PATTERNS = ("**/*.parquet", "draft_vocab/**/*.npy", "training_mix/**/*", "drafter_checkpoint/**/model.safetensors")


def digests(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (hex) of every compared file under ``root``."""
    out = {}
    for pattern in PATTERNS:
        for path in sorted(root.glob(pattern)):
            if path.is_file() and "train_state" not in path.parts:
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    a, b = (digests(Path(p)) for p in argv)
    if not a and not b:
        print("no outputs under either root: did both runs finish?")
        return 1
    differ = [k for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    only = sorted(a.keys() ^ b.keys())
    for k in differ:
        print(f"DIFFERS  {k}")
    for k in only:
        print(f"ONE SIDE {k} ({'first' if k in a else 'second'} only)")
    print(f"{len(a.keys() & b.keys()) - len(differ)} equal, {len(differ)} differ, {len(only)} on one side only")
    return 0 if not differ and not only else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
