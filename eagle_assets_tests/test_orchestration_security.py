"""Locked down by default: no unpickling of data that could come from outside, partition keys and catalog paths
validated, sources resolved and reported, secrets referenced by environment variable name only."""

from __future__ import annotations

import ast
from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle_assets.assets.server_resource import SGLangServerResource
from eagle_assets.catalog import CatalogError, load_catalog
from eagle_assets.definitions import PARTITION_JOB, build_definitions
from eagle_assets.storage.shards import Layout

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "eagle_assets"
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def _kw(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def unsafe_loads(source: str, filename: str) -> list[str]:
    """Places in ``source`` that deserialize with code execution: pickle-family imports, ``torch.load`` without
    ``weights_only=True``, ``numpy.load(allow_pickle=True)``, non-safe YAML loaders, ``trust_remote_code=True``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.endswith("torch.load"):
                if not _is_true(_kw(node, "weights_only")):
                    found.append(f"{where} {name} without weights_only=True")
            elif name in ("np.load", "numpy.load") and _is_true(_kw(node, "allow_pickle")):
                found.append(f"{where} {name}(allow_pickle=True)")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all"):
                found.append(f"{where} {name} (use yaml.safe_load)")
            elif name.endswith("read_pickle"):
                found.append(f"{where} {name}")
            if _is_true(_kw(node, "trust_remote_code")):
                found.append(f"{where} {name}(trust_remote_code=True)")
    return found


def test_the_scanner_catches_each_unsafe_pattern():
    bad = (
        "import pickle\nfrom joblib import load\nimport torch, numpy as np, yaml\n"
        "torch.load(p)\ntorch.load(p, weights_only=False)\nnp.load(p, allow_pickle=True)\nyaml.load(s)\n"
        "AutoModel.from_pretrained(p, trust_remote_code=True)\n"
    )
    assert len(unsafe_loads(bad, "bad.py")) == 7
    good = "import torch, numpy as np, yaml\ntorch.load(p, weights_only=True)\nnp.load(p)\nyaml.safe_load(s)\n"
    assert unsafe_loads(good, "good.py") == []


def test_package_never_unpickles_outside_data():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    problems = [p for f in files for p in unsafe_loads(f.read_text(), str(f.relative_to(REPO_ROOT)))]
    assert problems == [], "load checkpoints with safetensors or torch.load(weights_only=True):\n" + "\n".join(problems)


@pytest.mark.parametrize("key", ["../escape", "a/b", "a\\b", "..", ".hidden", "with space", ""])
def test_catalog_refuses_partition_keys_that_are_not_one_safe_path_component(tmp_path, key):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"partitions": {key: {
        "sources": [{"path": "x.json", "format": "glaive"}], "sampling": {"max_new_tokens": 8}}}}))
    with pytest.raises(CatalogError, match="partition key"):
        load_catalog(path)
    with pytest.raises(ValueError, match="no path separators"):
        Layout(tmp_path, "cat").stage_dir("qc_shards", key)


def test_catalog_names_are_checked_as_path_components(tmp_path):
    with pytest.raises(ValueError, match="catalog name"):
        Layout(tmp_path, "../outside")


def _catalog(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "B1.json").write_bytes((REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json").read_bytes())
    (tmp_path / "catalogs").mkdir()
    path = tmp_path / "catalogs" / "sec.yaml"
    path.write_text(yaml.safe_dump({
        "target": {"model": "demo"},
        "server": {"api_key_env": "EAGLE_SEC_TEST_KEY"},
        "partitions": {"B1": {"sources": [{"path": "../data/./B1.json", "format": "glaive"}],
                              "sampling": {"max_new_tokens": 8}, "limit": 3}},
    }))
    return path


def test_unknown_partition_key_is_refused_before_anything_runs(tmp_path):
    defs = build_definitions(_catalog(tmp_path), storage_root=tmp_path / "store")
    with dg.instance_for_test() as instance:
        with pytest.raises(dg.DagsterUnknownPartitionError, match=r"\.\./B1"):
            defs.resolve_job_def(PARTITION_JOB).execute_in_process(partition_key="../B1", instance=instance)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.parquet"))


def test_sources_are_resolved_and_reported_in_metadata(tmp_path):
    catalog = _catalog(tmp_path)
    defs = build_definitions(catalog, storage_root=tmp_path / "store")
    raw = [a for a in defs.assets if a.keys == {dg.AssetKey("raw_prompts")}]
    with dg.instance_for_test() as instance:
        result = dg.materialize(raw, partition_key="B1", instance=instance, resources=defs.resources)
    sources = result.asset_materializations_for_node("raw_prompts")[0].metadata["sources"].value
    assert sources == [str((tmp_path / "data" / "B1.json").resolve())]
    assert ".." not in sources[0] and "/./" not in sources[0]


def test_api_key_is_referenced_by_variable_name_only(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_SEC_TEST_KEY", "sk-should-not-appear")
    defs = build_definitions(_catalog(tmp_path), storage_root=tmp_path / "store")
    sglang = defs.resources["sglang"]
    assert isinstance(sglang, SGLangServerResource) and sglang.api_key_env == "EAGLE_SEC_TEST_KEY"
    # What the UI's resource view shows (description) and the settings have the name, not the value.
    shown = repr(sglang.settings()) + repr(sglang) + (sglang.description or "")
    assert "EAGLE_SEC_TEST_KEY" in shown and "sk-should-not-appear" not in shown
    assert sglang.host == "127.0.0.1"  # a launched server binds loopback unless told otherwise


# Each field a run config might use to send the key elsewhere, launch another executable or write elsewhere.
HOSTILE_RUN_CONFIG = [
    ("sglang", {"urls": ["http://attacker.example:80"]}),
    ("sglang", {"api_key_env": "HOME"}),
    ("sglang", {"python": "/bin/sh"}),
    ("sglang", {"extra_args": ["--host", "0.0.0.0"]}),
    ("sglang", {"host": "0.0.0.0"}),
    ("settings", {"storage_root": "/tmp/elsewhere"}),
    ("settings", {"catalog_path": "/etc/passwd"}),
    ("target", {"model": "/tmp/other-model"}),
]


@pytest.mark.parametrize("resource,config", HOSTILE_RUN_CONFIG)
def test_run_config_cannot_change_what_the_catalog_sets(tmp_path, resource, config):
    defs = build_definitions(_catalog(tmp_path), storage_root=tmp_path / "store")
    job = defs.resolve_job_def(PARTITION_JOB)
    field = next(iter(config))
    with dg.instance_for_test() as instance:
        with pytest.raises(dg.DagsterInvalidConfigError, match=rf'unexpected config entry "{field}".*{resource}'):
            job.execute_in_process(partition_key="B1", instance=instance,
                                   run_config={"resources": {resource: {"config": config}}})
        assert instance.get_runs() == []  # refused before a run exists
    assert not (tmp_path / "store").exists()
    # the UI's resource view says where the value comes from
    assert "Set in the catalog only" in defs.resources[resource].description


def test_each_run_gets_its_own_server_resource_and_it_is_stopped_after_the_run(tmp_path):
    sglang = build_definitions(_catalog(tmp_path), storage_root=tmp_path / "store").resources["sglang"]
    seen = []

    @dg.asset
    def probe(sglang: dg.ResourceParam[SGLangServerResource]) -> None:
        seen.append(sglang)

    for _ in range(2):
        assert dg.materialize([probe], resources={"sglang": sglang}).success
    assert len(seen) == 2 and seen[0] is not seen[1] and sglang not in seen
    assert all(run.settings() == sglang.settings() for run in seen)


def test_a_key_sent_over_plain_http_to_another_host_is_warned_about(tmp_path):
    path = _catalog(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["server"]["url"] = ["http://10.1.2.3:30000", "http://127.0.0.1:30000", "https://sglang.example:443"]
    path.write_text(yaml.safe_dump(spec))
    warned = [w for w in load_catalog(path).warnings() if "clear text" in w]
    assert len(warned) == 1 and "http://10.1.2.3:30000" in warned[0] and "$EAGLE_SEC_TEST_KEY" in warned[0]
    spec["server"]["api_key_env"] = None  # no key, nothing to protect
    path.write_text(yaml.safe_dump(spec))
    assert not [w for w in load_catalog(path).warnings() if "clear text" in w]
