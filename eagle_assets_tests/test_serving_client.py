"""GenerateClient against misbehaving aiohttp servers on 127.0.0.1 (faults scripted per request id).

Bounds (issue 48): replies over the size cap (300 MB streamed lazily, a huge Content-Length), a valid reply just
under the cap, a 100k-deep JSON body, and error bodies that quote the API key across the excerpt's cut. The memory
test runs the client in a fresh subprocess and compares its peak RSS growth over a 300 MB reply with that over a
normal one.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from eagle_assets.catalog import CatalogError, load_catalog
from eagle_assets.drafter.features.served_client import RefusedRow, ServedFeatureSource, ServedFeaturesSpec
from eagle_assets.serving.client import (
    POST_DEFAULT_MAX_REPLY_BYTES,
    GenerateClient,
    generate_reply_cap,
    normalize_url,
)
from eagle_assets.serving.protocol import GenerateFailure, GenerateReply, SamplingParams

VOCAB = 100
SP = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[2])
REPO = Path(__file__).resolve().parents[1]
BIG = 300_000_000  # the reply that once took a run to 3.4 GB of RSS
KEY = "sk-live-0123456789abcdef0123456789abcdef"
DEEP = 100_000


class FaultyServer:
    """An SGLang-shaped /generate whose attempt n for rid R does ``script[R][n]`` (then behaves)."""

    def __init__(self, script: dict[str, list[str]] | None = None, name: str = "s"):
        self.script = defaultdict(list, {k: list(v) for k, v in (script or {}).items()})
        self.name = name
        self.attempts: Counter = Counter()
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.streamed: Counter = Counter()  # rid -> body bytes a streaming action wrote before the client left
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @staticmethod
    def good(body: dict) -> dict:
        out = [30 + i for i in range(3)] + [2]
        return {"text": "", "output_ids": out, "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out), "cached_tokens": 0,
            "e2e_latency": 0.001}}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        rid = body.get("rid")
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.attempts[rid] += 1
        action = self.script[rid].pop(0) if self.script[rid] else "ok"
        good = self.good(body)
        if action == "ok":
            return web.json_response(good)
        if action == "500":
            return web.Response(status=500, text="internal error")
        if action == "503":
            return web.Response(status=503, text="overloaded", headers={"Retry-After": "0"})
        if action == "429":
            return web.Response(status=429, text="slow down", headers={"Retry-After": "0.05"})
        if action == "400":
            return web.json_response({"error": {"message": "The input is invalid"}}, status=400)
        if action == "404":
            return web.Response(status=404)
        if action == "abort":
            good["output_ids"], good["meta_info"]["completion_tokens"] = [], 0
            good["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue"}
            return web.json_response(good)
        if action == "abort400":
            good["meta_info"]["finish_reason"] = {"type": "abort", "message": "bad input", "status_code": 400}
            return web.json_response(good)
        if action == "truncated":
            raw = json.dumps(good).encode()
            return web.Response(body=raw[: len(raw) // 2], content_type="application/json")
        if action == "ct_mismatch":
            good["meta_info"]["completion_tokens"] += 1
            return web.json_response(good)
        if action == "echo":
            good["output_ids"] = body["input_ids"][-2:] + good["output_ids"]
            return web.json_response(good)
        if action == "oov":
            good["output_ids"][0] = VOCAB + 5
            return web.json_response(good)
        if action == "wrong_rid":
            good["meta_info"]["id"] = "someone-else"
            return web.json_response(good)
        if action == "drop":
            request.transport.close()
            return web.Response()
        if action == "slow":
            await asyncio.sleep(1.0)
            return web.json_response(good)
        if action == "stream_big":  # 300 MB, chunked (no Content-Length), generated as it is sent
            return await self._stream(request, rid, BIG, announce=False)
        if action == "stream_20mb":  # under post_many's default cap, over a features row's
            return await self._stream(request, rid, 20_000_000, announce=False)
        if action == "huge_length":  # Content-Length says 300 MB; the client must refuse before the body
            return await self._stream(request, rid, BIG, announce=True)
        if action in ("at_cap", "over_cap"):  # a valid reply padded to exactly the cap (or one byte more)
            raw = json.dumps(good).encode()
            size = generate_reply_cap(body["sampling_params"]["max_new_tokens"]) + (action == "over_cap")
            good["text"] = " " * (size - len(raw))
            return web.Response(body=json.dumps(good).encode(), content_type="application/json")
        if action == "deep_list":
            return web.Response(body=b"[" * DEEP + b"]" * DEEP, content_type="application/json")
        if action == "deep_object":
            return web.Response(body=b'{"a":' * DEEP + b"1" + b"}" * DEEP, content_type="application/json")
        if action == "deep_error":  # orjson-parsable (< 1,024 levels) but too deep for repr
            return web.Response(body=b'{"error":' + b"[" * 1000 + b"]" * 1000 + b"}", content_type="application/json")
        if action == "auth_500":  # a proxy quoting the Authorization header so that the key straddles byte 300
            auth = request.headers.get("Authorization", "")
            pad = "x" * (300 - len("upstream failed: ") - len("Bearer ") - 6)
            return web.Response(status=500, text=f"upstream failed: {pad}{auth} and more text after it")
        if action == "auth_error_200":  # an error object quoting the key across parse_generate_reply's 500-char cut
            auth = request.headers.get("Authorization", "")
            return web.json_response({"error": {"message": "y" * (500 - len("{'message': '") - len("Bearer ") - 9)
                                                + auth + " rest"}})
        raise AssertionError(action)

    async def _stream(self, request: web.Request, rid: str, total: int, announce: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if announce:
            resp.content_length = total
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        chunk = b"1," * 32768  # 64 KiB, the same bytes each time: nothing of the body is held
        try:
            await resp.write(b'{"output_ids":[')
            while self.streamed[rid] < total:
                await resp.write(chunk)
                self.streamed[rid] += len(chunk)
        except (ConnectionError, RuntimeError):  # the client closed the connection: stop generating
            pass
        return resp

    def __enter__(self) -> "FaultyServer":
        self._thread.start()

        async def start():
            app = web.Application()
            app.router.add_post("/generate", self.generate)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _client(urls, **kw) -> GenerateClient:
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("cooldown_s", 0.05)
    return GenerateClient(urls, **kw)


def test_retries_recover_from_transient_faults():
    script = {
        "five": ["500", "503", "500"],
        "abort": ["abort"],
        "trunc": ["truncated"],
        "count": ["ct_mismatch"],
        "busy": ["429"],
        "drop": ["drop"],
        "vocab": ["oov"],
        "mixup": ["wrong_rid"],
        "clean": [],
    }
    with FaultyServer(script) as server:
        client = _client([server.url], concurrency_per_server=4, max_attempts=5)
        items = [(rid, [5, 6, 7, 8]) for rid in script]
        results = client.generate_all(items, SP, vocab_size=VOCAB)
    by_rid = {r.rid: r for r in results}
    assert all(isinstance(r, GenerateReply) for r in results), results
    expected = {rid: len(faults) + 1 for rid, faults in script.items()}
    assert {rid: r.attempts for rid, r in by_rid.items()} == expected
    assert all(r.output_ids == [30, 31, 32, 2] and r.server_url == server.url for r in results)
    stats = client.last_stats
    assert stats.succeeded == len(script) and stats.retries == sum(expected.values()) - len(script)
    assert stats.attempt_errors == Counter({"http_5xx": 3, "abort": 1, "bad_json": 1, "length_mismatch": 1,
                                            "http_429": 1, "connection": 1, "id_out_of_vocab": 1,
                                            "rid_mismatch": 1})


def test_failures_after_retries_and_refusals_that_are_not_retried():
    script = {
        "always500": ["500"] * 10,
        "refused": ["400"],
        "refused_abort": ["abort400"],
        "wrong_url": ["404"],
        "echo": ["echo"] * 10,
    }
    with FaultyServer(script) as server:
        results = _client([server.url], max_attempts=3).generate_all([(r, [5, 6, 7]) for r in script], SP, VOCAB)
        seen = dict(server.attempts)
    got = {r.rid: (r.kind, r.attempts) for r in results}
    assert all(isinstance(r, GenerateFailure) for r in results)
    assert got == {
        "always500": ("http_5xx", 3),
        "refused": ("bad_request", 1),
        "refused_abort": ("abort", 1),
        "wrong_url": ("not_found", 1),
        "echo": ("prompt_echo", 3),
    }
    assert seen == {rid: n for rid, (_, n) in got.items()}
    failure = next(r for r in results if r.rid == "always500")
    assert failure.errors == ("http_5xx",) * 3 and "HTTP 500" in failure.last_error
    assert "The input is invalid" in next(r for r in results if r.rid == "refused").last_error


def test_timeout_is_retried_then_reported():
    with FaultyServer({"slow": ["slow", "slow"]}) as server:
        t0 = time.monotonic()
        result = _client([server.url], timeout_s=0.3, max_attempts=2).generate_all([("slow", [5])], SP)[0]
    assert isinstance(result, GenerateFailure) and result.kind == "timeout" and result.attempts == 2
    assert "0.3s" in result.last_error and time.monotonic() - t0 < 3.0


def test_request_body_is_sglang_native():
    sp = SamplingParams(max_new_tokens=64, temperature=0.6, top_p=0.95, top_k=20, stop_token_ids=[2, 9], seed=7)
    with FaultyServer() as server:
        result = _client([server.url]).generate_all([("abc", (5, 6, 7))], sp, VOCAB)[0]
        body = server.bodies[0]
    assert isinstance(result, GenerateReply)
    assert body == {"input_ids": [5, 6, 7], "rid": "abc", "sampling_params": {
        "max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "skip_special_tokens": False,
        "stop_token_ids": [2, 9], "sampling_seed": 7}}


def test_bad_inputs_fail_without_a_request():
    items = [("empty", []), ("oov", [5, VOCAB]), ("neg", [-1, 5]), ("text", "hello"), ("floats", [5, 6.0]),
             ("short",), ("params", [5], {"max_new_tokens": 3}), 42, ("fine", [5, 6])]
    with FaultyServer() as server:
        results = _client([server.url]).generate_all(items, SP, VOCAB)
        sent = [b["rid"] for b in server.bodies]
    assert sent == ["fine"]
    kinds = {r.rid: (r.kind if isinstance(r, GenerateFailure) else "ok") for r in results}
    assert kinds == {"empty": "bad_input", "oov": "bad_input", "neg": "bad_input", "text": "bad_input",
                     "floats": "bad_input", "short": "bad_input", "params": "bad_input", "42": "bad_input",
                     "fine": "ok"}
    assert all(r.attempts == 0 for r in results if isinstance(r, GenerateFailure))


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_several_servers_share_load_and_a_dead_one_is_routed_around():
    with FaultyServer(name="a") as a, FaultyServer(name="b") as b:
        client = _client([a.url, _dead_url(), b.url + "/generate"], concurrency_per_server=4, max_attempts=4)
        results = client.generate_all([(f"r{i}", [5, 6, i % 50 + 7]) for i in range(120)], SP, VOCAB)
        share_a, share_b = sum(a.attempts.values()), sum(b.attempts.values())
    assert all(isinstance(r, GenerateReply) for r in results)
    assert share_a + share_b == 120
    assert min(share_a, share_b) > 20  # least-loaded + round robin spreads the work
    errors = client.last_stats.attempt_errors
    assert errors.keys() == {"connection"} and errors["connection"] >= 1  # the dead URL was tried, then avoided


def test_on_result_async_callbacks_and_errors():
    async def scenario(server_url):
        seen = []

        async def on_result(rid, result):
            await asyncio.sleep(0)
            seen.append((rid, type(result).__name__))

        client = _client([server_url], concurrency_per_server=3)
        stats = await client.generate_many(((f"r{i}", [5, 6]) for i in range(10)), SP, VOCAB, on_result)
        return seen, stats

    with FaultyServer() as server:
        seen, stats = asyncio.run(scenario(server.url))
        assert sorted(seen) == sorted((f"r{i}", "GenerateReply") for i in range(10))
        assert stats.requests == stats.succeeded == stats.attempts == 10 and len(stats.latencies_s) == 10
        assert stats.summary()["latency_p50_ms"] > 0

        def explode(rid, result):
            raise RuntimeError("sink failed")

        with pytest.raises(RuntimeError, match="sink failed"):
            asyncio.run(_client([server.url]).generate_many([("x", [5])], SP, VOCAB, explode))


def test_generate_all_keeps_input_order_and_runs_inside_a_loop():
    with FaultyServer() as server:
        client = _client([server.url], concurrency_per_server=8)
        items = [(f"r{i}", [5, 6, 7 + i]) for i in range(20)]
        assert [r.rid for r in client.generate_all(items, SP, VOCAB)] == [rid for rid, _ in items]
        with pytest.raises(ValueError, match="duplicate rid 'r1'"):
            client.generate_all([("r1", [5]), ("r1", [6])], SP)

        async def inside():
            return client.generate_all(items[:2], SP, VOCAB)

        assert [r.rid for r in asyncio.run(inside())] == ["r0", "r1"]


def test_api_key_comes_from_the_environment_and_is_never_shown(monkeypatch):
    monkeypatch.delenv("EAGLE_MISSING_KEY", raising=False)
    with pytest.raises(ValueError, match="EAGLE_MISSING_KEY"):
        GenerateClient(["http://127.0.0.1:1"], api_key_env="EAGLE_MISSING_KEY")
    monkeypatch.setenv("EAGLE_CLIENT_KEY", "top-secret-value")
    with FaultyServer({"x": ["500"] * 5}) as server:
        client = _client([server.url], api_key_env="EAGLE_CLIENT_KEY", max_attempts=2)
        results = client.generate_all([("x", [5]), ("y", [6])], SP)
        auth = set(server.auth)
    assert auth == {"Bearer top-secret-value"}
    assert "top-secret-value" not in repr(client)
    assert all("top-secret-value" not in (getattr(r, "last_error", "") or "") for r in results)


def test_url_normalization():
    assert normalize_url("127.0.0.1:30000/") == "http://127.0.0.1:30000"
    assert normalize_url("http://h:1/generate") == "http://h:1"
    with pytest.raises(ValueError, match="at least one server URL"):
        GenerateClient([])


# ----------------------------------------------------------------------------------------- bounds (issue 48)
def _no_key(text: str) -> None:
    """Neither the key nor any 4-character piece of its head is in ``text``."""
    assert KEY not in text
    assert not any(KEY[:n] in text for n in range(4, len(KEY))), text


def test_oversized_replies_are_one_failure_each_and_are_not_read_past_the_cap():
    script = {"big": ["stream_big"], "announced": ["huge_length"], "over": ["over_cap"], "at": ["at_cap"],
              "fine": []}
    with FaultyServer(script) as server:
        results = _client([server.url], max_attempts=3).generate_all([(r, [5, 6, 7]) for r in script], SP, VOCAB)
        seen, streamed = dict(server.attempts), dict(server.streamed)
    by_rid = {r.rid: r for r in results}
    cap = generate_reply_cap(SP.max_new_tokens)
    assert cap == 1_048_576 + 512 * 8
    assert isinstance(by_rid["fine"], GenerateReply) and isinstance(by_rid["at"], GenerateReply)
    assert by_rid["at"].output_ids == [30, 31, 32, 2]  # a valid reply of exactly the cap is kept
    for rid in ("big", "announced", "over"):
        failure = by_rid[rid]
        assert isinstance(failure, GenerateFailure) and failure.kind == "reply_too_large", failure
        assert failure.attempts == 1 and seen[rid] == 1  # not retried: the same server fault would come back
        assert f"{cap:,}-byte limit" in failure.last_error and "server.max_reply_bytes" in failure.last_error
        assert "max_new_tokens=8" in failure.last_error
    assert "Content-Length 300,000,000 bytes" in by_rid["announced"].last_error
    assert "not read" in by_rid["announced"].last_error
    assert "bytes read when reading stopped" in by_rid["big"].last_error
    # the client closed the connection soon after the cap: the server could not push the 300 MB
    assert streamed["big"] < 64 * cap and streamed["announced"] < 64 * cap, streamed
    assert client_stats_kinds(results) == {"reply_too_large": 3}


def client_stats_kinds(results) -> dict[str, int]:
    return dict(Counter(r.kind for r in results if isinstance(r, GenerateFailure)))


def test_explicit_cap_overrides_the_derived_one_and_is_checked():
    with FaultyServer() as server:
        small = _client([server.url], max_reply_bytes=100)
        (failure,) = small.generate_all([("r", [5, 6, 7])], SP, VOCAB)
        (reply,) = _client([server.url], max_reply_bytes=10_000).generate_all([("r", [5, 6, 7])], SP, VOCAB)
    assert isinstance(failure, GenerateFailure) and failure.kind == "reply_too_large"
    assert "100-byte limit" in failure.last_error and "server.max_reply_bytes in the catalog" in failure.last_error
    assert isinstance(reply, GenerateReply)
    for bad in (0, -1, True, 1.5, "64MiB"):
        with pytest.raises(ValueError, match="max_reply_bytes must be an int >= 1"):
            GenerateClient(["http://127.0.0.1:1"], max_reply_bytes=bad)


def test_deeply_nested_replies_are_one_bad_json_failure_not_an_exception():
    script = {"list": ["deep_list"] * 9, "object": ["deep_object"] * 9, "error": ["deep_error"] * 9,
              "recovers": ["deep_list"]}
    with FaultyServer(script) as server:
        results = _client([server.url], max_attempts=2).generate_all([(r, [5, 6, 7]) for r in script], SP, VOCAB)
    got = {r.rid: (type(r).__name__, getattr(r, "kind", None), r.attempts) for r in results}
    assert got == {"list": ("GenerateFailure", "bad_json", 2), "object": ("GenerateFailure", "bad_json", 2),
                   "error": ("GenerateFailure", "server_error", 2), "recovers": ("GenerateReply", None, 2)}
    assert "nests arrays or objects deeper" in results[0].last_error
    assert "nested too deeply to show" in results[2].last_error


def test_the_key_never_survives_a_cut_of_a_quoted_body(monkeypatch):
    monkeypatch.setenv("EAGLE_BOUNDS_KEY", KEY)
    script = {"proxy": ["auth_500"] * 5, "object": ["auth_error_200"] * 5}
    with FaultyServer(script) as server:
        client = _client([server.url], api_key_env="EAGLE_BOUNDS_KEY", max_attempts=2)
        results = client.generate_all([(r, [5, 6, 7]) for r in script], SP, VOCAB)
        auth = set(server.auth)
    assert auth == {f"Bearer {KEY}"}
    proxy, obj = results
    assert (proxy.kind, obj.kind) == ("http_5xx", "server_error")
    assert "upstream failed: xxx" in proxy.last_error and "Bearer ***" in proxy.last_error
    assert "Bearer ***" in obj.last_error
    for failure in results:
        _no_key(failure.last_error)
    # the rule itself: a key prefix before a cut mark or at the end goes, the text around it stays
    assert client.redact(f"a Bearer {KEY[:6]}... b") == "a Bearer ***... b"
    assert client.redact(f"ends with {KEY[:9]}") == "ends with ***"
    assert client.redact(f"{KEY[:3]}... mid {KEY[:6]} word") == f"{KEY[:3]}... mid {KEY[:6]} word"


CLIENT_RSS = r"""
import json, resource, sys
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams
url, rid = sys.argv[1], sys.argv[2]
sp = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[2])
client = GenerateClient([url], max_attempts=1, timeout_s=300)
for i in range(3):  # warm up every code path of a request before the baseline
    client.generate_all([(f"warm{i}", [5, 6, 7])], sp)
client.generate_all([("warm-fail", [5, 6, 7])], sp)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
(result,) = client.generate_all([(rid, [5, 6, 7])], sp)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_kib": after - before, "peak_kib": after, "kind": getattr(result, "kind", "ok")}))
"""


def _client_rss(url: str, rid: str) -> dict:
    """Peak-RSS growth (KiB, Linux ``ru_maxrss``) of a fresh client process over one request ``rid``."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", CLIENT_RSS, url, rid], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_a_300_mb_reply_costs_the_client_no_more_memory_than_a_normal_one():
    script = {"warm-fail": ["over_cap"], "big": ["stream_big"], "normal": []}
    with FaultyServer(script) as server:
        normal = _client_rss(server.url, "normal")
        big = _client_rss(server.url, "big")
        streamed = server.streamed["big"]
    assert normal["kind"] == "ok" and big["kind"] == "reply_too_large"
    # peak RSS never shrinks, so growth is what the request added at its worst; no timing is involved. Before the
    # cap, the client held the whole body (and its parse): hundreds of MB
    assert big["growth_kib"] <= normal["growth_kib"] + 8 * 1024, (normal, big)
    assert streamed < BIG // 10


def test_post_many_takes_the_callers_cap_and_served_features_derive_theirs():
    def body(rid: str) -> bytes:
        return json.dumps({"input_ids": [5, 6, 7], "rid": rid, "sampling_params": {"max_new_tokens": 8}}).encode()

    with FaultyServer({"a": ["stream_20mb"], "b": ["stream_20mb"]}) as server:
        client = _client([server.url])
        capped = client.post_all([("a", body("a"))], lambda rid, raw: raw, max_reply_bytes=1_000_000)
        default = client.post_all([("b", body("b"))], lambda rid, raw: len(raw))  # 20 MB < the 64 MiB default
    assert capped[0].kind == "reply_too_large" and "the caller's" in capped[0].last_error
    assert default[0] == len(b'{"output_ids":[') + 20_000_000 - 20_000_000 % 65536 + 65536
    assert POST_DEFAULT_MAX_REPLY_BYTES == 64 << 20
    with pytest.raises(ValueError, match="max_reply_bytes"):
        client.post_all([("c", body("c"))], lambda rid, raw: raw, max_reply_bytes=0)

    # served features: the cap comes from the row (4 tokens x 3 layers x hidden 16 x 25 bytes per value, ...)
    config = {"model_type": "qwen3", "num_hidden_layers": 8, "hidden_size": 16, "vocab_size": VOCAB}
    rows = [(rid, np.array([5, 6, 7, 8]), np.array([0, 1, 1, 1], dtype=np.int8)) for rid in ("big", "deep", "obj")]
    with FaultyServer({"big": ["stream_20mb"], "deep": ["deep_list"] * 5, "obj": ["deep_object"] * 5}) as server:
        source = ServedFeatureSource(config, ServedFeaturesSpec(source="served", url=server.url, max_attempts=2))
        got = {r.row_id: r for r in source.fetch(rows)}
        streamed = server.streamed["big"]
    width = 3 * 16
    assert source.reply_cap(4) == (1 << 20) + 4 * (width * 25 + 2 * 64 + 512)
    assert all(isinstance(r, RefusedRow) for r in got.values())
    assert {rid: r.reason for rid, r in got.items()} == {"big": "reply_too_large", "deep": "bad_json",
                                                          "obj": "bad_json"}
    assert "(1 attempts)" in got["big"].detail and f"{source.reply_cap(4):,}-byte limit" in got["big"].detail
    assert streamed < 20_000_000


def test_catalog_server_max_reply_bytes(tmp_path):
    base = ("partitions:\n  P1:\n    sources: [{path: x.jsonl, format: auto}]\n"
            "    sampling: {max_new_tokens: 64}\n")

    def load(value: str):
        path = tmp_path / "catalog.yaml"
        path.write_text(base + f"server: {{max_reply_bytes: {value}}}\n")
        return load_catalog(path)

    assert load("null").server.max_reply_bytes is None
    assert load("67108864").server.max_reply_bytes == 64 << 20
    assert load("'1000'").server.max_reply_bytes == 1000  # digits from a ${VAR} expansion
    for bad in ("0", "-5", "true", "'64MiB'", "1.5e+6", "[1]"):
        with pytest.raises(CatalogError, match=r"server\.max_reply_bytes: must be a whole number of bytes >= 1"):
            load(bad)
