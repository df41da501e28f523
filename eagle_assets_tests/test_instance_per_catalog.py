"""One Dagster instance per catalog: a second catalog is refused by an instance that holds another's runs, the CLI
gives each catalog its own ``DAGSTER_HOME``, and a catalog warns about settings that defeat themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle_assets.catalog import CatalogError, load_catalog

REPO_ROOT = Path(__file__).resolve().parents[1]


def _catalog(path: Path, **b1) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    part = base["partitions"]["B1_glaive"]
    part["sources"] = [{"path": str(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json"), "format": "glaive"}]
    part["sampling"].update(b1)
    base["partitions"] = {"B1_glaive": part}
    path.write_text(yaml.safe_dump(base))
    return path


def test_an_instance_refuses_a_second_catalog_and_names_the_home_to_use(tmp_path, monkeypatch):
    from eagle_assets.definitions import INSTANCE_CATALOG_FILE, claim_instance

    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    a, b = _catalog(tmp_path / "a.yaml"), _catalog(tmp_path / "b.yaml")
    claim_instance(a)
    claim_instance(a)  # the same catalog again: fine
    assert (home / INSTANCE_CATALOG_FILE).read_text().strip() == str(a.resolve())
    with pytest.raises(CatalogError, match="holds the runs of another catalog") as refused:
        claim_instance(b)
    assert str(a.resolve()) in str(refused.value) and "dagster_home/b/" in str(refused.value)
    (tmp_path / "other").mkdir()
    with pytest.raises(CatalogError, match="give this catalog another file name") as same_name:
        claim_instance(_catalog(tmp_path / "other" / "a.yaml"))  # another catalog with the same file name
    assert "share the storage folder <storage root>/a/" in str(same_name.value)
    monkeypatch.delenv("DAGSTER_HOME")
    claim_instance(b)  # no instance configured: nothing to claim


def test_the_cli_gives_each_catalog_its_own_dagster_home(tmp_path, monkeypatch):
    import eagle_assets.cli as cli

    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    (tmp_path / "catalogs").mkdir()
    default = _catalog(tmp_path / "catalogs" / "default.yaml")
    monkeypatch.setenv("EAGLE_ASSETS_CATALOG", str(default))
    for catalog, home in ((default, tmp_path), (_catalog(tmp_path / "mine.yaml"), tmp_path / "dagster_home" / "mine")):
        monkeypatch.delenv("DAGSTER_HOME", raising=False)
        assert cli._ensure_dagster_home(catalog.resolve()) == home
        assert (home / "dagster.yaml").read_text() == (tmp_path / "dagster.yaml").read_text()


def test_a_cap_below_short_tokens_is_a_catalog_warning(tmp_path):
    assert load_catalog(REPO_ROOT / "catalogs" / "default.yaml").warnings() == []
    warned = load_catalog(_catalog(tmp_path / "c.yaml", max_new_tokens=16)).warnings()
    assert len(warned) == 1 and "partitions.B1_glaive: sampling.max_new_tokens 16 is below " in warned[0]


def test_a_missing_source_file_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    from eagle_assets.cli import main

    path = _catalog(tmp_path / "gone.yaml")
    text = yaml.safe_load(path.read_text())
    text["partitions"]["B1_glaive"]["sources"] = [{"path": "no_such_file.jsonl", "format": "auto"}]
    path.write_text(yaml.safe_dump(text))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EAGLE_ASSETS_HOME", str(tmp_path / "store"))
    monkeypatch.setenv("EAGLE_ASSETS_CATALOG", str(path))  # the CLI sets it; monkeypatch puts the old value back
    assert main(["run", "--catalog", str(path), "--skip-training"]) == 2
    out = capsys.readouterr().out
    assert "partitions.B1_glaive.sources[0].path: file " in out and "no_such_file.jsonl does not exist" in out
    assert not (tmp_path / "store" / "gone" / "raw_prompts").exists()  # no run started
