"""Staleness and declarative automation on a real Dagster instance with real materializations.

Two partitions run through ``partition_job`` against ``StubServer`` (a real HTTP server speaking SGLang's
``/generate``, model-free and deterministic: its ``output_ids`` are a function of the prompt ids and
``max_new_tokens``, so a changed prompt or cap changes the rows). The target is a copy of the embedded demo target
whose chat template the tests edit. Then, per edit (a partition's sampling block, the chat template, a source
file), the ``inputs_sensor`` observes, Dagster's stale-status resolver says what is unsynced, and
``dg.evaluate_automation_conditions`` is run tick after tick, executing what each tick requests (one run per
partition, as the backfill policy does; the training assets are requested but not trained here, that is
``test_pipeline_e2e`` / ``test_orchestration_live``), until nothing more is requested.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.assets.automation import unsynced
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.sensors import build_inputs_sensor
from eagle_assets.definitions import PARTITION_JOB, build_definitions
from eagle_assets.generations.staging import GENERATION_INPUTS_FILE
from eagle_assets.storage.shards import read_shards, shard_paths
from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

pytestmark = [pytest.mark.slow(seconds=90), pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[1]
KEYS = ["B1_glaive", "B2_code"]
# evaluation: every catalog has it (its held-out table), requested with training once QC data changed
TRAINING = {"draft_vocab", "training_mix", "drafter_checkpoint", "speculators_export", "specforge_export",
            "evaluation"}
AFTER_QC = {("length_report", None), *((name, None) for name in TRAINING)}
LOOSE = {"min_median_tokens": 0, "max_share_short_warn": 1.0, "max_share_short_error": 1.0,
         "max_share_truncated_warn": 1.0, "max_share_truncated_error": 1.0, "max_share_dropped_warn": 1.0,
         "max_share_dropped_error": 1.0}


@dataclass
class Pipeline:
    root: Path
    catalog: Path
    catalog_dict: dict
    target: Path
    store: Path
    defs: dg.Definitions
    instance: dg.DagsterInstance
    resources: dict
    cursor: object = None  # the automation cursor, carried from tick to tick
    sensor_cursor: str | None = None


def _write_catalog(p: Pipeline) -> None:
    before = p.catalog.stat().st_mtime_ns if p.catalog.exists() else 0
    p.catalog.write_text(yaml.safe_dump(p.catalog_dict, sort_keys=False))
    import os

    later = max(before + 1_000_000_000, p.catalog.stat().st_mtime_ns)  # the settings resource keys on mtime
    os.utime(p.catalog, ns=(later, later))


def observe(p: Pipeline) -> set[tuple[str, str | None]]:
    """One inputs-sensor tick; its observations stored as the daemon stores them. Returns what it observed."""
    result = build_inputs_sensor(KEYS)(dg.build_sensor_context(instance=p.instance, cursor=p.sensor_cursor,
                                                                resources=p.resources))
    p.sensor_cursor = result.cursor
    for event in result.asset_events:
        p.instance.report_runless_asset_event(event)
    return {(e.asset_key.to_user_string(), e.partition) for e in result.asset_events}


def _requested(result, defs: dg.Definitions) -> set[tuple[str, str | None]]:
    return {(k.to_user_string(), pk) for k in defs.resolve_asset_graph().materializable_asset_keys
            for pk in result.get_requested_partitions(k)}


def automate(p: Pipeline, max_ticks: int = 6) -> list[set[tuple[str, str | None]]]:
    """Evaluate the automation conditions tick after tick, executing each tick's requests (training assets
    excepted), until a tick requests nothing. Returns the requests of each tick."""
    job = p.defs.resolve_implicit_global_asset_job_def()
    ticks = []
    for _ in range(max_ticks):
        result = dg.evaluate_automation_conditions(defs=p.defs, instance=p.instance, cursor=p.cursor)
        p.cursor = result.cursor
        requested = _requested(result, p.defs)
        if not requested:
            return ticks
        ticks.append(requested)
        by_partition: dict[str | None, list[str]] = {}
        for name, pk in requested:
            if name not in TRAINING:
                by_partition.setdefault(pk, []).append(name)
        for pk, names in sorted(by_partition.items(), key=lambda kv: str(kv[0])):
            run = job.execute_in_process(instance=p.instance, partition_key=pk,
                                         asset_selection=[dg.AssetKey(n) for n in names])
            assert run.success, (pk, names)
    raise AssertionError(f"automation still requesting after {max_ticks} ticks: {ticks}")


def _partition_runs(p: Pipeline) -> int:
    return len(p.instance.get_runs())


@pytest.fixture(scope="module")
def pipeline(demo_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("automation")
    target = root / "target"
    shutil.copytree(demo_target, target)
    data = root / "data"
    data.mkdir()
    shutil.copy(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json", data / "B1_glaive.json")
    shutil.copy(REPO_ROOT / "catalogs" / "demo_data" / "B2_opencodeinstruct.jsonl", data / "B2_code.jsonl")
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    b1, b2 = base["partitions"]["B1_glaive"], base["partitions"]["B2_opencodeinstruct"]
    b1["prompt_policy"] = "last_user"  # one row per conversation: the counts below are per prompt
    for spec, src in ((b1, {"path": "data/B1_glaive.json", "format": "glaive"}),
                      (b2, {"path": "data/B2_code.jsonl", "format": "opencodeinstruct"})):
        spec.update(sources=[src], limit=4, thresholds={**spec.get("thresholds", {}), **LOOSE})
        spec["sampling"] = {"max_new_tokens": 32, "temperature": 0.0}
    stub = StubServer(vocab_size=json.loads((target / "config.json").read_text())["vocab_size"])
    with serve_stub_in_thread(stub) as running:
        catalog_dict = {"target": {"model": str(target)}, "server": {"url": running.url, "concurrency": 4},
                        "partitions": {"B1_glaive": b1, "B2_code": b2}, "training": base["training"]}
        catalog = root / "auto.yaml"
        with dg.DagsterInstance.ephemeral() as instance:
            p = Pipeline(root, catalog, catalog_dict, target, root / "store" / "auto", None, instance, {})
            _write_catalog(p)
            p.defs = build_definitions(catalog, storage_root=root / "store")
            p.resources = {"settings": PipelineSettings(catalog_path=str(catalog), storage_root=str(root / "store")),
                           "target": TargetModel(model=str(target))}
            for key in KEYS:
                result = p.defs.resolve_job_def(PARTITION_JOB).execute_in_process(partition_key=key,
                                                                                 instance=instance)
                assert result.success
            # The runs observed their own inputs; the sensor's first tick adds only the one no run read yet.
            assert observe(p) == {("training_settings", None)}
            first = dg.evaluate_automation_conditions(defs=p.defs, instance=instance)
            assert first.total_requested == 0  # turning automation on re-runs nothing
            p.cursor = first.cursor
            yield p


def test_a_full_run_leaves_nothing_unsynced_and_nothing_to_do(pipeline):
    p = pipeline
    assert unsynced(p.instance, p.defs.resolve_asset_graph()) == {}
    assert observe(p) == set()
    runs = _partition_runs(p)
    assert automate(p) == []
    assert _partition_runs(p) == runs
    # Re-running a partition on unchanged inputs gives the same data versions: still nothing downstream to do.
    assert p.defs.resolve_job_def(PARTITION_JOB).execute_in_process(partition_key="B2_code",
                                                                    instance=p.instance).success
    assert unsynced(p.instance, p.defs.resolve_asset_graph()) == {}
    assert automate(p) == []
    # Nor does materializing one asset alone in each partition (as the UI's asset page does), without observing
    # its inputs in the same run: the partitions' data versions are their files' content.
    job = p.defs.resolve_implicit_global_asset_job_def()
    for key in KEYS:
        assert job.execute_in_process(instance=p.instance, partition_key=key,
                                      asset_selection=[dg.AssetKey("raw_prompts")]).success
    assert unsynced(p.instance, p.defs.resolve_asset_graph()) == {}
    assert automate(p) == []


def test_a_sampling_edit_marks_and_reruns_only_that_partitions_generations(pipeline):
    p = pipeline
    b2_shards = {q: q.read_bytes() for q in shard_paths(p.store / "generations" / "B2_code")}
    p.catalog_dict["partitions"]["B1_glaive"]["sampling"]["max_new_tokens"] = 24
    _write_catalog(p)
    assert observe(p) == {("sampling_settings", "B1_glaive")}
    stale = unsynced(p.instance, p.defs.resolve_asset_graph())
    assert stale == {("generations", "B1_glaive"): ["has a new dependency data version: sampling_settings[B1_glaive]"]}

    ticks = automate(p)
    assert ticks[0] == {("generations", "B1_glaive"), ("qc_shards", "B1_glaive")}
    assert ticks[1] == AFTER_QC
    assert len(ticks) == 2
    assert unsynced(p.instance, p.defs.resolve_asset_graph()) == {}
    # Generated again under the new cap, not resumed from the rows of the old one; B2 untouched.
    rows = read_shards(p.store / "generations" / "B1_glaive").to_pylist()
    assert len(rows) == 4 and all(json.loads(r["sampling_params"])["max_new_tokens"] == 24 for r in rows)
    recorded = json.loads((p.store / "generations" / "B1_glaive" / GENERATION_INPUTS_FILE).read_text())
    assert recorded["inputs"]["sampling_settings"] != json.loads(
        (p.store / "generations" / "B2_code" / GENERATION_INPUTS_FILE).read_text())["inputs"]["sampling_settings"]
    assert {q: q.read_bytes() for q in shard_paths(p.store / "generations" / "B2_code")} == b2_shards


def _chat_template_file(target: Path) -> Path:
    jinja = target / "chat_template.jinja"
    return jinja if jinja.is_file() else target / "tokenizer_config.json"


def _edit_chat_template(target: Path) -> None:
    """Put a fixed system line in front of every rendered prompt (a real change of the prompt ids)."""
    path = _chat_template_file(target)
    if path.suffix == ".jinja":
        path.write_text("{{- 'Answer briefly.\\n' -}}" + path.read_text())
    else:
        cfg = json.loads(path.read_text())
        cfg["chat_template"] = "{{- 'Answer briefly.\\n' -}}" + cfg["chat_template"]
        path.write_text(json.dumps(cfg, indent=2))


def test_a_chat_template_edit_marks_tokenization_and_qc_of_every_partition(pipeline):
    p = pipeline
    before = {k: pq.read_table(p.store / "tokenized_prompts" / k / "prompts.parquet").to_pylist() for k in KEYS}
    raw_runs = {k: p.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("raw_prompts"), asset_partitions=[k]), limit=100).records
        for k in KEYS}
    _edit_chat_template(p.target)
    assert observe(p) == {("target_tokenizer", None)}
    stale = unsynced(p.instance, p.defs.resolve_asset_graph())
    assert set(stale) == {(a, k) for a in ("tokenized_prompts", "qc_shards") for k in KEYS}
    assert all(causes == ["has a new dependency data version: target_tokenizer"] for causes in stale.values())

    ticks = automate(p)
    assert ticks[0] == {(a, k) for a in ("tokenized_prompts", "generations", "qc_shards") for k in KEYS}
    assert ticks[1] == AFTER_QC and len(ticks) == 2
    assert unsynced(p.instance, p.defs.resolve_asset_graph()) == {}
    for k in KEYS:
        after = pq.read_table(p.store / "tokenized_prompts" / k / "prompts.parquet").to_pylist()
        assert [r["sample_id"] for r in after] == [r["sample_id"] for r in before[k]]
        assert all(len(a["prompt_ids"]) > len(b["prompt_ids"]) for a, b in zip(after, before[k]))
        recorded = json.loads((p.store / "generations" / k / GENERATION_INPUTS_FILE).read_text())
        assert recorded["inputs"]["target_tokenizer"] != recorded["inputs"]["target_model"]
        # raw_prompts was not touched: the source records did not change.
        assert len(p.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("raw_prompts"), asset_partitions=[k]),
            limit=100).records) == len(raw_runs[k])


def test_an_edited_source_file_reruns_its_partition_and_resumes_its_generations(pipeline):
    p = pipeline
    src = p.root / "data" / "B2_code.jsonl"
    gen_dir = p.store / "generations" / "B2_code"
    old_shards = {q: q.read_bytes() for q in shard_paths(gen_dir)}
    p.catalog_dict["partitions"]["B2_code"]["limit"] = 5  # one more record from the edited file
    _write_catalog(p)
    lines = src.read_text().splitlines()
    record = json.loads(lines[0])
    record["input"] += " Explain the time complexity as well."
    src.write_text("\n".join([json.dumps(record), *lines]) + "\n")
    assert observe(p) == {("source_files", "B2_code")}
    assert set(unsynced(p.instance, p.defs.resolve_asset_graph())) == {("raw_prompts", "B2_code")}

    ticks = automate(p)
    assert ticks[0] == {(a, "B2_code") for a in ("raw_prompts", "tokenized_prompts", "generations", "qc_shards")}
    assert ticks[1] == AFTER_QC and len(ticks) == 2
    assert unsynced(p.instance, p.defs.resolve_asset_graph()) == {}
    # Resumed: the earlier shards are kept byte for byte, the new sample ids are in new shards.
    new_shards = {q: q.read_bytes() for q in shard_paths(gen_dir)}
    assert all(new_shards[q] == b for q, b in old_shards.items()) and len(new_shards) > len(old_shards)
    assert len(read_shards(gen_dir).to_pylist()) >= 5
