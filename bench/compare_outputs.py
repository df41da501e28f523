"""Comparison of two ``eagle-assets run`` outputs (issue 26: a redesign must not change them).

Hashes (sha256) every Parquet shard, the draft vocab, the training mix, the drafter's ``model.safetensors`` and
``config.json`` under two storage roots (lock files, which hold no data, are left out), and compares the evaluation
report's figures (``evaluation/report.json``'s records, gates, overlap and suites not measured; its wall-clock
``seconds`` and the keys that describe what the figures stand on are not figures). Where a Parquet file's bytes
differ, its asset partition is compared again as rows: the partition's shards read together, the columns that
carry wall-clock time dropped (``VOLATILE``), every row written as canonical JSON and the rows sorted. Two runs of
the SAME code differ there too, for reasons outside the code:

- ``generations`` flushes a shard every ``flush_rows`` rows OR every ``flush_seconds``, and writes rows in the
  order the server finishes them, so the shard boundaries and the row order follow the run's timing;
- ``latency_s`` is the request's measured wall time;
- multi-turn ``qc_shards`` keep the generation order of their turn rows.

A partition is reported ``equal`` (bytes), ``equal as rows`` (same rows, other order or sharding) or ``DIFFERS``.
Exit status 0 when nothing differs as rows, 1 otherwise.

Usage (a run before and after a change, each in its own root, on one catalog whose sources and target are at the
same absolute paths for both, since ``raw_prompts`` records each source's path)::

    git worktree add /tmp/before <old commit>
    EAGLE_ASSETS_HOME=/tmp/out-before PYTHONPATH=/tmp/before .venv/bin/python -m eagle_assets.cli run   # in /tmp/before
    EAGLE_ASSETS_HOME=/tmp/out-after .venv/bin/eagle-assets run
    .venv/bin/python bench/compare_outputs.py /tmp/out-before/<catalog> /tmp/out-after/<catalog>
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

# What the pipeline produces; run metadata (provenance.json, live_stats.json, logs) carries times and paths.
PATTERNS = ("**/*.parquet", "draft_vocab/**/*.npy", "training_mix/**/*", "drafter_checkpoint/**/model.safetensors",
            "drafter_checkpoint/checkpoint/config.json")
# The evaluation report: its figures are compared, not its bytes (``seconds`` is how long the measuring took):
# the records, the gates (their levels, taus and text), the overlap counts and the suites not measured. Other keys
# describe what the figures stand on (``qc``, ``heldout_qc``: QC verdicts, since issue 47) and are listed where
# one side has them and the other not, without counting as a difference of figures.
REPORT = "evaluation/report.json"
REPORT_VOLATILE = frozenset({"seconds"})
REPORT_FIGURES = ("records", "gates", "overlap_rows", "missing")
# Columns that hold a measured duration, not data.
VOLATILE = frozenset({"latency_s"})


def digests(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (hex) of every compared file under ``root``."""
    out = {}
    for pattern in PATTERNS:
        for path in sorted(root.glob(pattern)):
            if path.is_file() and "train_state" not in path.parts and not path.name.startswith("."):
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def group_of(rel: str) -> str:
    """The asset partition a file belongs to, and for shards the shard family: ``generations/B1/shard`` for
    ``generations/B1/shard-00002.parquet``, the path itself for any other file."""
    path = Path(rel)
    return str(path.parent / "shard") if path.name.startswith("shard-") and path.suffix == ".parquet" else rel


def row_digest(root: Path, rels: list[str]) -> tuple[int, str]:
    """(row count, sha256 of the sorted canonical JSON rows) of the Parquet files ``rels`` under ``root`` read as
    one table, without the ``VOLATILE`` columns."""
    import pyarrow.parquet as pq

    rows: list[str] = []
    for rel in sorted(rels):
        table = pq.read_table(root / rel)
        table = table.drop_columns([c for c in table.column_names if c in VOLATILE])
        rows.extend(json.dumps(r, sort_keys=True, default=str) for r in table.to_pylist())
    rows.sort()
    return len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest()


def compare(a_root: Path, b_root: Path) -> dict[str, str]:
    """Group (see :func:`group_of`) -> ``equal`` | ``equal as rows`` | ``DIFFERS`` | ``first only`` |
    ``second only``."""
    a, b = digests(a_root), digests(b_root)
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for side, found in ((0, a), (1, b)):
        for rel in found:
            groups.setdefault(group_of(rel), ([], []))[side].append(rel)
    out = {}
    for group, (ra, rb) in sorted(groups.items()):
        if not ra or not rb:
            out[group] = "first only" if ra else "second only"
        elif sorted(ra) == sorted(rb) and all(a[r] == b[r] for r in ra):
            out[group] = "equal"
        elif all(r.endswith(".parquet") for r in ra + rb) and row_digest(a_root, ra) == row_digest(b_root, rb):
            out[group] = "equal as rows"
        else:
            out[group] = "DIFFERS"
    reports = [root / REPORT for root in (a_root, b_root)]
    if any(r.exists() for r in reports):
        docs = [json.loads(r.read_text()) if r.exists() else None for r in reports]
        figures = [{k: d.get(k) for k in REPORT_FIGURES} if d is not None else None for d in docs]
        out[REPORT + " (figures)"] = ("first only" if figures[1] is None else "second only" if figures[0] is None
                                       else "equal" if figures[0] == figures[1] else "DIFFERS")
    return out


def report_keys_one_side(a_root: Path, b_root: Path) -> dict[str, list[str]]:
    """The descriptive keys of ``evaluation/report.json`` (not figures, not volatile) that only one root's report
    has: ``{"first only": [...], "second only": [...]}`` (empty lists when both reports have the same keys or one
    report is missing)."""
    docs = [json.loads((root / REPORT).read_text()) if (root / REPORT).exists() else None for root in (a_root, b_root)]
    if None in docs:
        return {"first only": [], "second only": []}
    keys = [set(d) - set(REPORT_FIGURES) - REPORT_VOLATILE for d in docs]
    return {"first only": sorted(keys[0] - keys[1]), "second only": sorted(keys[1] - keys[0])}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    a_root, b_root = (Path(p) for p in argv)
    verdicts = compare(a_root, b_root)
    if not verdicts:
        print("no outputs under either root: did both runs finish?")
        return 1
    for group, verdict in verdicts.items():
        print(f"{verdict:14s} {group}")
    for side, keys in report_keys_one_side(a_root, b_root).items():
        if keys:
            print(f"{'(' + side + ')':14s} {REPORT} keys {', '.join(keys)} (what the figures stand on; not figures)")
    counts = {v: sum(x == v for x in verdicts.values()) for v in dict.fromkeys(verdicts.values())}
    print(", ".join(f"{n} {v}" for v, n in counts.items()))
    return 0 if set(verdicts.values()) <= {"equal", "equal as rows"} else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
