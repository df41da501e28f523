"""``raw_prompts.write.write_raw_prompts`` (the streaming body of ``raw_prompts``) against the in-memory path it
replaced: every record gathered as dicts (``collect_prompt_rows``), sorted by the keyed sample hash, cut at
``limit``, sorted by (source_file, source_row), written with one ``pq.write_table``.

Compared on every partition of ``catalogs/default.yaml`` (byte for byte: one row group), on a synthetic ShareGPT
source of 12k records with planted duplicates and bad lines (same rows; small buffers, so many row groups, spill
batches and id-set merges), on a file listed
twice, and for memory: tracemalloc's peak over 4x the records must not grow 4x (the in-memory path grows with the
rows). The duplicate-id set is checked against a plain dict over merges.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_assets.catalog import load_catalog
from eagle_assets.raw_prompts import write as raw_prompts_write
from eagle_assets.raw_prompts.rows import RAW_SCHEMA, REJECT_SCHEMA, SeenIds, collect_prompt_rows
from eagle_assets.raw_prompts.write import sample_order, write_raw_prompts

REPO = Path(__file__).resolve().parents[1]


def _reference(out: Path, key, sources, policy, seed, limit) -> None:
    """The in-memory raw_prompts body before streaming (every row a dict, sorted whole)."""
    kept, rejects = collect_prompt_rows(key, sources, policy)
    rows = sorted(kept.values(), key=lambda r: sample_order(seed, r["sample_id"]))
    if limit is not None:
        rows = rows[:limit]
    rows.sort(key=lambda r: (r["source_file"], r["source_row"]))
    out.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=RAW_SCHEMA), out / "prompts.parquet", compression="zstd")
    pq.write_table(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA), out / "rejects.parquet", compression="zstd")


def _sharegpt(path: Path, n: int, seed: int = 7) -> None:
    """``n`` lines: ~10% repeat another record (duplicates, before or after the first), one in 997 broken JSON."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            j = rng.randrange(n) if i % 10 == 3 else i
            if i % 997 == 5:
                fh.write("{not json\n")
                continue
            fh.write(json.dumps({"id": f"c{j}", "conversations": [
                {"from": "human", "value": f"question {j} " * (j % 7 + 1)}, {"from": "gpt", "value": f"answer {j}"}]})
                + "\n")


@pytest.mark.parametrize("key", sorted(load_catalog(REPO / "catalogs" / "default.yaml").partitions))
def test_default_catalog_partitions_are_byte_identical_to_the_in_memory_path(tmp_path, key):
    spec = load_catalog(REPO / "catalogs" / "default.yaml").partitions[key]
    args = (key, spec.resolved_sources(), spec.prompt_policy)
    _reference(tmp_path / "ref", *args, spec.seed, spec.limit)
    got = write_raw_prompts(*args, tmp_path / "new", seed=spec.seed, limit=spec.limit)
    for name in ("prompts.parquet", "rejects.parquet"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    ref = pq.read_table(tmp_path / "ref" / "prompts.parquet")
    assert got.rows == ref.num_rows == spec.limit
    assert got.rejected == pq.read_metadata(tmp_path / "ref" / "rejects.parquet").num_rows
    assert [p.name for p in (tmp_path / "new").iterdir()] != [] and not list((tmp_path / "new").glob(".*"))


def test_a_12k_record_source_gives_the_same_rows_in_bounded_row_groups(tmp_path, monkeypatch):
    # buffers 8x smaller than the defaults, so 12k records cross as many row groups and spills as ~100k would
    monkeypatch.setattr(raw_prompts_write, "SPILL_ROWS", 128)
    monkeypatch.setattr(raw_prompts_write, "ROW_GROUP_ROWS", 1024)
    monkeypatch.setattr(SeenIds, "MERGE_EVERY", 512)
    src = tmp_path / "big.jsonl"
    _sharegpt(src, 12_000)
    sources = [(src, "sharegpt")]
    kept, rejects = collect_prompt_rows("S", sources, "last_user")
    assert 900 < len(rejects) < 1_500  # duplicates and bad lines planted
    for limit, seed in ((None, 3), (1_200, 11)):
        out = tmp_path / f"new_{limit}"
        got = write_raw_prompts("S", sources, "last_user", out, seed=seed, limit=limit)
        rows = sorted(kept.values(), key=lambda r: sample_order(seed, r["sample_id"]))[:limit]
        rows.sort(key=lambda r: (r["source_file"], r["source_row"]))
        table = pq.read_table(out / "prompts.parquet")
        assert table.equals(pa.Table.from_pylist(rows, schema=RAW_SCHEMA)), limit
        assert pq.read_table(out / "rejects.parquet").equals(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA))
        meta = pq.ParquetFile(out / "prompts.parquet").metadata
        assert max(meta.row_group(i).num_rows for i in range(meta.num_row_groups)) <= raw_prompts_write.ROW_GROUP_ROWS
        assert got.rows == len(rows) and got.available == len(kept) and got.rejected == len(rejects)
        assert meta.num_row_groups == got.row_groups == -(-len(rows) // raw_prompts_write.ROW_GROUP_ROWS)


def test_several_sources_and_a_file_listed_twice_keep_the_in_memory_order(tmp_path):
    a, b = tmp_path / "b_first.jsonl", tmp_path / "a_second.jsonl"  # listed b, a: the output is in name order
    _sharegpt(a, 600, seed=1)
    _sharegpt(b, 900, seed=2)
    # a file of two layouts listed twice, once per layout: each listing keeps the records of its layout (the
    # other's are rejects), and the rows of both are sorted together by source row
    with open(a, "a") as fh:
        for i in range(300):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"m{i}"},
                                              {"role": "assistant", "content": "r"}]}) + "\n")
    sources = [(a, "sharegpt"), (b, "sharegpt"), (a, "messages")]
    for limit in (None, 700):
        _reference(tmp_path / f"ref_{limit}", "M", sources, "last_user", 5, limit)
        write_raw_prompts("M", sources, "last_user", tmp_path / f"new_{limit}", seed=5, limit=limit)
        for name in ("prompts.parquet", "rejects.parquet"):
            assert (pq.read_table(tmp_path / f"new_{limit}" / name)
                    .equals(pq.read_table(tmp_path / f"ref_{limit}" / name))), (limit, name)


def test_seen_ids_agree_with_a_dict_across_merges():
    rng = random.Random(0)
    seen, plain = SeenIds(merge_every=7), {}
    for i in range(3_000):
        sid = f"{rng.randrange(2_000) * 0x9E3779B97F4A7C15 % 2**64:016x}"
        assert seen.get(sid) == plain.get(sid), i
        if sid not in plain:
            seen.add(sid, i % 3, i)
            plain[sid] = (i % 3, i)
    assert len(seen) == len(plain)


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_does_not_grow_with_the_records(tmp_path, monkeypatch):
    # small buffers, so that a few thousand records already span many spill batches and row groups
    monkeypatch.setattr(raw_prompts_write, "SPILL_ROWS", 64)
    monkeypatch.setattr(raw_prompts_write, "ROW_GROUP_ROWS", 128)
    monkeypatch.setattr(SeenIds, "MERGE_EVERY", 128)
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    _sharegpt(small, 600)
    _sharegpt(large, 2_400)
    write_raw_prompts("W", [(small, "sharegpt")], "last_user", tmp_path / "warm")  # imports and caches first
    for limit in (None, 100):
        peaks = [_peak_bytes(lambda p=p: write_raw_prompts("W", [(p, "sharegpt")], "last_user",
                                                           tmp_path / f"o_{p.stem}_{limit}", limit=limit))
                 for p in (small, large)]
        assert peaks[1] < 2 * peaks[0], (limit, peaks)  # 4x the records; only the ~20-byte ids grow
    # the in-memory path the pass replaced does grow with the records (so the check above can fail)
    held = [_peak_bytes(lambda p=p: collect_prompt_rows("W", [(p, "sharegpt")], "last_user")) for p in (small, large)]
    assert held[1] > 3 * held[0], held
