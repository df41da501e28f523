"""Generation against several servers: a URL list spread by the client, and the real ``sglang-router``.

Both servers are our embedded server on the same tiny random Qwen3 (``serve_in_thread``, real HTTP on 127.0.0.1).
At temperature 0 the rows must not depend on which server answered, so a run over two servers (directly, or through
the router) must equal a run against one. The router test uses the PyPI ``sglang-router`` package (a Rust load
balancer; CPU-only wheel) and is skipped when it is not installed.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from eagle_assets.generations.run import run_generation
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.launch import free_port, log_tail
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets.storage.shards import read_shards

VOCAB = 126
SP = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[2])


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    from eagle_assets.serving.server import serve_in_thread
    from eagle_assets_tests.servers.tiny_model import write_tiny_causal_lm

    model_dir = str(write_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model", seed=11))
    with serve_in_thread(model_dir, max_batch_size=16) as a, serve_in_thread(model_dir, max_batch_size=16) as b:
        yield a, b


def _prompts(n: int = 24) -> list[tuple[str, list[int]]]:
    return [(f"m{i:02d}", [6 + (i * 29 + k * 13) % 120 for k in range(3 + i % 9)]) for i in range(n)]


def _finished(server) -> int:
    return server.server.engine.stats.requests_finished


def _rows(out) -> dict[str, list[int]]:
    table = read_shards(out, columns=["sample_id", "output_ids"])
    rows = table.to_pylist()
    assert len(rows) == len({r["sample_id"] for r in rows})
    return {r["sample_id"]: r["output_ids"] for r in rows}


@pytest.fixture(scope="module")
def single_server_rows(two_servers, tmp_path_factory):
    a, _ = two_servers
    out = tmp_path_factory.mktemp("single")
    stats = run_generation(_prompts(), out, GenerateClient([a.url], concurrency_per_server=8), SP, VOCAB)
    assert stats.succeeded == 24
    return _rows(out)


def test_client_spreads_one_partition_over_two_servers(two_servers, single_server_rows, tmp_path):
    a, b = two_servers
    before = (_finished(a), _finished(b))
    client = GenerateClient([a.url, b.url], concurrency_per_server=4)
    stats = run_generation(_prompts(), tmp_path, client, SP, VOCAB)
    served = (_finished(a) - before[0], _finished(b) - before[1])
    assert stats.succeeded == 24 and sum(served) == 24
    assert min(served) >= 6, f"both servers must take a share of the work, got {served}"
    assert _rows(tmp_path) == single_server_rows


def test_a_sampled_partition_draws_each_row_from_its_own_seed(two_servers, tmp_path):
    """T = 1 with a partition seed: every request carries ``row_seed(seed, row id)``, so the rows do not depend on
    the server, the concurrency or the order replies come back in; two rows of the same prompt draw apart (one
    seed for all would give them one reply); another seed draws other rows."""
    from dataclasses import replace

    from eagle_assets.generations.run import row_seed

    a, b = two_servers
    sampled = replace(SP, temperature=1.0, seed=7)
    prompts = _prompts() + [(f"again{i}", _prompts()[5][1]) for i in range(4)]  # m05's prompt under other ids
    one = run_generation(prompts, tmp_path / "one", GenerateClient([a.url], concurrency_per_server=1), sampled, VOCAB)
    two = run_generation(prompts, tmp_path / "two", GenerateClient([a.url, b.url], concurrency_per_server=8),
                         sampled, VOCAB)
    other = run_generation(prompts, tmp_path / "other", GenerateClient([b.url], concurrency_per_server=8),
                           replace(sampled, seed=8), VOCAB)
    assert one.succeeded == two.succeeded == other.succeeded == 28
    rows = _rows(tmp_path / "one")
    assert rows == _rows(tmp_path / "two") and rows != _rows(tmp_path / "other")
    assert len({tuple(rows[k]) for k in ("m05", "again0", "again1", "again2", "again3")}) >= 4
    assert row_seed(7, "m00") == row_seed(7, "m00") != row_seed(8, "m00") and 0 <= row_seed(7, "m00") < 2**31


@pytest.fixture(scope="module")
def router(two_servers, tmp_path_factory):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")
    a, b = two_servers
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", a.url, b.url, "--policy", "round_robin", "--log-level", "warn"],
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"sglang-router exited:\n{log_tail(log)}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"sglang-router not healthy after 60 s:\n{log_tail(log)}"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_real_sglang_router_in_front_of_two_servers(two_servers, router, single_server_rows, tmp_path):
    a, b = two_servers
    before = (_finished(a), _finished(b))
    client = GenerateClient([router], concurrency_per_server=8)
    stats = run_generation(_prompts(), tmp_path, client, SP, VOCAB)
    served = (_finished(a) - before[0], _finished(b) - before[1])
    # every reply passed parse_generate_reply, rid check included: the router kept each request's rid and body intact
    assert stats.succeeded == 24 and stats.failed == 0 and sum(served) == 24
    assert min(served) >= 6, f"the router must spread the work over both servers, got {served}"
    assert _rows(tmp_path) == single_server_rows
