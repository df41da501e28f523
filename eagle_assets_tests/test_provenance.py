"""``provenance.json`` written by a real Dagster run on a real instance.

The graph here is small and built for the test (an observable source asset, a partitioned asset, and a checkpoint
asset that calls ``write_provenance`` as ``drafter_checkpoint`` does), so the test needs no model; the
``drafter_checkpoint`` call itself runs in ``test_orchestration_live.py``, which checks the file it wrote.
"""


import json
import subprocess
from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle_assets.assets.provenance import FORMAT, PROVENANCE_FILE, build_provenance, write_provenance
from eagle_assets.assets.resources import PipelineSettings
from eagle_assets.lineage.identity import source_sha256

REPO_ROOT = Path(__file__).resolve().parents[1]
SECRET_ENV = "EAGLE_TEST_PROVENANCE_SECRET"
P = dg.StaticPartitionsDefinition(["a", "b"])


@dg.observable_source_asset(partitions_def=P)
def source_files(context):
    return dg.ObserveResult(data_version=dg.DataVersion(f"src-{context.partition_key}"))


@dg.asset(partitions_def=P, deps=[source_files], code_version="7")
def shards(context):
    return dg.MaterializeResult(data_version=dg.DataVersion(f"shards-{context.partition_key}"))


@dg.asset(deps=[shards], code_version="3")
def checkpoint(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings]):
    out = Path(settings.storage_root) / "checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    write_provenance(context, settings, out, asset_graph=TOY_GRAPH)


TOY_GRAPH = dg.Definitions(assets=[source_files, shards, checkpoint],
                           resources={"settings": PipelineSettings(catalog_path="-", storage_root="-")}
                           ).resolve_asset_graph()


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "sk-provenance-must-not-leak")
    catalog = tmp_path / "cat.yaml"
    catalog.write_text(yaml.safe_dump({
        "partitions": {"a": {"sources": [{"path": str(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json"),
                                          "format": "glaive"}], "sampling": {"max_new_tokens": 8}}},
        "training": {"epochs": 3},
    }))
    settings = PipelineSettings(catalog_path=str(catalog), storage_root=str(tmp_path / "store"))
    defs = dg.Definitions(assets=[source_files, shards, checkpoint], resources={"settings": settings})
    with dg.DagsterInstance.ephemeral() as instance:
        for pk in ("a", "b"):
            instance.report_runless_asset_event(dg.AssetObservation(
                "source_files", partition=pk, tags={"dagster/data_version": f"src-{pk}"}))
        for pk in ("a", "b"):
            assert dg.materialize([shards], partition_key=pk, instance=instance,
                                  selection=[shards]).success
        result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("checkpoint")], tags={"eagle_assets/trigger": "test",
                                                                                     "secret_tag": "x"})
        assert result.success
        doc = json.loads((tmp_path / "store" / "checkpoint" / PROVENANCE_FILE).read_text())
        yield doc, result, instance, catalog


def test_provenance_names_code_packages_catalog_inputs_and_run(run):
    doc, result, instance, catalog = run
    assert doc["format"] == FORMAT and doc["format_version"] == 1 and doc["asset"] == "checkpoint"

    code = doc["code"]
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert code["git_commit"] == head.stdout.strip() and isinstance(code["git_dirty"], bool)
    assert code["source_sha256"] == source_sha256() and len(code["source_sha256"]) == 64
    packages = doc["packages"]
    import dagster
    import torch
    import transformers

    assert packages["torch"] == torch.__version__.split("+")[0] or packages["torch"] == torch.__version__
    assert packages["transformers"] == transformers.__version__
    assert packages["dagster"] == dagster.__version__
    assert packages["eagle-assets"] == code["version"] is not None

    import hashlib

    assert doc["catalog"]["file_sha256"] == hashlib.sha256(catalog.read_bytes()).hexdigest()
    assert doc["catalog"]["path"] == str(catalog) and doc["catalog"]["training"]["epochs"] == 3

    # Every input partition, transitively, with the versions and runs the instance recorded.
    inputs = {(e["asset"], e["partition"]): e for e in doc["inputs"]}
    assert set(inputs) == {("shards", "a"), ("shards", "b"), ("source_files", "a"), ("source_files", "b")}
    assert inputs[("shards", "a")]["data_version"] == "shards-a" and inputs[("shards", "b")]["code_version"] == "7"
    assert inputs[("shards", "a")]["direct"] and not inputs[("source_files", "a")]["direct"]
    assert inputs[("source_files", "b")] | {"recorded_at": None} == {
        "asset": "source_files", "partition": "b", "direct": False, "data_version": "src-b", "code_version": None,
        "run_id": None, "recorded_at": None, "kind": "observation"}
    shards_run = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("shards"), asset_partitions=["a"]), limit=1).records[0].run_id
    assert inputs[("shards", "a")]["run_id"] == shards_run and inputs[("shards", "a")]["kind"] == "materialization"

    assert doc["run"]["run_id"] == result.run_id
    assert doc["run"]["tags"] == {"eagle_assets/trigger": "test"}  # other tags are left out
    assert doc["run"]["command"][0].endswith("python") or "python" in Path(doc["run"]["command"][0]).name

    text = json.dumps(doc)
    assert "sk-provenance-must-not-leak" not in text and SECRET_ENV not in text


def test_an_input_never_recorded_is_listed_as_such(tmp_path):
    settings = PipelineSettings(catalog_path=str(REPO_ROOT / "catalogs" / "default.yaml"),
                                storage_root=str(tmp_path / "store"))

    graph = {}

    @dg.asset(deps=[shards])
    def probe(context: dg.AssetExecutionContext):
        doc = build_provenance(context, settings, graph["graph"])
        entries = {(e["asset"], e["partition"]): e["kind"] for e in doc["inputs"]}
        assert entries == {("shards", "a"): "never recorded", ("shards", "b"): "never recorded",
                           ("source_files", "a"): "never recorded", ("source_files", "b"): "never recorded"}

    with dg.DagsterInstance.ephemeral() as instance:
        defs = dg.Definitions(assets=[source_files, shards, probe])
        graph["graph"] = defs.resolve_asset_graph()
        assert defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("probe")]).success


def test_without_a_repository_the_graph_is_our_definitions_whole(tmp_path):
    """``execute_in_process`` runs have no repository; the fallback graph (what ``build_definitions`` gives the
    checkpoint: its own Definitions' graph, not a rebuilt one) still reaches every ancestor of the checkpoint, down
    to the observed inputs, and the job's neighbourhood alone would not."""
    from eagle_assets.assets.provenance import full_asset_graph
    from eagle_assets.definitions import build_definitions

    defs = build_definitions(REPO_ROOT / "catalogs" / "default.yaml", tmp_path / "store", executor="in_process")
    seen = {}

    @dg.asset
    def probe(context: dg.AssetExecutionContext):
        seen["graph"] = full_asset_graph(context, defs.resolve_asset_graph)
        seen["neighbourhood"] = full_asset_graph(context)

    with dg.DagsterInstance.ephemeral() as instance:
        assert dg.materialize([probe], instance=instance).success
    assert dg.AssetKey("drafter_checkpoint") not in seen["neighbourhood"].get_all_asset_keys()
    graph = seen["graph"]
    todo, ancestors = [dg.AssetKey("drafter_checkpoint")], set()
    while todo:
        for parent in graph.get(todo.pop()).parent_keys:
            if parent not in ancestors:
                ancestors.add(parent)
                todo.append(parent)
    assert {k.to_user_string() for k in ancestors} == {
        "draft_vocab", "training_mix", "qc_shards", "generations", "tokenized_prompts", "raw_prompts",
        "source_files", "render_settings", "sampling_settings", "qc_settings", "target_tokenizer", "target_model",
        "training_settings"}
