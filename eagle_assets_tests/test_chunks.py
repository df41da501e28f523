"""A dataset bigger than one run (issue 16 item 5): ``chunks: N`` splits a dataset into N partitions.

- The catalog: chunk keys ``<dataset>.c00`` .., one resolver for every key, clear errors for bad keys; a dataset of
  ``chunks: 1`` keeps its key.
- ``raw_prompts.write``: the chunks' rows are disjoint and their union is the unchunked dataset's rows (same ids,
  same contents), with and without a ``limit`` sample, on a synthetic source with duplicates and bad records and on
  the shared real samples; each reject is recorded once (chunk 0).
- A real Dagster instance: the chunks of a dataset run as ``partition_job`` runs (the demo target against the stub
  SGLang server), the automation condition requests ``dataset_qc`` only once every chunk is done, ``dataset_job``'s
  checks over all chunks give exactly the figures of the unchunked dataset's ``qc_shards`` checks, and the draft
  vocab and training mix of the chunked dataset equal the unchunked one's.
- The CLI's ``--partitions``: a chunked dataset's key stands for all its chunks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.catalog import CatalogError, chunk_keys, load_catalog
from eagle_assets.raw_prompts.write import chunk_of, write_raw_prompts

pytestmark = pytest.mark.slow(seconds=50)  # its share of a parallel session: scheduled early (conftest)

REPO_ROOT = Path(__file__).resolve().parents[1]
LOOSE = {"min_median_tokens": 0, "max_share_short_warn": 1.0, "max_share_short_error": 1.0,
         "max_share_truncated_warn": 1.0, "max_share_truncated_error": 1.0, "max_share_dropped_warn": 1.0,
         "max_share_dropped_error": 1.0}


def _catalog(tmp_path: Path, partitions: dict, name: str = "cat", **top) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**top, "partitions": {
        key: {"sources": [{"path": "src.jsonl", "format": "auto"}], "sampling": {"max_new_tokens": 8}, **spec}
        for key, spec in partitions.items()}}, sort_keys=False))
    (tmp_path / "src.jsonl").touch()
    return path


# --- the catalog -------------------------------------------------------------------------------------------------

def test_chunk_keys_resolve_to_their_dataset_and_chunks_1_keeps_the_key(tmp_path):
    catalog = load_catalog(_catalog(tmp_path, {"A": {}, "B5_big": {"chunks": 8}, "C": {"chunks": 120}}))
    assert chunk_keys("B5_big", 8) == [f"B5_big.c{i:02d}" for i in range(8)]
    assert chunk_keys("C", 120)[0] == "C.c000" and chunk_keys("C", 120)[-1] == "C.c119"
    assert catalog.dataset_keys == ["A", "B5_big", "C"]
    assert catalog.partition_keys == ["A", *chunk_keys("B5_big", 8), *chunk_keys("C", 120)]
    assert catalog.chunked_datasets == ["B5_big", "C"]
    assert catalog.resolve("A") == ("A", None, 1)
    assert catalog.resolve("B5_big.c03") == ("B5_big", 3, 8)
    assert catalog.partition("A") is catalog.partitions["A"]
    spec = catalog.partition("B5_big.c07")
    assert (spec.key, spec.dataset, spec.chunk, spec.chunks) == ("B5_big.c07", "B5_big", 7, 8)
    assert spec.sampling == catalog.partitions["B5_big"].sampling and spec.resolved_sources()
    # the dataset's own spec is untouched by the chunk's copy
    assert (catalog.partitions["B5_big"].key, catalog.partitions["B5_big"].chunk) == ("B5_big", None)


@pytest.mark.parametrize("key, needle", [
    ("B5_big.c08", "no chunk 'B5_big.c08': B5_big has 8 chunks"),
    ("B5_big.c3", "no chunk 'B5_big.c3'"),  # not padded as chunk_keys writes it
    ("A.c00", "A has no chunks"),
    ("Z.c00", "no such partition"),
    ("Z", "no such partition"),
    ("B5_big", "split into 8 chunks: a run takes one chunk -- use its chunk keys B5_big.c00 .. B5_big.c07"),
])
def test_bad_partition_keys_name_the_known_keys(tmp_path, key, needle):
    catalog = load_catalog(_catalog(tmp_path, {"A": {}, "B5_big": {"chunks": 8}}))
    with pytest.raises(CatalogError) as err:
        catalog.partition(key)
    assert needle in str(err.value)
    if "known partitions" in str(err.value):
        assert "B5_big.c00" in str(err.value) and "'A'" in str(err.value)


@pytest.mark.parametrize("chunks", [0, -1, 1001, "many"])
def test_chunks_out_of_range_is_a_catalog_error(tmp_path, chunks):
    with pytest.raises(CatalogError) as err:
        load_catalog(_catalog(tmp_path, {"A": {"chunks": chunks}}))
    assert "partitions.A.chunks" in str(err.value)


def test_the_storage_takes_chunk_keys_as_directories(tmp_path):
    from eagle_assets.storage.shards import Layout

    layout = Layout(tmp_path, "cat")
    assert layout.stage_dir("qc_shards", "B5.c03") == tmp_path / "cat" / "qc_shards" / "B5.c03"
    for bad in ("B5.c03/..", "B5.x03", "B5.c", "B5..c03"):
        with pytest.raises(ValueError):
            layout.stage_dir("qc_shards", bad)


# --- raw_prompts of a chunk --------------------------------------------------------------------------------------

def _rows(out: Path) -> list[dict]:
    return pq.read_table(out / "prompts.parquet").to_pylist()


def _chunked(dataset: str, sources, policy: str, tmp_path: Path, chunks: int, **kw) -> tuple[list, list[list]]:
    whole = write_raw_prompts(dataset, sources, policy, tmp_path / "whole", **kw)
    parts = []
    for i in range(chunks):
        out = tmp_path / f"c{i}"
        summary = write_raw_prompts(dataset, sources, policy, out, chunk=(i, chunks), **kw)
        assert summary.rows == len(_rows(out)) and summary.available == whole.available
        parts.append(_rows(out))
    return _rows(tmp_path / "whole"), parts


def _assert_union(whole: list[dict], parts: list[list[dict]], chunks: int) -> None:
    ids = [r["sample_id"] for p in parts for r in p]
    assert len(ids) == len(set(ids)), "a row in two chunks"
    by_id = {r["sample_id"]: r for p in parts for r in p}
    assert by_id == {r["sample_id"]: r for r in whole}, "the chunks' union is not the dataset"
    for i, part in enumerate(parts):
        assert all(chunk_of(r["sample_id"], chunks) == i for r in part)
        order = [(r["source_file"], r["source_row"]) for r in part]
        assert order == sorted(order)  # each chunk keeps the dataset's row order


@pytest.mark.parametrize("limit, seed", [(None, 0), (25, 0), (25, 7), (500, 3)])
def test_chunks_are_disjoint_and_their_union_is_the_dataset(tmp_path, limit, seed):
    src = tmp_path / "src.jsonl"
    lines = [json.dumps({"question": f"What is {i} * 3?", "answer": str(3 * i)}) for i in range(80)]
    lines[10:10] = ["{broken", json.dumps({"question": 7}), lines[3]]  # a bad line, a bad field, a duplicate
    src.write_text("\n".join(lines) + "\n")
    sources = [(src, "auto"), (src, "auto")]  # the same file twice: every record a duplicate the second time
    whole, parts = _chunked("D", sources, "last_user", tmp_path, 3, seed=seed, limit=limit)
    assert len(whole) == (80 if limit is None else min(limit, 80))
    assert all(parts), "a chunk of a dataset this size is never empty"
    _assert_union(whole, parts, 3)
    # rejects: all of them in chunk 0 (the unchunked file, byte for byte), none in the other chunks
    assert (tmp_path / "c0" / "rejects.parquet").read_bytes() == (tmp_path / "whole" / "rejects.parquet").read_bytes()
    assert pq.read_table(tmp_path / "whole" / "rejects.parquet").num_rows == 3 + 83  # listed twice
    assert [pq.read_table(tmp_path / f"c{i}" / "rejects.parquet").num_rows for i in (1, 2)] == [0, 0]


def test_a_row_keeps_its_chunk_when_records_are_added_and_whatever_the_seed(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(40)))
    before = {r["sample_id"] for r in _rows_of(src, tmp_path / "before", (1, 4), seed=0)}
    with open(src, "a") as fh:
        fh.writelines(json.dumps({"question": f"new {i}", "answer": "a"}) + "\n" for i in range(40))
    after = {r["sample_id"] for r in _rows_of(src, tmp_path / "after", (1, 4), seed=9)}
    assert before and before <= after
    assert [chunk_of(s, 4) for s in after] == [1] * len(after)


def _rows_of(src: Path, out: Path, chunk, **kw) -> list[dict]:
    write_raw_prompts("D", [(src, "auto")], "last_user", out, chunk=chunk, **kw)
    return _rows(out)


def test_chunks_of_the_shared_real_datasets_union_to_the_dataset(shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_SHARED_DATA", str(shared_data))
    catalog = load_catalog(REPO_ROOT / "catalogs" / "shared-real.yaml")
    for key, spec in catalog.partitions.items():
        for limit in (spec.limit, None):
            out = tmp_path / f"{key}-{limit}"
            whole, parts = _chunked(key, spec.resolved_sources(), spec.prompt_policy, out, 3, seed=spec.seed,
                                    limit=limit)
            assert whole, key
            _assert_union(whole, parts, 3)


# --- a real Dagster instance -------------------------------------------------------------------------------------

def _pipeline_catalog(root: Path, name: str, chunks: int, target: Path, url: str) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    spec = {"sources": [{"path": str(root / "code.jsonl"), "format": "opencodeinstruct"}],
            "prompt_policy": "last_user", "sampling": {"max_new_tokens": 24, "temperature": 0.0},
            "thresholds": LOOSE, "chunks": chunks}
    training = {**base["training"], "holdout_fraction": 0.3, "holdout_rows": 5, "validation_rows": 2,
                "unseen_eval": None, "mix": {"token_budget": 300, "bucket_caps": [], "seed": 3}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": str(target)}, "server": {"url": url, "concurrency": 4},
                                    "partitions": {"D": spec}, "training": training}, sort_keys=False))
    return path


def _checks(result) -> dict[tuple[str, str], object]:
    return {(e.asset_check_evaluation_data.asset_key.to_user_string(), e.asset_check_evaluation_data.check_name):
            e.asset_check_evaluation_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}


def _figures(check) -> dict:
    return {k: v.value for k, v in check.metadata.items() if isinstance(v.value, float)}


def _requested(result, defs) -> set[tuple[str, str | None]]:
    return {(k.to_user_string(), pk) for k in defs.resolve_asset_graph().materializable_asset_keys
            for pk in result.get_requested_partitions(k)}


@pytest.fixture(scope="module")
def runs(demo_target, tmp_path_factory):
    """The demo dataset ``D`` through a real instance twice: unchunked (catalog ``whole``) and in 3 chunks
    (catalog ``chunked``), then each catalog's draft vocab and training mix."""
    from eagle_assets.definitions import DATASET_JOB, PARTITION_JOB, build_definitions
    from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

    root = tmp_path_factory.mktemp("chunks")
    target = root / "target"
    shutil.copytree(demo_target, target)
    shutil.copy(REPO_ROOT / "catalogs" / "demo_data" / "B2_opencodeinstruct.jsonl", root / "code.jsonl")
    from eagle_assets.target_model.tokenizer import load_tokenizer

    # replies that close the reasoning block the demo template opens: QC keeps most rows, so there is a mix
    stub = StubServer(vocab_size=json.loads((target / "config.json").read_text())["vocab_size"],
                      think_end_id=load_tokenizer(target).convert_tokens_to_ids("</think>"))
    out: dict = {"root": root}
    with serve_stub_in_thread(stub) as running, dg.DagsterInstance.ephemeral() as instance:
        whole = build_definitions(_pipeline_catalog(root, "whole", 1, target, running.url), root / "store")
        chunked = build_definitions(_pipeline_catalog(root, "chunked", 3, target, running.url), root / "store")
        out["defs"] = {"whole": whole, "chunked": chunked}
        out["whole_run"] = whole.resolve_job_def(PARTITION_JOB).execute_in_process(
            partition_key="D", instance=instance, raise_on_error=False)
        assert "dataset_qc" not in {k.to_user_string() for k in whole.resolve_asset_graph().get_all_asset_keys()}
        # the chunks one run each; the automation condition asks for dataset_qc[D] only once all three are done
        ticks, cursor = [], None
        for key in chunk_keys("D", 3):
            run = chunked.resolve_job_def(PARTITION_JOB).execute_in_process(
                partition_key=key, instance=instance, raise_on_error=False)
            assert run.success, key
            result = dg.evaluate_automation_conditions(defs=chunked, instance=instance, cursor=cursor)
            cursor = result.cursor
            ticks.append({r for r in _requested(result, chunked) if r[0] == "dataset_qc"})
        out["ticks"] = ticks
        out["dataset_run"] = chunked.resolve_job_def(DATASET_JOB).execute_in_process(
            partition_key="D", instance=instance, raise_on_error=False)
        # the same dataset through the CLI, as a user runs it: raw_prompts over the chunk keys in one run, then the
        # chunks' runs of the rest, then dataset_job (its own catalog name, so its own store and a fresh instance)
        from eagle_assets.cli import main

        home = root / "cli_home"
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        printed = io.StringIO()
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
            mp.setenv("DAGSTER_HOME", str(home))
            mp.delenv("EAGLE_ASSETS_CATALOG", raising=False)
            mp.setenv("EAGLE_ASSETS_HOME", str(root / "store"))
            out["cli"] = (main(["run", "--catalog", str(_pipeline_catalog(root, "cli", 3, target, running.url)),
                                "--skip-training"]), printed.getvalue(), home)
        for name, defs in out["defs"].items():
            assets = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition)]
            out[f"{name}_training"] = dg.materialize(
                assets, selection=["draft_vocab", "training_mix"], instance=instance, resources=defs.resources,
                raise_on_error=False)
    yield out


def test_the_chunks_run_as_partitions_and_dataset_qc_waits_for_all_of_them(runs):
    assert runs["whole_run"].success
    assert runs["ticks"] == [set(), set(), {("dataset_qc", "D")}]
    assert runs["dataset_run"].success
    meta = runs["dataset_run"].asset_materializations_for_node("dataset_qc")[0].metadata
    assert meta["chunks"].value == 3 and set(meta["rows_by_chunk"].value) == set(chunk_keys("D", 3))
    status = json.loads((runs["root"] / "store" / "chunked" / "dataset_qc" / "D" / "qc_status.json").read_text())
    assert status["passed"] and sum(status["rows_by_chunk"].values()) == status["rows"] > 0


def test_the_cli_runs_a_chunked_datasets_raw_prompts_in_one_run_and_each_chunk_from_its_rows(runs):
    """``eagle-assets run`` on a dataset in 3 chunks: one run writes every chunk's raw_prompts (one step, one
    parse), each chunk's run does the rest without a raw_prompts step, dataset_job passes, and every chunk's
    raw_prompts and tokenized_prompts files are the bytes of the chunk runs that did raw_prompts themselves."""
    from eagle_assets.lineage.versions import directory_content_version

    rc, printed, home = runs["cli"]
    assert rc == 0, printed[-3000:]
    assert "dataset D: raw_prompts of its 3 chunks in one run: ok" in printed
    assert "dataset D (3 chunks): dataset_job ok" in printed
    # the one raw_prompts run says what the dataset read, in counts that add up; each chunk's run, which did not
    # run raw_prompts, prints no raw_prompts line of its own
    raw = runs["root"] / "store" / "cli" / "raw_prompts"
    usable = sum(pq.read_metadata(raw / key / "prompts.parquet").num_rows for key in chunk_keys("D", 3))
    set_aside = pq.read_table(raw / "D.c00" / "rejects.parquet").column("reason").to_pylist()
    lines = printed.splitlines()
    [line] = [line for line in lines if line.startswith("  raw_prompts: dataset D, 3 chunks: ")]
    assert line.startswith(f"  raw_prompts: dataset D, 3 chunks: read {usable + len(set_aside)} records; ")
    assert line.endswith(f"; {usable} usable, all kept"), line
    assert (f"; {len(set_aside)} set aside (" in line) == bool(set_aside), line
    chunk_blocks = printed.split("partition D.c00: ", 1)[1]
    assert "  raw_prompts:" not in chunk_blocks
    with dg.DagsterInstance.from_config(str(home)) as instance:
        raw_steps = {}
        for run in instance.get_runs(dg.RunsFilter(job_name="partition_job")):
            starts = [r.dagster_event.step_key for r in instance.all_logs(run.run_id)
                      if r.dagster_event is not None and r.dagster_event.event_type_value == "STEP_START"]
            raw_steps[run.tags.get("dagster/partition") or (run.tags["dagster/asset_partition_range_start"],
                                                            run.tags["dagster/asset_partition_range_end"])] = \
                starts.count("raw_prompts")
        assert raw_steps == {("D.c00", "D.c02"): 1, "D.c00": 0, "D.c01": 0, "D.c02": 0}
        for key in chunk_keys("D", 3):  # each chunk's own data version: that of its files, as a run of it records
            record = instance.get_latest_data_version_record(dg.AssetKey("raw_prompts"), partition_key=key)
            assert record.asset_materialization.tags["dagster/data_version"] == directory_content_version(
                runs["root"] / "store" / "cli" / "raw_prompts" / key, ("prompts.parquet", "rejects.parquet"))
    store = runs["root"] / "store"
    for key in chunk_keys("D", 3):
        for stage in ("raw_prompts", "tokenized_prompts"):
            for name in ("prompts.parquet", "rejects.parquet"):
                assert (store / "cli" / stage / key / name).read_bytes() == \
                    (store / "chunked" / stage / key / name).read_bytes(), (key, stage, name)


def test_dataset_checks_over_the_chunks_equal_the_unchunked_checks(runs):
    store = runs["root"] / "store"
    whole_rows = pq.read_table(store / "whole" / "qc_shards" / "D" / "rows.parquet").to_pylist()
    chunk_rows = [r for k in chunk_keys("D", 3)
                  for r in pq.read_table(store / "chunked" / "qc_shards" / k / "rows.parquet").to_pylist()]
    key = (lambda r: r["sample_id"])
    assert len(whole_rows) > 40 and sorted(chunk_rows, key=key) == sorted(whole_rows, key=key)
    assert {r["partition"] for r in chunk_rows} == {"D"}  # the rows name the dataset, not the chunk
    whole, dataset = _checks(runs["whole_run"]), _checks(runs["dataset_run"])
    for name in ("token_structure", "response_length"):
        a, b = whole[("qc_shards", name)], dataset[("dataset_qc", name)]
        assert (a.passed, a.description) == (b.passed, b.description)
        assert _figures(a) == _figures(b) and _figures(a)["count"] == len(whole_rows)
        assert a.metadata["qc_verdict"].value == b.metadata["qc_verdict"].value
    # one verdict for the dataset, the same words whether it ran whole or in chunks
    from eagle_assets.qc.status import dataset_verdict, partition_verdict
    from eagle_assets.storage.shards import Layout

    chunked = dataset_verdict(Layout(store, "chunked"), "D")
    assert chunked.text() == partition_verdict(Layout(store, "whole"), "D").text()
    assert chunked.rows == len(whole_rows) and chunked.verdict in ("passed", "warned")
    # the length report of the chunked catalog has one line per span for the dataset, as the unchunked one
    whole_report = pq.read_table(store / "whole" / "length_report" / "report.parquet").to_pylist()
    chunk_report = pq.read_table(store / "chunked" / "length_report" / "report.parquet").to_pylist()
    assert chunk_report == whole_report and {r["partition"] for r in chunk_report} == {"D"}


def test_a_chunked_dataset_trains_exactly_as_the_unchunked_one(runs):
    store = runs["root"] / "store"
    assert runs["whole_training"].success and runs["chunked_training"].success
    for name in ("d2t.npy", "t2d.npy", "token_counts.npy"):
        assert np.array_equal(np.load(store / "whole" / "draft_vocab" / name),
                              np.load(store / "chunked" / "draft_vocab" / name)), name
    whole_mix = pq.read_table(store / "whole" / "training_mix" / "mix.parquet").to_pylist()
    chunk_mix = pq.read_table(store / "chunked" / "training_mix" / "mix.parquet").to_pylist()
    assert whole_mix and chunk_mix == whole_mix and {r["partition"] for r in chunk_mix} == {"D"}
    # the held-out split is the dataset's: the same rows, whichever chunk they are in
    from eagle_assets.assets.resources import PipelineSettings
    from eagle_assets.drafter.data.splits import load_split_rows

    for split in ("validation", "test"):
        got = {}
        for name in ("whole", "chunked"):
            settings = PipelineSettings(catalog_path=str(runs["root"] / f"{name}.yaml"), storage_root=str(store))
            got[name] = sorted(sid for sid, *_ in load_split_rows(settings.layout(), settings.catalog(), ["D"], split))
        assert got["whole"] and got["whole"] == got["chunked"], split


def test_training_waits_for_every_chunk(runs, tmp_path):
    from eagle_assets.assets.resources import PipelineSettings
    from eagle_assets.qc.status import passing_datasets

    store = tmp_path / "store"
    shutil.copytree(runs["root"] / "store" / "chunked", store / "chunked")
    settings = PipelineSettings(catalog_path=str(runs["root"] / "chunked.yaml"), storage_root=str(store))
    assert passing_datasets(settings.layout(), settings.catalog()) == (["D"], {})
    (store / "chunked" / "qc_shards" / "D.c01" / "qc_status.json").unlink()
    ok, excluded = passing_datasets(settings.layout(), settings.catalog())
    assert ok == [] and "no QC shards yet for chunks ['D.c01']" in excluded["D"]


def test_every_chunk_gets_the_per_step_k8s_config(runs):
    from eagle_assets.assets.k8s import step_k8s_config

    catalog = load_catalog(runs["root"] / "chunked.yaml")
    steps = step_k8s_config(catalog)
    ops = {node.name for node in runs["defs"]["chunked"].resolve_job_def("dataset_job").graph.node_defs}
    assert ops <= set(steps) and "dataset_qc" in steps


# --- the CLI -----------------------------------------------------------------------------------------------------

def test_cli_partitions_expand_a_chunked_dataset_and_refuse_unknown_keys(tmp_path):
    from eagle_assets.cli import chunks_without_qc, selected_partition_keys
    from eagle_assets.storage.shards import Layout

    catalog = load_catalog(_catalog(tmp_path, {"A": {}, "B": {"chunks": 3}}))
    assert selected_partition_keys(catalog, None) == ["A", "B.c00", "B.c01", "B.c02"]
    assert selected_partition_keys(catalog, "B,A,B.c01") == ["B.c00", "B.c01", "B.c02", "A"]
    assert selected_partition_keys(catalog, "B.c02") == ["B.c02"]
    for bad in ("C", "B.c3", "A.c00"):
        with pytest.raises(CatalogError):
            selected_partition_keys(catalog, bad)
    layout = Layout(tmp_path / "store", "cat")
    # an empty list = every chunk has QC rows: dataset_job can check the dataset
    assert chunks_without_qc(catalog, layout, ["B.c00"]) == {"B": ["B.c00", "B.c01", "B.c02"]}
    for key in chunk_keys("B", 3):
        (layout.stage_dir("qc_shards", key) / "rows.parquet").touch()
    assert chunks_without_qc(catalog, layout, ["B.c00"]) == {"B": []}
    assert chunks_without_qc(catalog, layout, ["A"]) == {}
    assert os.path.isdir(layout.base / "qc_shards" / "B.c02")


def test_cli_refuses_a_bad_chunks_value_with_the_catalog_message_not_a_traceback(tmp_path, capsys):
    from eagle_assets.cli import main

    path = _catalog(tmp_path, {"A": {"chunks": 0}})
    assert main(["run", "--catalog", str(path), "--skip-training"]) == 2
    out = capsys.readouterr().out
    assert "partitions.A.chunks" in out and "greater than or equal to 1" in out and "Traceback" not in out


def test_an_empty_chunk_says_so_and_its_dataset_still_has_rows(tmp_path):
    from eagle_assets.definitions import build_definitions

    catalog_path = _catalog(tmp_path, {"D": {"chunks": 40}})
    (tmp_path / "src.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n"
                                                for i in range(3)))
    catalog = load_catalog(catalog_path)
    sids = {r["sample_id"] for r in _rows_of(tmp_path / "src.jsonl", tmp_path / "whole", None)}
    empty = next(k for k in catalog.partition_keys if catalog.resolve(k)[1] not in {chunk_of(s, 40) for s in sids})
    defs = build_definitions(catalog_path, storage_root=tmp_path / "store")
    raw = next(a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and a.keys == {dg.AssetKey("raw_prompts")})
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([raw], partition_key=empty, instance=instance, resources=defs.resources)
    check = _checks(result)[("raw_prompts", "prompts_available")]
    assert not check.passed
    assert check.description.startswith(f"chunk {empty} is empty: none of the rows of dataset D (3 available)")
