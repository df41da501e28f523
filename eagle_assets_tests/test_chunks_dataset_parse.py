"""A chunked dataset's sources are parsed once for all its chunks (issue 27 item 2).

``raw_prompts.dataset_parse.dataset_chunk_rows`` (what the ``raw_prompts`` asset runs for a chunk): the first chunk
run to need it parses the dataset into a parse directory shared by the chunks, the others read their own rows from it.
Checked against the full pass of every chunk (``write_raw_prompts`` without a cache, which reads and parses the whole
sources): the same bytes in ``prompts.parquet`` and ``rejects.parquet`` and the same summary, for every chunk, with
and without a ``limit``, with a file listed twice, in several row groups and with more chunks than one pass writes;
no parse after the first; a re-parse when a source's content or a setting changes, none when only its mtime does;
chunks run in any order and at once (real processes on one lock) give one parse and the same files; a killed
build is not taken for a parse; rows keep their chunk when records are added; through Dagster, the chunks' data
versions are those of the full pass.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

import eagle_assets.raw_prompts.dataset_parse as dp
import eagle_assets.raw_prompts.write as rpp
from eagle_assets.formats import FormatError
from eagle_assets.raw_prompts.dataset_parse import dataset_chunk_rows
from eagle_assets.raw_prompts.write import chunk_of, write_raw_prompts

FILES = ("prompts.parquet", "rejects.parquet")
_ITER_PROMPT_ROWS = rpp.iter_prompt_rows  # the real pass over the sources, whatever a test counts


def _source(path: Path, n: int, start: int = 0) -> Path:
    lines = [json.dumps({"question": f"What is {i} * 3?", "answer": str(3 * i)}) for i in range(start, start + n)]
    if start == 0:
        lines[10:10] = ["{broken", json.dumps({"question": 7}), lines[3]]  # a bad line, a bad field, a duplicate
    with open(path, "a") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def _summary(s) -> tuple:
    return s.rows, s.available, s.rejected, dict(s.reasons), s.row_groups


def _same_as_full_pass(sources, out: Path, ref: Path, chunk, **kw):
    """The chunk's files at ``out`` are the bytes the full pass writes for it (written to ``ref``, not counted by a
    :class:`_CountParses`); returns the full pass's summary."""
    counting, rpp.iter_prompt_rows = rpp.iter_prompt_rows, _ITER_PROMPT_ROWS
    try:
        full = write_raw_prompts("D", sources, "last_user", ref, chunk=chunk, **kw)
    finally:
        rpp.iter_prompt_rows = counting
    for name in FILES:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), (name, chunk)
    return full


class _CountParses:
    """Counts the passes over the sources (calls of ``iter_prompt_rows`` by ``raw_prompts.write``)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        inner = rpp.iter_prompt_rows

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(rpp, "iter_prompt_rows", counted)


@pytest.mark.parametrize("limit, listed_twice", [(None, False), (40, False), (None, True), (150, True)])
def test_every_chunk_is_the_full_pass_byte_for_byte_and_only_the_first_parses(tmp_path, monkeypatch, limit,
                                                                              listed_twice):
    monkeypatch.setattr(rpp, "ROW_GROUP_ROWS", 16)  # several row groups per chunk
    monkeypatch.setattr(dp, "MAX_OPEN_CHUNK_FILES", 2)  # 5 chunks: three passes over the sampled rows
    src = _source(tmp_path / "src.jsonl", 200)
    other = _source(tmp_path / "a.jsonl", 30, start=500)  # sorts before src.jsonl: rows are written file by file
    sources = [(src, "auto"), (other, "auto")] + ([(src, "auto")] if listed_twice else [])
    parses = _CountParses(monkeypatch)
    whole, union = write_raw_prompts("D", sources, "last_user", tmp_path / "whole", seed=3, limit=limit), {}
    parses.calls = 0
    for i in range(5):
        got = dataset_chunk_rows("D", sources, "last_user", tmp_path / f"c{i}", tmp_path / "parse", (i, 5), seed=3,
                                 limit=limit)
        assert got.parsed == (i == 0) and parses.calls == 1, "a chunk after the first parsed the sources again"
        full = _same_as_full_pass(sources, tmp_path / f"c{i}", tmp_path / f"ref{i}", (i, 5), seed=3, limit=limit)
        assert _summary(got) == _summary(full)
        assert got.row_groups > 1 or got.rows <= 16
        for r in pq.read_table(tmp_path / f"c{i}" / "prompts.parquet").to_pylist():
            assert chunk_of(r["sample_id"], 5) == i and r["sample_id"] not in union
            union[r["sample_id"]] = r
    assert union == {r["sample_id"]: r for r in pq.read_table(tmp_path / "whole" / "prompts.parquet").to_pylist()}
    assert len(union) == whole.rows == (limit or whole.available)
    # the rejects once: chunk 0 holds the unchunked file
    assert (tmp_path / "c0" / "rejects.parquet").read_bytes() == (tmp_path / "whole" / "rejects.parquet").read_bytes()
    assert [d.name for d in (tmp_path / "parse").iterdir() if d.is_dir()] == [
        dp.dataset_parse_key("D", sources, "last_user", [dp._file_sha256(p) for p, _ in sources], seed=3,
                              limit=limit, chunks=5)]


def test_an_edited_source_or_setting_parses_again_and_the_old_parse_goes(tmp_path, monkeypatch):
    src = _source(tmp_path / "src.jsonl", 120)
    sources = [(src, "auto")]
    parses = _CountParses(monkeypatch)
    run = (lambda i, out, **kw: dataset_chunk_rows("D", sources, "last_user", tmp_path / out, tmp_path / "parse",
                                                   (i, 3), **kw))
    assert run(0, "a0").parsed and not run(1, "a1").parsed and parses.calls == 1
    os.utime(src, ns=(1, 1))  # the same bytes with another mtime: hashed again, the same parse
    assert not run(2, "a2").parsed and parses.calls == 1
    _source(src, 50, start=1000)  # records added: a new parse for the next chunk, whichever it is
    got = run(2, "b2")
    assert got.parsed and parses.calls == 2
    _same_as_full_pass(sources, tmp_path / "b2", tmp_path / "ref-b2", (2, 3))
    assert not run(0, "b0").parsed and parses.calls == 2
    got = run(0, "c0", limit=60)  # another limit: another parse
    assert got.parsed and parses.calls == 3 and got.rows < 60
    _same_as_full_pass(sources, tmp_path / "c0", tmp_path / "ref-c0", (0, 3), limit=60)
    assert len([d for d in (tmp_path / "parse").iterdir() if d.is_dir()]) == 1, "a stale parse was kept"


def test_a_changed_chunk_count_is_another_parse_and_rows_keep_their_chunk_when_records_are_added(tmp_path):
    src = _source(tmp_path / "src.jsonl", 80)
    sources = [(src, "auto")]

    def ids(out: str, chunk, **kw) -> set[str]:
        dataset_chunk_rows("D", sources, "last_user", tmp_path / out, tmp_path / "parse", chunk, **kw)
        return {r["sample_id"] for r in pq.read_table(tmp_path / out / "prompts.parquet").to_pylist()}

    before = ids("before", (1, 4))
    assert ids("other-count", (1, 5)) != before  # the parse of 4 chunks is not read as 5
    _source(src, 80, start=2000)
    after = ids("after", (1, 4), seed=9)
    assert before and before < after and {chunk_of(s, 4) for s in after} == {1}


def test_a_killed_build_is_not_a_parse_and_a_missing_source_is_the_format_error_it_was(tmp_path, monkeypatch):
    src = _source(tmp_path / "src.jsonl", 60)
    sources = [(src, "auto")]
    key = dp.dataset_parse_key("D", sources, "last_user", [dp._file_sha256(src)], seed=0, limit=None, chunks=2)
    left = tmp_path / "parse" / ".build-killed"
    left.mkdir(parents=True)
    (left / "chunk-00000.arrow").write_bytes(b"half")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the run dies mid-build: nothing is renamed into place

    monkeypatch.setattr(dp, "emit_in_order", killed)
    with pytest.raises(KeyboardInterrupt):
        dataset_chunk_rows("D", sources, "last_user", tmp_path / "c1", tmp_path / "parse", (1, 2))
    assert not (tmp_path / "parse" / key).exists() and not (tmp_path / "c1" / "prompts.parquet").exists()
    monkeypatch.undo()
    got = dataset_chunk_rows("D", sources, "last_user", tmp_path / "c1", tmp_path / "parse", (1, 2))
    assert got.parsed and not left.exists()
    _same_as_full_pass(sources, tmp_path / "c1", tmp_path / "ref", (1, 2))
    with pytest.raises(FormatError):
        dataset_chunk_rows("D", [(tmp_path / "absent.jsonl", "auto")], "last_user", tmp_path / "x",
                           tmp_path / "parse", (0, 2))


def _chunk_in_process(args) -> tuple[int, bool]:
    src, out, parse, index, chunks, start = args
    start.wait(60)  # every process starts its chunk at once
    got = dataset_chunk_rows("D", [(Path(src), "auto")], "last_user", Path(out), Path(parse), (index, chunks),
                             limit=300)
    return index, got.parsed


def test_chunks_run_at_once_in_processes_parse_once_and_write_the_full_pass_files(tmp_path):
    src = _source(tmp_path / "src.jsonl", 3000)
    ctx = multiprocessing.get_context("spawn")
    chunks = 4
    with ctx.Manager() as manager:
        start = manager.Event()
        with ctx.Pool(chunks) as pool:
            # in reverse chunk order: whichever chunk comes first parses
            pending = pool.map_async(_chunk_in_process, [(str(src), str(tmp_path / f"c{i}"), str(tmp_path / "parse"),
                                                          i, chunks, start) for i in reversed(range(chunks))])
            start.set()
            results = pending.get(300)
            # close + join: each worker takes its sentinel and exits; the with block's terminate() alone relies on
            # SIGTERM, which a worker started where that signal is ignored never gets (the pool's join then hangs)
            pool.close()
            pool.join()
    assert sorted(i for i, _ in results) == list(range(chunks))
    assert sum(parsed for _, parsed in results) == 1, f"parsed by more than one chunk: {results}"
    for i in range(chunks):
        _same_as_full_pass([(src, "auto")], tmp_path / f"c{i}", tmp_path / f"ref{i}", (i, chunks), limit=300)


def test_the_asset_reads_the_chunks_from_one_parse_with_the_full_pass_data_versions(tmp_path):
    from eagle_assets.assets.prompts import PARSE_STAGE
    from eagle_assets.definitions import build_definitions
    from eagle_assets.lineage.versions import directory_content_version

    src = _source(tmp_path / "src.jsonl", 90)
    catalog = tmp_path / "cat.yaml"
    catalog.write_text(yaml.safe_dump({"partitions": {"D": {
        "sources": [{"path": str(src), "format": "auto"}], "sampling": {"max_new_tokens": 8}, "chunks": 3}}}))
    defs = build_definitions(catalog, storage_root=tmp_path / "store")
    raw = next(a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and a.keys == {dg.AssetKey("raw_prompts")})
    with dg.DagsterInstance.ephemeral() as instance:
        for i, key in enumerate(["D.c02", "D.c00", "D.c01"]):  # any order
            result = dg.materialize([raw], partition_key=key, instance=instance, resources=defs.resources)
            mat = result.asset_materializations_for_node("raw_prompts")[0]
            assert mat.metadata["parsed_sources"].value == (i == 0)
            index = int(key[-2:])
            ref = tmp_path / f"ref-{key}"
            write_raw_prompts("D", [(src, "auto")], "last_user", ref, chunk=(index, 3))
            assert mat.tags["dagster/data_version"] == directory_content_version(ref, FILES)
    assert (tmp_path / "store" / "cat" / PARSE_STAGE / "D").is_dir()


def _chunk_runs_tags(instance, keys) -> dict[str, dict[str, str]]:
    out = {}
    for key in keys:
        record = instance.get_latest_data_version_record(dg.AssetKey("raw_prompts"), partition_key=key)
        out[key] = dict(record.asset_materialization.tags)
    return out


def test_one_run_over_the_chunk_keys_writes_each_chunk_as_its_own_run_would(tmp_path, monkeypatch):
    """``assets.dataset_runs.run_raw_prompts_over_chunks`` (what ``eagle-assets run`` does for a chunked dataset):
    one run, one ``raw_prompts`` step, one parse; per chunk the files, the data version and the provenance tags
    that a run of that chunk alone records, each chunk's own metadata, and ``dagster/data_version`` tags that differ
    between chunks (Dagster alone would give the range one version). A range that is not consecutive is refused."""
    from eagle_assets.assets.dataset_runs import run_raw_prompts_over_chunks
    from eagle_assets.assets.inputs import PARTITION_INPUTS, SOURCE_FILES
    from eagle_assets.definitions import PARTITION_JOB, build_definitions

    src = _source(tmp_path / "src.jsonl", 120)
    catalogs = {}
    for name in ("ranged", "single"):
        catalogs[name] = tmp_path / f"{name}.yaml"
        catalogs[name].write_text(yaml.safe_dump({"partitions": {
            "A": {"sources": [{"path": str(src), "format": "auto"}], "sampling": {"max_new_tokens": 8}},
            "D": {"sources": [{"path": str(src), "format": "auto"}], "sampling": {"max_new_tokens": 8}, "chunks": 4,
                  "limit": 100}}}))
    keys = [f"D.c{i:02d}" for i in range(4)]
    tags = {}
    with dg.DagsterInstance.ephemeral() as instance:
        ranged = build_definitions(catalogs["ranged"], storage_root=tmp_path / "store")
        catalog = ranged.resources["settings"].catalog()
        job = ranged.resolve_job_def(PARTITION_JOB)
        with pytest.raises(ValueError, match="not a consecutive range"):
            run_raw_prompts_over_chunks(job, instance, catalog, [keys[0], keys[2]])
        parses = _CountParses(monkeypatch)
        result = run_raw_prompts_over_chunks(job, instance, catalog, keys)
        assert result.success
        assert parses.calls == 1
        steps = [e.step_key for e in result.all_events if e.event_type_value == "STEP_START"]
        assert steps == ["raw_prompts"]
        mats = {m.partition: m for m in result.asset_materializations_for_node("raw_prompts")}
        assert sorted(mats) == keys
        assert [mats[k].metadata["parsed_sources"].value for k in keys] == [True, False, False, False]
        assert sum(mats[k].metadata["dagster/row_count"].value for k in keys) == 100
        check = [e.asset_check_evaluation_data for e in result.all_events
                 if e.event_type_value == "ASSET_CHECK_EVALUATION"]
        assert len(check) == 1 and check[0].passed and check[0].metadata["prompts"].value == 100
        tags["ranged"] = _chunk_runs_tags(instance, keys)
        # each chunk's latest source_files observation is the one its materialization points at
        for key in keys:
            obs = instance.get_latest_data_version_record(dg.AssetKey(SOURCE_FILES), is_source=True, partition_key=key)
            assert tags["ranged"][key][f"dagster/input_event_pointer/{SOURCE_FILES}"] == str(obs.storage_id)
    with dg.DagsterInstance.ephemeral() as instance:
        single = build_definitions(catalogs["single"], storage_root=tmp_path / "store")
        job = single.resolve_job_def(PARTITION_JOB)
        for key in keys:  # each chunk's run observes its inputs first, as partition_job does
            assert job.execute_in_process(partition_key=key, instance=instance, asset_selection=[
                *(dg.AssetKey(k) for k in PARTITION_INPUTS), dg.AssetKey("raw_prompts")]).success
        tags["single"] = _chunk_runs_tags(instance, keys)
    store = tmp_path / "store"
    for key in keys:
        for name in FILES:
            assert (store / "ranged" / "raw_prompts" / key / name).read_bytes() == \
                (store / "single" / "raw_prompts" / key / name).read_bytes(), (key, name)
        pointer = f"dagster/input_event_pointer/{SOURCE_FILES}"
        assert {k: v for k, v in tags["ranged"][key].items() if k != pointer} == \
            {k: v for k, v in tags["single"][key].items() if k != pointer}, key
    assert len({tags["ranged"][k]["dagster/data_version"] for k in keys}) == 4


def test_one_run_over_the_chunk_keys_names_its_empty_chunks_in_the_check(tmp_path):
    """Three records in 8 chunks: the run succeeds, every chunk is materialized (empty ones with zero rows), and the
    one ``prompts_available`` result fails at WARN naming each empty chunk, as each chunk's own run would."""
    from eagle_assets.assets.dataset_runs import run_raw_prompts_over_chunks
    from eagle_assets.definitions import PARTITION_JOB, build_definitions

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"question": f"q{i}?", "answer": "a"}) + "\n" for i in range(3)))
    catalog = tmp_path / "cat.yaml"
    catalog.write_text(yaml.safe_dump({"partitions": {"D": {
        "sources": [{"path": str(src), "format": "auto"}], "sampling": {"max_new_tokens": 8}, "chunks": 8}}}))
    defs = build_definitions(catalog, storage_root=tmp_path / "store")
    keys = [f"D.c{i:02d}" for i in range(8)]
    with dg.DagsterInstance.ephemeral() as instance:
        result = run_raw_prompts_over_chunks(defs.resolve_job_def(PARTITION_JOB), instance,
                                             defs.resources["settings"].catalog(), keys)
    assert result.success
    rows = {m.partition: m.metadata["dagster/row_count"].value
            for m in result.asset_materializations_for_node("raw_prompts")}
    assert sorted(rows) == keys and sum(rows.values()) == 3
    empty = [k for k in keys if rows[k] == 0]
    assert len(empty) >= 5
    (check,) = [e.asset_check_evaluation_data for e in result.all_events
                if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
    assert check.metadata["empty_partitions"].value == len(empty)
    assert all(f"chunk {k} is empty" in check.description for k in empty)
