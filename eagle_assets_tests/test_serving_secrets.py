"""The API key of a launched server (issue 48): handed to SGLang without its argv, never in a log, an error or a
file of the run, no request to a port another process took, and no server left behind by a killed launcher.

SGLang itself is replaced by ``servers.standin_sglang`` (an interpreter that answers ``-m sglang.launch_server`` and,
like SGLang 0.5.23, prints its ``server_args`` with the key): what is tested is what the pipeline does around the
server, which is the same whichever server it starts. The real SGLang's ``--config`` reading is held to SGLang's
own parser in :func:`test_sglang_reads_the_key_from_the_fifo_with_its_own_config_parser`.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from eagle_assets.serving.launch import free_port, launch_server, listener_pids
from eagle_assets.serving.supervisor import StreamRedactor
from eagle_assets_tests.servers.standin_sglang import pids_of_group, write_standin

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY_ENV = "EAGLE_SECRETS_TEST_KEY"


@pytest.fixture
def key(monkeypatch):
    value = f"sk-planted-{uuid.uuid4().hex}"
    monkeypatch.setenv(KEY_ENV, value)
    return value


def _cmdlines(pgid: int) -> list[str]:
    out = []
    for pid in pids_of_group(pgid):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return out


def _wait_gone(pgid: int, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while pids_of_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids_of_group(pgid)


def test_stream_redactor_replaces_a_key_split_anywhere_and_holds_back_nothing_else():
    key = "sk-0123456789abcdef"
    text = f"server_args={{'api_key': '{key}', 'port': 30000}}\nready {key}\n".encode()
    for cut in range(len(text) + 1):
        for second in (cut, min(len(text), cut + 3)):
            r = StreamRedactor([key])
            out = r.feed(text[:cut]) + r.feed(text[cut:second]) + r.feed(text[second:]) + r.close()
            assert out == text.replace(key.encode(), b"***"), (cut, second)
    r = StreamRedactor([key])
    assert r.feed(b"EAGLE_ASSETS_SERVER_READY http://127.0.0.1:5\n") == b"EAGLE_ASSETS_SERVER_READY http://127.0.0.1:5\n"
    assert r.feed(b"tail sk-01") == b"tail " and r.close() == b"sk-01"  # a key prefix waits for the next bytes


def test_launched_sglang_gets_the_key_through_a_fifo_never_argv_env_or_log(tmp_path, key, monkeypatch):
    monkeypatch.setenv("EAGLE_STANDIN_RECORD", str(tmp_path / "record.json"))
    python = write_standin(tmp_path / "python", "serve")
    server = launch_server(str(tmp_path), launch="sglang", python=str(python), api_key_env=KEY_ENV,
                           log_dir=tmp_path / "logs", device="cuda", startup_timeout_s=60)
    try:
        group = server.process.pid
        lines = _cmdlines(group)
        assert len(lines) >= 2 and any("sglang.launch_server" in c for c in lines)
        assert not any(key in c for c in lines)  # neither the supervisor's argv nor SGLang's
        record = json.loads((tmp_path / "record.json").read_text())
        assert record["key_sha256"] == hashlib.sha256(key.encode()).hexdigest()  # the key did arrive
        assert KEY_ENV not in record["env"]  # and its variable was not passed on
        fifo = Path(record["argv"][record["argv"].index("--config") + 1])
        assert fifo.name == "api-key.yaml" and not fifo.parent.exists()  # read once, then removed with its folder
        assert listener_pids(int(server.url.rsplit(":", 1)[1])) == {record["pid"]}
        log = server.log_path.read_text()
        assert "api_key='***'" in log and key not in log
        assert key not in " ".join(server.command) and "<FIFO: api-key from $" in " ".join(server.command)
    finally:
        server.stop()
    assert _wait_gone(group) == []


def test_a_failed_sglang_start_quotes_its_log_without_the_key(tmp_path, key, monkeypatch):
    monkeypatch.setenv("EAGLE_STANDIN_RECORD", str(tmp_path / "record.json"))
    python = write_standin(tmp_path / "python", "fail")
    with pytest.raises(RuntimeError, match="exited with code 1 before it was ready") as info:
        launch_server(str(tmp_path), launch="sglang", python=str(python), api_key_env=KEY_ENV,
                      log_dir=tmp_path / "logs", device="cuda", startup_timeout_s=60)
    message = str(info.value)
    assert "could not load the model (api_key='***')" in message and key not in message
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["key_sha256"] == hashlib.sha256(key.encode()).hexdigest()
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == []


class _Squatter(http.server.BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_GET(self):
        type(self).seen.append(dict(self.headers))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_a_port_another_process_took_gets_no_request_with_the_key(tmp_path, key):
    squatter = http.server.HTTPServer(("127.0.0.1", 0), _Squatter)
    port = squatter.server_address[1]
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        python = write_standin(tmp_path / "python", "serve")
        with pytest.raises(RuntimeError, match="not held by the launched server") as info:
            launch_server(str(tmp_path), launch="sglang", python=str(python), api_key_env=KEY_ENV, port=port,
                          log_dir=tmp_path / "logs", device="cuda", startup_timeout_s=60)
        assert str(os.getpid()) in str(info.value) and key not in str(info.value)
        assert _Squatter.seen and all("Authorization" not in h for h in _Squatter.seen)
    finally:
        squatter.shutdown()


def test_launched_sglang_dies_with_its_killed_launcher(tmp_path, key):
    python = write_standin(tmp_path / "python", "serve")
    code = (
        "import time\n"
        "from eagle_assets.serving.launch import launch_server\n"
        f"s = launch_server({str(tmp_path)!r}, launch='sglang', python={str(python)!r}, api_key_env={KEY_ENV!r},"
        f" log_dir={str(tmp_path / 'logs')!r}, device='cuda', startup_timeout_s=60)\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        group = int(launcher.stdout.readline())
        assert len(pids_of_group(group)) >= 2  # the supervisor and the server
        launcher.send_signal(signal.SIGKILL)  # no teardown, no atexit
        launcher.wait(10)
        assert _wait_gone(group) == []
        assert "launching process" in next((tmp_path / "logs").glob("*.log")).read_text()
    finally:
        launcher.kill()
        launcher.wait(10)


def test_listener_pids_names_the_holder_of_a_listening_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listener_pids(s.getsockname()[1]) == {os.getpid()}
    assert listener_pids(free_port()) == set()


def test_sglang_reads_the_key_from_the_fifo_with_its_own_config_parser(tmp_path, key, sglang_python):
    """SGLang 0.5.23's ``prepare_server_args`` (run in its own venv) reads the FIFO the supervisor writes: its
    ``api_key`` is the planted key, though the key is in no argv."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import hashlib, sys\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "a = prepare_server_args(sys.argv[1:])\n"
        "print('KEY_SHA256', hashlib.sha256(a.api_key.encode()).hexdigest(), flush=True)\n"
    )
    log = tmp_path / "probe.log"
    cmd = [sys.executable, "-m", "eagle_assets.serving.supervisor", "--parent-pid", str(os.getpid()), "--log",
           str(log), "--secret-env", KEY_ENV, "--key-config", "--", str(sglang_python), str(probe),
           "--model-path", str(tmp_path), "--port", "30000"]
    subprocess.run(cmd, check=True, timeout=300, start_new_session=True)
    text = log.read_text()
    assert f"KEY_SHA256 {hashlib.sha256(key.encode()).hexdigest()}" in text, text[-2000:]
    assert key not in text and yaml.safe_dump({"api-key": key}) not in text


def test_a_run_that_launches_sglang_and_fails_to_start_leaks_the_key_nowhere(tmp_path, key):
    """``eagle-assets run`` on a catalog with ``server: {launch: sglang, api_key_env}`` whose SGLang fails at start-up
    (after printing its server_args, key included): the key arrived, and it is in no process argv, no output of the
    command, no file under the run's folders (storage, the Dagster instance's sqlite databases and compute logs, the
    server log, temp files) and no event of the run."""
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    data = tmp_path / "data"
    data.mkdir()
    (data / "B1.json").write_bytes((REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json").read_bytes())
    catalog = tmp_path / "catalogs" / "keyed.yaml"
    catalog.parent.mkdir()
    (tmp_path / "sglang-env").mkdir()
    python = write_standin(tmp_path / "sglang-env" / "python", "fail")
    catalog.write_text(yaml.safe_dump({
        "target": {"model": "demo"},
        "server": {"url": None, "launch": "sglang", "device": "cuda", "python": str(python),
                   "api_key_env": KEY_ENV},
        "partitions": {"B1": {"sources": [{"path": str(data / "B1.json"), "format": "glaive"}],
                              "sampling": {"max_new_tokens": 8}, "limit": 3}},
    }))
    home, tmp = tmp_path / "dagster_home", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE_ASSETS_HOME": str(tmp_path / "store"), "TMPDIR": str(tmp),
           "EAGLE_STANDIN_RECORD": str(tmp_path / "record.json")}
    done = subprocess.run([sys.executable, "-m", "eagle_assets.cli", "run", "--catalog", str(catalog),
                           "--skip-training"], env=env, cwd=tmp_path, capture_output=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output.decode()[-3000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["key_sha256"] == hashlib.sha256(key.encode()).hexdigest()  # SGLang got the key ...
    assert key not in " ".join(record["argv"])  # ... not on its command line
    assert b"api_key='***'" in output and key.encode() not in output  # the failure quotes the redacted log
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == [], f"the API key leaked into {leaked}"
    assert list(home.rglob("*.db")), "the run left no Dagster database to search"
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        runs = instance.get_runs()
        assert runs and any(r.status == dg.DagsterRunStatus.FAILURE for r in runs)
        for run in runs:
            assert key not in dg.serialize_value(instance.all_logs(run.run_id)) + json.dumps(run.run_config)
