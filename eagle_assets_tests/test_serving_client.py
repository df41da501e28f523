"""GenerateClient against misbehaving aiohttp servers on 127.0.0.1 (faults scripted per request id)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter, defaultdict

import pytest
from aiohttp import web

from eagle_assets.serving.client import GenerateClient, normalize_url
from eagle_assets.serving.protocol import GenerateFailure, GenerateReply, SamplingParams

VOCAB = 100
SP = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[2])


class FaultyServer:
    """An SGLang-shaped /generate whose attempt n for rid R does ``script[R][n]`` (then behaves)."""

    def __init__(self, script: dict[str, list[str]] | None = None, name: str = "s"):
        self.script = defaultdict(list, {k: list(v) for k, v in (script or {}).items()})
        self.name = name
        self.attempts: Counter = Counter()
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
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
        raise AssertionError(action)

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
