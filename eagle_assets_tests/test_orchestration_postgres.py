"""The Postgres dagster.yaml documented in docs/scaling.md, loaded verbatim, against a real PostgreSQL server that
this test starts (Debian's postgresql package); skipped, with the reason, where no server can start here."""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle_assets.definitions import build_definitions

REPO_ROOT = Path(__file__).resolve().parents[1]
PG_BLOCK = re.compile(r"<!-- postgres-dagster-yaml:.*?-->\s*```yaml\n(.*?)```", re.S)


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL on 127.0.0.1 with password auth; yields connection settings."""
    pytest.importorskip("dagster_postgres", reason="dagster-postgres is not installed (pip install dagster-postgres)")
    pytest.importorskip("psycopg2", reason="psycopg2 is not installed (pip install psycopg2-binary)")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server binaries not found: apt-get install postgresql")
    run_as = {}
    if os.geteuid() == 0:  # postgres refuses to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        run_as = {"user": user.pw_uid, "group": user.pw_gid}
    base = Path(tempfile.mkdtemp(prefix="eagle-pg-"))
    if run_as:
        os.chown(base, run_as["user"], run_as["group"])
    password = "pg-test-" + os.urandom(6).hex()
    (base / "pw").write_text(password)
    if run_as:
        os.chown(base / "pw", run_as["user"], run_as["group"])
    port = _free_port()
    data, log = base / "data", base / "server.log"
    try:
        init = subprocess.run([initdb, "-D", str(data), "-U", "dagster", "--auth=scram-sha-256",
                               f"--pwfile={base / 'pw'}", "-E", "UTF8"], capture_output=True, text=True,
                              timeout=120, **run_as)
        if init.returncode != 0:
            pytest.skip(f"initdb failed, PostgreSQL cannot start here: {init.stderr.strip()[-500:]}")
        start = subprocess.run(
            [pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", "60", "start",
             "-o", f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"],
            capture_output=True, text=True, timeout=90, **run_as)
        if start.returncode != 0:
            server_log = log.read_text()[-800:] if log.exists() else ""
            pytest.skip(f"pg_ctl start failed, PostgreSQL cannot start here: {start.stderr.strip()} {server_log}")
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=port, user="dagster", password=password, dbname="postgres")
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE dagster")
        conn.close()
        yield {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(port), "DAGSTER_PG_USER": "dagster",
               "DAGSTER_PG_PASSWORD": password, "DAGSTER_PG_DB": "dagster"}
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True,
                           timeout=60, **run_as)
        shutil.rmtree(base, ignore_errors=True)


def test_documented_postgres_config_stores_runs_events_and_pools(postgres, tmp_path, monkeypatch):
    import psycopg2

    doc = (REPO_ROOT / "docs" / "scaling.md").read_text()
    block = PG_BLOCK.search(doc)
    assert block, "docs/scaling.md lost its marked Postgres dagster.yaml block"
    config = yaml.safe_load(block.group(1))
    # Every connection setting, the password above all, comes from the environment, never from the file.
    assert all(isinstance(v, dict) and set(v) == {"env"}
               for k, v in config["storage"]["postgres"]["postgres_db"].items() if k != "scheme")
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(block.group(1))
    for k, v in postgres.items():
        monkeypatch.setenv(k, v)

    catalog = tmp_path / "pg.yaml"
    catalog.write_text(yaml.safe_dump({
        "target": {"model": "demo"},
        "partitions": {"B1_glaive": {
            "sources": [{"path": str(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json"), "format": "glaive"}],
            "sampling": {"max_new_tokens": 64}, "limit": 5}},
    }))
    defs = build_definitions(catalog, storage_root=tmp_path / "store")
    raw = [a for a in defs.assets if a.keys == {dg.AssetKey("raw_prompts")}]

    instance = dg.DagsterInstance.from_ref(dg._core.instance.ref.InstanceRef.from_dir(str(home)))
    try:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        result = dg.materialize(raw, partition_key="B1_glaive", instance=instance, resources=defs.resources)
        assert result.success
        mats = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("raw_prompts"), asset_partitions=["B1_glaive"]), limit=1)
        assert mats.records[0].asset_materialization.metadata["dagster/row_count"].value == 5

        # The pool default of the file applies on Postgres: one slot for "sglang", claimable once.
        storage = instance.event_log_storage
        assert storage.supports_global_concurrency_limits
        assert storage.initialize_concurrency_limit_to_default("sglang")
        assert storage.get_concurrency_info("sglang").slot_count == 1
        first = storage.claim_concurrency_slot("sglang", "run-a", "generations")
        second = storage.claim_concurrency_slot("sglang", "run-b", "generations")
        assert first.is_claimed and not second.is_claimed
    finally:
        instance.dispose()

    with psycopg2.connect(host="127.0.0.1", port=int(postgres["DAGSTER_PG_PORT"]), user="dagster",
                          password=postgres["DAGSTER_PG_PASSWORD"], dbname="dagster") as conn:
        cur = conn.cursor()
        cur.execute("SELECT count(*) FROM runs WHERE run_id = %s", (result.run_id,))
        assert cur.fetchone()[0] == 1
        cur.execute("SELECT count(*) FROM event_logs WHERE run_id = %s AND dagster_event_type = "
                    "'ASSET_MATERIALIZATION'", (result.run_id,))
        assert cur.fetchone()[0] == 1
        cur.execute("SELECT count(*) FROM event_logs WHERE event LIKE %s", (f"%{postgres['DAGSTER_PG_PASSWORD']}%",))
        assert cur.fetchone()[0] == 0
