"""Launching server processes: ``launched_server`` and the Dagster ``SGLangServerResource`` (lazy start, teardown)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle_assets.assets.server_resource import SGLangServerResource, shared_launcher
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.launch import launch_server, launched_server
from eagle_assets.serving.protocol import GenerateReply, SamplingParams
from eagle_assets_tests.servers.tiny_model import write_tiny_causal_lm

pytestmark = pytest.mark.slow(seconds=70)  # its share of a parallel session: scheduled early (conftest)

SP = SamplingParams(max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model", seed=3))


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie waiting for a reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def test_launched_server_serves_and_stops(model_dir, tmp_path):
    with launched_server(model_dir, log_dir=tmp_path, extra_args=["--max-batch-size", "4"]) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.alive()
        reply = GenerateClient([server.url]).generate_all([("a", [7, 8, 9])], SP, vocab_size=126)[0]
        assert isinstance(reply, GenerateReply) and reply.completion_tokens == 4
        pid = server.process.pid
        assert "--max-batch-size" in server.command
    assert server.process.returncode == 0  # SIGTERM shuts it down cleanly
    assert _gone(pid)
    assert "EAGLE_ASSETS_SERVER_READY" in server.log_path.read_text()


def test_launch_failure_quotes_the_log(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        launch_server(str(tmp_path / "no-such-model"), log_dir=tmp_path)
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(RuntimeError, match=r"exited with code \d+ before it was ready") as info:
        launch_server(str(empty), log_dir=tmp_path / "logs", startup_timeout_s=120)
    assert "empty-model" in str(info.value) and "last lines" in str(info.value)
    assert list((tmp_path / "logs").glob("*.log"))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_launch_without_sglang_says_what_to_do(model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="launch: embedded") as info:
        launch_server(model_dir, launch="sglang", log_dir=tmp_path, startup_timeout_s=60)
    assert "No module named" in str(info.value)


def test_resource_connect_mode_and_config_errors():
    assert SGLangServerResource(urls=["127.0.0.1:30000/", "http://h:2/generate"]).base_urls("ignored") == [
        "http://127.0.0.1:30000", "http://h:2"]
    with pytest.raises(ValueError, match="no urls and no model path"):
        SGLangServerResource().base_urls()
    with pytest.raises(ValueError, match="launch must be one of"):
        SGLangServerResource(launch="vllm").base_urls("/some/model")


def test_resource_launches_lazily_once_and_stops_at_teardown(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_RESOURCE_KEY", "k-123")
    log_dir = tmp_path / "logs"

    @dg.asset
    def no_generation(sglang: dg.ResourceParam[SGLangServerResource]) -> int:
        return len(list(log_dir.glob("*.log"))) if log_dir.exists() else 0

    @dg.asset(deps=[no_generation])
    def generation(sglang: dg.ResourceParam[SGLangServerResource]) -> dict:
        urls = sglang.base_urls(model_dir)
        assert sglang.base_urls(model_dir) == urls  # one server per resource instance
        with pytest.raises(ValueError, match="one launched server serves one model"):
            sglang.base_urls(model_dir + "-other")
        unauthenticated = GenerateClient(urls, max_attempts=1).generate_all([("a", [7, 8])], SP)[0]
        reply = GenerateClient(urls, api_key_env=sglang.api_key_env).generate_all([("a", [7, 8])], SP)[0]
        return {"urls": urls, "pid": sglang.launched.process.pid, "reply": reply, "denied": unauthenticated.kind}

    resource = SGLangServerResource(api_key_env="EAGLE_RESOURCE_KEY", log_dir=str(log_dir), startup_timeout_s=120)
    result = dg.materialize([no_generation, generation], resources={"sglang": resource})
    assert result.success
    assert result.output_for_node("no_generation") == 0  # setup did not launch anything
    out = result.output_for_node("generation")
    assert isinstance(out["reply"], GenerateReply) and out["reply"].completion_tokens == 4
    assert out["denied"] == "unauthorized"  # the launched server requires the key from api_key_env
    assert len(list(log_dir.glob("*.log"))) == 1
    assert _gone(out["pid"])  # teardown_after_execution stopped it


def test_shared_launcher_serves_every_run_from_one_server_and_stops_at_block_end(model_dir, tmp_path):
    """``eagle-assets run``'s partition runs: one lazily launched server outlives each run's teardown."""

    @dg.asset
    def generation(sglang: dg.ResourceParam[SGLangServerResource]) -> dict:
        urls = sglang.base_urls(model_dir)
        reply = GenerateClient(urls).generate_all([("a", [7, 8])], SP)[0]
        return {"urls": urls, "pid": sglang.launched.process.pid, "tokens": reply.completion_tokens}

    log_dir = tmp_path / "logs"
    with shared_launcher(log_dir=str(log_dir), startup_timeout_s=120) as key:
        assert not log_dir.exists()  # nothing launched before a run asks
        outs = []
        for _ in range(2):
            result = dg.materialize([generation], resources={"sglang": SGLangServerResource(shared=key)})
            assert result.success
            outs.append(result.output_for_node("generation"))
            assert not _gone(outs[-1]["pid"])  # the run's teardown left the shared server running
        assert outs[0]["urls"] == outs[1]["urls"] and outs[0]["pid"] == outs[1]["pid"]
        assert outs[0]["tokens"] == outs[1]["tokens"] == 4
        assert len(list(log_dir.glob("*.log"))) == 1
    assert _gone(outs[0]["pid"])
    with pytest.raises(ValueError, match="names no shared launcher"):
        SGLangServerResource(shared=key).base_urls(model_dir)


def test_embedded_server_exits_when_its_launcher_is_killed(model_dir, tmp_path):
    code = (
        "import sys, time\n"
        "from eagle_assets.serving.launch import launch_server\n"
        f"s = launch_server({model_dir!r}, log_dir={str(tmp_path)!r})\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(launcher.stdout.readline())
        assert not _gone(server_pid)
        launcher.send_signal(signal.SIGKILL)  # no teardown, no atexit
        launcher.wait(10)
        deadline = time.monotonic() + 15
        while not _gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(server_pid)
    finally:
        launcher.kill()
        launcher.wait(10)


def _default_catalog() -> dict:
    """catalogs/default.yaml as a dict, its source paths made absolute and without the unseen-source evaluation."""
    import yaml

    repo = Path(__file__).resolve().parents[1]
    base = yaml.safe_load((repo / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    for spec in base["partitions"].values():
        for source in spec["sources"]:
            source["path"] = str(repo / "catalogs" / source["path"])
    base["training"]["unseen_eval"] = None
    return base


def test_cli_partition_runs_share_one_launcher_only_when_the_catalog_launches_in_process(tmp_path, monkeypatch):
    import yaml

    from eagle_assets.assets import server_resource as resource_module
    from eagle_assets.catalog import load_catalog
    from eagle_assets.cli import _partition_definitions
    from eagle_assets.definitions import build_definitions

    base = _default_catalog()
    launched = tmp_path / "launch.yaml"
    launched.write_text(yaml.safe_dump(base))
    base["server"] = {"url": "http://127.0.0.1:30000"}
    connected = tmp_path / "connect.yaml"
    connected.write_text(yaml.safe_dump(base))
    monkeypatch.delenv("EAGLE_ASSETS_EXECUTOR", raising=False)

    defs = build_definitions(connected, storage_root=tmp_path / "store")
    with _partition_definitions(defs, connected, load_catalog(connected)) as used:
        assert used is defs  # a configured server: nothing to share
    defs = build_definitions(launched, storage_root=tmp_path / "store")
    with _partition_definitions(defs, launched, load_catalog(launched)) as used:
        key = used.resources["sglang"].shared
        assert key in resource_module._shared and resource_module._shared[key].server is None  # lazy
    assert key not in resource_module._shared
    monkeypatch.setenv("EAGLE_ASSETS_EXECUTOR", "k8s")  # steps in other pods cannot reach this process's server
    with _partition_definitions(defs, launched, load_catalog(launched)) as used:
        assert used is defs


def test_cli_prelaunches_the_shared_server_while_the_first_partition_prepares(model_dir, tmp_path, monkeypatch):
    """On a first run the shared server starts launching at once (a background thread), before any generations step
    asks for it; the step then finds it ready. A run whose partitions all have generations launches on demand."""
    import yaml

    from eagle_assets.assets import server_resource as resource_module
    from eagle_assets.catalog import load_catalog
    from eagle_assets.cli import _first_run, _partition_definitions
    from eagle_assets.definitions import build_definitions
    from eagle_assets.storage.shards import Layout

    base = _default_catalog()
    base["target"]["model"] = model_dir
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(base))
    monkeypatch.delenv("EAGLE_ASSETS_EXECUTOR", raising=False)
    layout = Layout(tmp_path / "store", path.stem)
    keys = list(base["partitions"])
    assert _first_run(layout, keys)
    defs = build_definitions(path, storage_root=tmp_path / "store")
    with _partition_definitions(defs, path, load_catalog(path), prelaunch=True) as used:
        launcher = resource_module._shared[used.resources["sglang"].shared]
        deadline = time.monotonic() + 120
        while launcher.server is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert launcher.server is not None and launcher.server.model_path == model_dir  # no step asked for it
        pid = launcher.server.process.pid
        assert used.resources["sglang"].base_urls(model_dir) == [launcher.server.url]
        assert launcher.server.process.pid == pid  # the step got the prelaunched server, not a second one
    assert _gone(pid)
    for key in keys:
        (layout.stage_dir("generations", key) / "shard-00000.parquet").write_bytes(b"")
    assert not _first_run(layout, keys)
    # A model directory that does not exist is the generations step's error to report, not the prelaunch's.
    base["target"]["model"] = str(tmp_path / "no-such-model")
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump(base))
    defs = build_definitions(missing, storage_root=tmp_path / "store2")
    with _partition_definitions(defs, missing, load_catalog(missing), prelaunch=True) as used:
        assert resource_module._shared[used.resources["sglang"].shared].server is None
