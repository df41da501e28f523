"""SGLang 0.5.23's own server, on CPU, against the pipeline (``real_sglang``: the venv built once per machine, the
``sgl_kernel`` stand-in; the tests skip with the build's reason where the venv cannot be built).

- Every partition of the default catalog (cut to :data:`LIMITS` records; ``EAGLE_ASSETS_SGLANG_FULL=1``: whole),
  run by ``eagle-assets run`` (real Dagster runs) once against the embedded server and once against the real
  server (started as the ``sglang`` resource starts it: ``launch: sglang``, ``device: cpu``; the resource doing so
  inside a run is ``test_real_sglang_features.py``), generates the same rows: output_ids, finish_reason, matched
  stop id and completion_tokens, row for row, B1's multi-turn rollout (tool results spliced in, every turn prompt
  rendered from the model's own replies) included.
- The client's handling of SGLang's own error replies (an over-long prompt, a bad sampling param, a request after
  the server stopped) is checked against what the real server answers, beside the embedded server's answer.

``EAGLE_ASSETS_SGLANG_ALTER=1`` sends the SGLang run through a proxy that alters one output id of one reply before
the pipeline stores it; the equality test must then fail (the trial the issue asks for, run by hand).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets_tests.real_sglang import sglang_env

pytestmark = pytest.mark.slow(seconds=360)  # venv build, two server starts, two pipeline runs

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = ("B1_glaive", "B2_opencodeinstruct", "B4_mixturethoughts", "B5_openthoughts")
# Records per partition in the comparison runs: SGLang's CPU engine decodes the demo target at a few hundred tokens/s
# on two busy cores, and the full 48-record partitions (about 47k reply tokens) took 5 minutes of the suite's 10.
# EAGLE_ASSETS_SGLANG_FULL=1 compares the full partitions (passed 2026-12-05: 4 x 48 records, B1 121 turn rows).
LIMITS = None if os.environ.get("EAGLE_ASSETS_SGLANG_FULL") == "1" else {
    "B1_glaive": 8, "B2_opencodeinstruct": 8, "B4_mixturethoughts": 5, "B5_openthoughts": 5}
# SGLang sizes its KV pool from free memory by default (most of the machine's RAM on CPU): 8,192 tokens hold the
# default catalog's longest rows many times over
CPU_ARGS = ["--max-total-tokens", "8192"]


def _catalog(tmp: Path, server: dict, limits: dict[str, int] | None = None) -> Path:
    catalog = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    catalog.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    for key, limit in (limits or {}).items():
        catalog["partitions"][key]["limit"] = limit
    for spec in catalog["partitions"].values():  # the same absolute sources for both runs
        for src in spec["sources"]:
            src["path"] = str((REPO_ROOT / "catalogs" / src["path"]).resolve())
    catalog["server"] = {**catalog.get("server", {}), **server}
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog))
    return path


def _run(tmp: Path, server: dict, env: dict[str, str], args: list[str] = (),
         limits: dict[str, int] | None = None) -> Path:
    """``eagle-assets run --skip-training [args]`` of the default catalog with ``server`` (and partitions cut to
    ``limits`` records); its storage folder."""
    tmp.mkdir(parents=True, exist_ok=True)
    catalog = _catalog(tmp, server, limits)
    proc = subprocess.run([sys.executable, "-m", "eagle_assets.cli", "run", "--catalog", str(catalog),
                           "--skip-training", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env, "DAGSTER_HOME": str(tmp / "dagster_home"),
                               "EAGLE_ASSETS_HOME": str(tmp / "store")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "store" / "catalog"


@pytest.fixture(scope="module")
def runs(servers, tmp_path_factory):
    """(embedded run's storage, SGLang run's storage): ``eagle-assets run`` against the module's embedded server and
    against its real SGLang server (``servers``: started as the ``sglang`` resource starts one, ``launch: sglang``
    on ``device: cpu``; the resource launching it inside a run is ``test_real_sglang_features.py``). One server of
    each for the module: a real server's start is some 20 CPU-seconds."""
    real, ours = servers
    tmp = tmp_path_factory.mktemp("real_sglang")
    embedded = _run(tmp / "embedded", {"url": ours.url}, {}, limits=LIMITS)
    if os.environ.get("EAGLE_ASSETS_SGLANG_ALTER") == "1":
        from eagle_assets_tests.servers.altering_proxy import altering_proxy

        with altering_proxy(real.url) as proxy:
            return embedded, _run(tmp / "sglang", {"url": proxy}, {}, limits=LIMITS)
    return embedded, _run(tmp / "sglang", {"url": real.url}, {}, limits=LIMITS)


COMPARED = ("output_ids", "finish_reason", "matched_stop", "completion_tokens")


def _rows(store: Path, key: str) -> dict[str, tuple]:
    table = pq.read_table(sorted((store / "generations" / key).glob("shard-*.parquet")))
    return {r["sample_id"]: tuple(r[c] for c in COMPARED) for r in table.select(["sample_id", *COMPARED]).to_pylist()}


def test_every_partition_generates_what_the_embedded_server_generates(runs):
    embedded, sglang = runs
    for key in PARTITIONS:
        ours, theirs = _rows(embedded, key), _rows(sglang, key)
        assert ours and set(ours) == set(theirs), key
        different = sorted(sid for sid in ours if ours[sid] != theirs[sid])
        assert not different, (key, different[:3], [(ours[s], theirs[s]) for s in different[:1]])
    # B1's rollout: every turn prompt is rendered from the history of the model's own replies, so equal turn
    # tables mean SGLang's replies led the conversations exactly where ours did
    turns = [pq.read_table(root / "generations" / "B1_glaive" / "turns.parquet").sort_by("row_id").to_pylist()
             for root in (embedded, sglang)]
    assert turns[0] == turns[1] and len(turns[0]) > (60 if LIMITS is None else 12)
    assert {r["turn"] for r in turns[0]} >= {1, 2, 3}


def test_sglang_router_in_front_of_two_real_servers_serves_a_partition_once(runs, sglang_python, demo_target,
                                                                          sglang_environ, monkeypatch_module,
                                                                          tmp_path):
    """``server.url`` = an ``sglang-router`` (round robin) over two real servers: B2 cut to 6 records, run by
    ``eagle-assets run``, stores every prompt's row exactly once, equal to the embedded server's rows of those
    prompts. Each server's OpenMP threads are bound to a core of their own (``SGLANG_CPU_OMP_THREADS_BIND``), and
    6 short code replies keep it short: on one core SGLang's CPU engine decodes the demo target at about 15
    tokens/s."""
    if os.environ.get("EAGLE_ASSETS_SGLANG_ROUTER") != "1":
        pytest.skip("two more real SGLang servers cost about two minutes of a 2-core machine, past the suite's "
                    "budget: run with EAGLE_ASSETS_SGLANG_ROUTER=1 (passed 2026-12-05: 6 of 6 prompts once each)")
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (the test extra installs it)")
    from eagle_assets.serving.launch import free_port, launched_server, log_tail

    embedded, _ = runs
    cores = sorted(os.sched_getaffinity(0))
    launched = []
    with contextlib.ExitStack() as stack:
        for core in (cores[0], cores[-1]):
            monkeypatch_module.setenv("SGLANG_CPU_OMP_THREADS_BIND", str(core))
            launched.append(stack.enter_context(launched_server(
                str(demo_target), launch="sglang", python=str(sglang_python), device="cpu", extra_args=CPU_ARGS)))
        monkeypatch_module.delenv("SGLANG_CPU_OMP_THREADS_BIND")
        port = free_port()
        log = stack.enter_context(open(tmp_path / "router.log", "wb"))
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *[s.url for s in launched], "--policy", "round_robin", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            store = _run(tmp_path / "routed", {"url": f"http://127.0.0.1:{port}"}, {},
                         ["--partitions", "B2_opencodeinstruct"], limits={"B2_opencodeinstruct": 6})
        finally:
            router.terminate()
            router.wait(10)
        assert all(s.alive() for s in launched), log_tail(tmp_path / "router.log")
    table = pq.read_table(sorted((store / "generations" / "B2_opencodeinstruct").glob("shard-*.parquet")))
    sids = table.column("sample_id").to_pylist()
    assert len(sids) == len(set(sids)) == 6
    ours = _rows(embedded, "B2_opencodeinstruct")
    assert _rows(store, "B2_opencodeinstruct") == {sid: ours[sid] for sid in sids}


@pytest.fixture(scope="module")
def sglang_environ(monkeypatch_module):
    """This process's environment as the real servers it launches need it (:func:`real_sglang.sglang_env`)."""
    for name, value in sglang_env().items():
        monkeypatch_module.setenv(name, value)


@pytest.fixture(scope="module")
def servers(sglang_python, demo_target, sglang_environ):
    """(the real SGLang server, the embedded server), both serving the shipped demo target."""
    from eagle_assets.serving.launch import launched_server

    with launched_server(str(demo_target), launch="sglang", python=str(sglang_python), device="cpu",
                         extra_args=CPU_ARGS) as real, launched_server(str(demo_target)) as ours:
        yield real, ours


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _outcome(url: str, body: dict, vocab_size: int | None = None):
    """What our client makes of the server's reply to ``body``: the reply, or the failure after its retries."""
    import orjson

    from eagle_assets.serving.client import GenerateClient
    from eagle_assets.serving.protocol import parse_generate_reply

    client = GenerateClient([url], max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.05, timeout_s=60)
    ids = body["input_ids"]
    (result,) = client.post_all([("r", orjson.dumps(body))],
                                lambda rid, raw: parse_generate_reply(raw, ids, vocab_size, rid=None))
    return result


def test_the_client_reads_sglangs_own_error_replies_as_it_reads_ours(servers):
    from eagle_assets.serving.protocol import GenerateFailure

    real, ours = servers
    cases = {  # SGLang's own refusals: HTTP 400 with {"error": {"message"}}, never retried
        "over-long prompt": ({"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
                             "longer than the model's context length (4096 tokens)"),
        "bad sampling param": ({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": -1}},
                               "temperature must be a"),
        "top_p out of range": ({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "top_p": 2}},
                               "top_p must be in (0, 1], got 2"),
    }
    for name, (body, message) in cases.items():
        for server in (real, ours):
            got = _outcome(server.url, body)
            assert isinstance(got, GenerateFailure), (name, server.launch, got)
            assert (got.kind, got.attempts) == ("bad_request", 1) and message in got.last_error, (name, got)
    # a good request, for contrast: both answer it, with the same ids
    good = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    assert _outcome(real.url, good).output_ids == _outcome(ours.url, good).output_ids


def test_an_out_of_vocab_id_is_refused_before_it_reaches_sglang_whose_scheduler_it_would_kill(servers, demo_target):
    """SGLang 0.5.23 does not check input ids: an id past the vocab reaches its embedding and kills the scheduler
    (the whole server exits). Our client refuses it before sending (vocab check), and the server stays up."""
    from eagle_assets.serving.client import GenerateClient
    from eagle_assets.serving.protocol import GenerateFailure, SamplingParams
    from eagle_assets.target_model.config import config_vocab_size

    real, _ = servers
    vocab = config_vocab_size(demo_target)
    client = GenerateClient([real.url], max_attempts=2, backoff_base_s=0.01, timeout_s=60)
    (refused,) = client.generate_all([("r", [5, 6, vocab + 7])], SamplingParams(max_new_tokens=4), vocab_size=vocab)
    assert isinstance(refused, GenerateFailure) and (refused.kind, refused.attempts) == ("bad_input", 0)
    assert real.alive()


def test_a_request_after_the_server_stopped_fails_as_a_connection_error(servers, demo_target):
    """The module's last test: it stops the module's real server."""
    from eagle_assets.serving.client import GenerateClient, ServerUnavailable, run_sync
    from eagle_assets.serving.protocol import GenerateFailure, SamplingParams

    real, _ = servers
    client = GenerateClient([real.url], max_attempts=2, backoff_base_s=0.01, timeout_s=30)
    assert run_sync(client.probe())[real.url]["model_path"] == str(demo_target)
    real.stop()
    (gone,) = client.generate_all([("r", [5, 6, 7])], SamplingParams(max_new_tokens=4))
    assert isinstance(gone, GenerateFailure) and gone.kind == "connection" and gone.attempts == 2, gone
    with pytest.raises(ServerUnavailable, match="refused|connect"):
        run_sync(client.probe(attempts=1))
