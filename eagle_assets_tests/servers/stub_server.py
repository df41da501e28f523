"""A model-free server speaking SGLang's native ``/generate``, with deterministic replies and faults on demand.

What it is for: measuring the client (no model cost hides client overhead), fault drills (a real HTTP server that
misbehaves on purpose), and kill/resume tests that need thousands of cheap replies. It is never a target model.

Replies (same shape as SGLang's, see ``eagle_assets.serving.protocol``): ``output_ids`` are a pure function of
``input_ids`` and the sampling params (``stub_output_ids``), so a rerun, a retry or a resumed run gets the same ids;
``meta_info`` carries ``id`` (= ``rid``), ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
``cached_tokens`` 0 and ``e2e_latency``. With ``output_tokens`` set every reply has exactly that many ids and
finishes by ``length`` (the benchmark's fixed 1,000-token outputs; the encoded ids are built once and reused).

Structured replies (live-quality drills; both ignored when ``output_tokens`` is set): with ``think_end_id`` set a
stop-terminated reply closes a reasoning block half way, ``[reasoning..., think_end, answer..., stop]``, so it
segments as a whole row for a profile with that think-end id (prompts that open the think block); with
``truncate_share`` set, that share of the requests, chosen by a hash of the ``rid`` (``stub_truncates``), gets a
reply cut at ``max_new_tokens`` without a think end: ``finish_reason {"type": "length", "length": max_new_tokens}``
and ``max_new_tokens`` ids, as SGLang answers a generation that hits its cap inside the reasoning.

Faults: an in-process ``StubServer`` takes ``fault(rid, attempt, body) -> action | None``; actions (``FAULTS``):
``http_500``, ``http_503`` (with ``Retry-After: 0``), ``http_429``, ``http_400``, ``abort`` (HTTP 200 with
``finish_reason`` abort, as SGLang sends it), ``truncated`` (half a JSON body), ``ct_mismatch``
(``completion_tokens`` one more than the ids), ``echo`` (the prompt's last 3 ids in front of ``output_ids``, the
SGLang incremental-detokenization bug), ``echo_counted`` (the prompt's last ``SGLANG_ECHO_IDS`` = 5 ids in front of
``output_ids`` and counted in ``completion_tokens``, as the SGLang versions that count the echo answer: the counts
agree), ``tail_like`` (not a fault: a good reply whose first 2 ids equal the prompt's last 2 ids, counted; a reply
the client must keep unless those ids are chat-template structure), ``oov`` (an id outside the vocab), ``drop``
(close the connection without an answer), ``reset`` (TCP RST: ``SO_LINGER`` 0 then close), ``hang`` (answer after
``hang_s``, past a client timeout), ``echo_auth`` (HTTP 500 whose body quotes the request's ``Authorization`` header,
as careless proxies do).

CLI (benchmarks; prints ``EAGLE_ASSETS_SERVER_READY http://HOST:PORT`` once it serves):
``python -m eagle_assets_tests.servers.stub_server [--port 0] [--latency-ms 0] [--output-tokens N] [--vocab-size V]
[--shape THINK_START,THINK_END,STOP[,MEDIAN,SIGMA,CAP_SHARE]]`` (``ReplyShape``: long-tailed reasoning replies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from aiohttp import web

from eagle_assets.serving.launch import READY_PREFIX

FAULTS = ("http_500", "http_503", "http_429", "http_400", "abort", "truncated", "ct_mismatch", "echo", "echo_counted",
          "tail_like", "oov", "drop", "reset", "hang", "echo_auth")
# SGLang's incremental-detokenization window (INIT_INCREMENTAL_DETOKENIZATION_OFFSET in schedule_batch.py): the
# prompt ids a buggy version puts in front of output_ids.
SGLANG_ECHO_IDS = 5
FaultFn = Callable[[str, int, dict], "str | None"]
# ids below this are left to special tokens so stub replies never contain a stop id by accident
FIRST_ORDINARY_ID = 8


def stub_output_ids(
    input_ids: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    stop_token_ids: Sequence[int] = (),
    output_tokens: int | None = None,
    think_end_id: int | None = None,
) -> tuple[list[int], dict[str, Any]]:
    """The stub's reply ids for a prompt: deterministic in (input_ids, max_new_tokens, vocab, stop ids).

    Args:
        input_ids: prompt ids (ints).
        max_new_tokens: the request's cap (>= 1).
        vocab_size: ids are drawn from ``[FIRST_ORDINARY_ID, vocab_size)``.
        stop_token_ids: when non-empty and the drawn length is under the cap, the first stop id ends the reply
            (kept in ``output_ids``, as SGLang does) and the finish reason is ``stop``.
        output_tokens: fixed reply length (capped to ``max_new_tokens``); finish reason ``length``.
        think_end_id: when set, a stop-terminated reply of ``n >= 2`` ids carries it at index ``(n - 2) // 2``
            (reasoning before it, answer after it; ``n >= 3`` leaves a non-empty answer).
    Returns:
        (output_ids, finish_reason dict in SGLang's ``to_json`` form).
    """
    seed = zlib.crc32(array("q", input_ids).tobytes()) ^ (max_new_tokens * 0x9E3779B1)
    span = max(1, vocab_size - FIRST_ORDINARY_ID)
    if output_tokens is not None:
        n = min(output_tokens, max_new_tokens)
        return ([FIRST_ORDINARY_ID + (seed + 7919 * i) % span for i in range(n)],
                {"type": "length", "length": max_new_tokens})
    n = 1 + seed % max_new_tokens
    ids = [FIRST_ORDINARY_ID + (seed * 31 + 7919 * i) % span for i in range(n)]
    if stop_token_ids and n < max_new_tokens:
        ids[-1] = int(stop_token_ids[0])
        if think_end_id is not None and n >= 2:
            ids[(n - 2) // 2] = int(think_end_id)
        return ids, {"type": "stop", "matched": int(stop_token_ids[0])}
    return ids, {"type": "length", "length": max_new_tokens}


@dataclass(frozen=True)
class ReplyShape:
    """Reasoning-model replies of lognormal length (the benchmarks' "~1,000 tokens with a long tail").

    A reply to request ``rid`` (a pure function of ``rid`` and ``max_new_tokens``) has ``n`` ids, ``n`` lognormal
    with median ``median`` and shape ``sigma``, capped at ``max_new_tokens``; a share ``cap_share`` of the rids
    runs to the cap. Layout: ``[think_start, reasoning..., think_end, answer..., stop]`` with the think-end at
    60-90% of the reply, finish reason ``stop`` (matched ``stop``); a reply at the cap has no think-end and no stop
    id and finishes by ``length``, as SGLang answers a generation cut inside its reasoning. Ordinary ids are drawn
    from ``[FIRST_ORDINARY_ID, vocab_size)``: give the first special id as ``vocab_size``.
    """

    think_start_id: int
    think_end_id: int
    stop_id: int
    median: float = 850.0
    sigma: float = 0.55
    cap_share: float = 0.005

    def output_ids(self, rid: str, max_new_tokens: int, vocab_size: int) -> tuple[list[int], dict[str, Any]]:
        import numpy as np

        rng = np.random.default_rng(zlib.crc32(str(rid).encode()) ^ (max_new_tokens * 0x9E3779B1))
        capped = rng.random() < self.cap_share
        n = max_new_tokens if capped else int(min(max(rng.lognormal(np.log(self.median), self.sigma), 4),
                                                  max_new_tokens))
        ids = rng.integers(FIRST_ORDINARY_ID, vocab_size, n)
        ids[0] = self.think_start_id
        if n < max_new_tokens:
            ids[1 + int((n - 3) * rng.uniform(0.6, 0.9))] = self.think_end_id
            ids[-1] = self.stop_id
            return ids.tolist(), {"type": "stop", "matched": self.stop_id}
        return ids.tolist(), {"type": "length", "length": max_new_tokens}


def stub_truncates(rid: str, share: float) -> bool:
    """Whether a stub with ``truncate_share=share`` cuts the reply to request ``rid`` (a pure function of both)."""
    return share > 0 and zlib.crc32(str(rid).encode()) % 10_000 < share * 10_000


@dataclass
class StubStats:
    """Counters of a running stub: requests in all, requests per rid, faults served by action."""

    requests: int = 0
    per_rid: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)


class StubServer:
    """The stub's aiohttp application and its state.

    Args:
        vocab_size: vocab the ids come from (also reported by ``/get_model_info``).
        latency_s: seconds each reply waits before it is sent (an ``asyncio.sleep``: no CPU).
        output_tokens: fixed reply length (see ``stub_output_ids``); None = a length derived from the prompt.
        fault: ``fault(rid, attempt, body) -> action | None`` (attempt counts from 1 per rid); None = always good.
        hang_s: how long the ``hang`` action waits.
        on_request: ``on_request(n)`` called with the running request count before anything else (kill tests
            use it to SIGKILL a client at an exact point).
        keep_bodies: keep every parsed request body in ``bodies`` (tests of the request shape).
        think_end_id: close a reasoning block half way in stop-terminated replies (see the module doc).
        truncate_share: share 0..1 of the rids whose reply is cut at ``max_new_tokens`` (``stub_truncates``).
        shape: a ``ReplyShape`` (long-tailed reasoning replies; ``output_tokens``, ``think_end_id`` and
            ``truncate_share`` are then ignored).
    """

    def __init__(
        self,
        vocab_size: int = 32000,
        latency_s: float = 0.0,
        output_tokens: int | None = None,
        fault: FaultFn | None = None,
        hang_s: float = 30.0,
        on_request: Callable[[int], None] | None = None,
        keep_bodies: bool = False,
        think_end_id: int | None = None,
        truncate_share: float = 0.0,
        shape: ReplyShape | None = None,
    ):
        self.vocab_size = int(vocab_size)
        self.latency_s = float(latency_s)
        self.output_tokens = output_tokens
        self.fault = fault
        self.hang_s = float(hang_s)
        self.on_request = on_request
        self.keep_bodies = keep_bodies
        self.think_end_id = think_end_id
        self.truncate_share = float(truncate_share)
        self.shape = shape
        self.bodies: list[dict] = []
        self.stats = StubStats()
        self._fixed_cache: dict[int, bytes] = {}

    # the common case (fixed length, no fault) is assembled from cached bytes: the stub must outrun the client
    def _fixed_ids_bytes(self, max_new_tokens: int) -> bytes:
        hit = self._fixed_cache.get(max_new_tokens)
        if hit is None:
            ids, _ = stub_output_ids([0], max_new_tokens, self.vocab_size, (), self.output_tokens)
            hit = json.dumps(ids, separators=(",", ":")).encode()
            self._fixed_cache[max_new_tokens] = hit
        return hit

    def reply(self, body: dict, started: float) -> dict:
        """The good reply dict for a request body."""
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        if self.shape is not None:
            ids, finish = self.shape.output_ids(str(body.get("rid")), max_new, self.vocab_size)
        elif self.output_tokens is None and stub_truncates(str(body.get("rid")), self.truncate_share):
            # cut at the cap inside the reasoning: max_new_tokens ids, no think end, no stop id
            ids, finish = stub_output_ids(body["input_ids"], max_new, self.vocab_size, (), max_new)
        else:
            ids, finish = stub_output_ids(body["input_ids"], max_new, self.vocab_size,
                                          sp.get("stop_token_ids") or (), self.output_tokens, self.think_end_id)
        return {"text": "", "output_ids": ids, "meta_info": {
            "id": body.get("rid"), "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": round(time.monotonic() - started, 6)}}

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        self.stats.requests += 1
        if self.on_request is not None:
            self.on_request(self.stats.requests)
        try:
            body = json.loads(await request.read())
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
                raise ValueError("input_ids must be one non-empty list of ints (the stub takes no batches)")
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": {"message": f"bad request: {exc}"}}, status=400)
        rid = str(body.get("rid"))
        if self.keep_bodies:
            self.bodies.append(body)
        self.stats.per_rid[rid] += 1
        action = self.fault(rid, self.stats.per_rid[rid], body) if self.fault is not None else None
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if action is None:
            if self.output_tokens is not None and self.shape is None:
                sp = body.get("sampling_params") or {}
                max_new = int(sp.get("max_new_tokens", 128))
                ids_bytes = self._fixed_ids_bytes(max_new)
                n = min(self.output_tokens, max_new)
                raw = b"".join((
                    b'{"text":"","output_ids":', ids_bytes, b',"meta_info":{"id":',
                    json.dumps(body.get("rid")).encode(),
                    b',"finish_reason":{"type":"length","length":', str(max_new).encode(), b'},"prompt_tokens":',
                    str(len(ids)).encode(), b',"completion_tokens":', str(n).encode(),
                    b',"cached_tokens":0,"e2e_latency":', f"{time.monotonic() - started:.6f}".encode(), b"}}",
                ))
                return web.Response(body=raw, content_type="application/json")
            return web.json_response(self.reply(body, started))
        self.stats.faults[action] += 1
        return await self._misbehave(action, request, body, started)

    async def _misbehave(self, action: str, request: web.Request, body: dict, started: float) -> web.StreamResponse:
        good = self.reply(body, started)
        meta = good["meta_info"]
        if action == "http_500":
            return web.Response(status=500, text="Internal Server Error")
        if action == "http_503":
            return web.Response(status=503, text="server overloaded", headers={"Retry-After": "0"})
        if action == "http_429":
            return web.Response(status=429, text="too many requests", headers={"Retry-After": "0"})
        if action == "http_400":
            return web.json_response({"error": {"message": "The input is invalid"}}, status=400)
        if action == "abort":
            good["output_ids"], meta["completion_tokens"] = [], 0
            meta["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue", "status_code": 503}
            return web.json_response(good)
        if action == "truncated":
            raw = json.dumps(good).encode()
            return web.Response(body=raw[: len(raw) // 2], content_type="application/json")
        if action == "ct_mismatch":
            meta["completion_tokens"] += 1
            return web.json_response(good)
        if action == "echo":
            good["output_ids"] = list(body["input_ids"][-3:]) + good["output_ids"]
            return web.json_response(good)
        if action == "echo_counted":
            good["output_ids"] = list(body["input_ids"][-SGLANG_ECHO_IDS:]) + good["output_ids"]
            meta["completion_tokens"] = len(good["output_ids"])
            return web.json_response(good)
        if action == "tail_like":
            tail, ids = list(body["input_ids"][-2:]), good["output_ids"]
            # the reply keeps its own last id (its stop id) after the prompt-like head
            good["output_ids"] = tail + (ids[len(tail):] if len(ids) > len(tail) else ids[-1:])
            meta["completion_tokens"] = len(good["output_ids"])
            return web.json_response(good)
        if action == "oov":
            good["output_ids"][0] = self.vocab_size + 3
            return web.json_response(good)
        if action in ("drop", "reset"):
            transport = request.transport
            if transport is not None:
                sock = transport.get_extra_info("socket")
                if action == "reset" and sock is not None:
                    # SO_LINGER with a zero timeout makes close() send RST instead of FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.close()
            return web.Response()
        if action == "hang":
            await asyncio.sleep(self.hang_s)
            return web.json_response(good)
        if action == "echo_auth":
            return web.Response(status=500, text=f"upstream failed for headers {dict(request.headers)}")
        raise ValueError(f"unknown stub fault {action!r}; known: {FAULTS}")

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stub", "tokenizer_path": "stub", "is_generation": True,
                                  "vocab_size": self.vocab_size})

    async def handle_server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stub", "vocab_size": self.vocab_size,
                                  "requests": self.stats.requests, "faults": dict(self.stats.faults)})

    def build_app(self) -> web.Application:
        """The aiohttp application (``/generate``, ``/health``, ``/get_model_info``, ``/get_server_info``)."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/generate", self.handle_generate)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/health_generate", self.handle_health)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self.handle_model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self.handle_server_info)
        return app


async def _start(stub: StubServer, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(stub.build_app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    return runner, int(site._server.sockets[0].getsockname()[1])


@dataclass
class RunningStub:
    """A stub serving in a background thread: ``url`` is ``http://host:port``."""

    url: str
    stub: StubServer


@contextlib.contextmanager
def serve_stub_in_thread(stub: StubServer, host: str = "127.0.0.1", port: int = 0) -> Iterator[RunningStub]:
    """Serve ``stub`` from an event loop in a daemon thread of this process; stop it on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="stub-server", daemon=True)
    thread.start()
    runner, bound = asyncio.run_coroutine_threadsafe(_start(stub, host, port), loop).result(30)
    try:
        yield RunningStub(url=f"http://{host}:{bound}", stub=stub)
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring); returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m eagle_assets_tests.servers.stub_server",
                                description="Model-free SGLang-shaped /generate server for client benchmarks.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port (printed in the ready line)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="fixed wait before each reply")
    p.add_argument("--output-tokens", type=int, default=None, help="fixed reply length (finish by length)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--think-end-id", type=int, default=None, help="close a reasoning block in each stopped reply")
    p.add_argument("--truncate-share", type=float, default=0.0,
                   help="share of requests (by rid hash) cut at max_new_tokens with finish_reason length")
    p.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process dies")
    p.add_argument("--shape", default=None, metavar="THINK_START,THINK_END,STOP[,MEDIAN,SIGMA,CAP_SHARE]",
                   help="long-tailed reasoning replies (ReplyShape), e.g. Qwen3: 151667,151668,151645")
    args = p.parse_args(argv)
    shape = None
    if args.shape:
        parts = args.shape.split(",")
        shape = ReplyShape(*map(int, parts[:3]), *map(float, parts[3:6]))
    stub = StubServer(vocab_size=args.vocab_size, latency_s=args.latency_ms / 1000.0,
                      output_tokens=args.output_tokens, think_end_id=args.think_end_id,
                      truncate_share=args.truncate_share, shape=shape)

    async def serve() -> None:
        runner, port = await _start(stub, args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if args.exit_with_parent:
            parent = os.getppid()

            async def watch_parent() -> None:
                while os.getppid() == parent:
                    await asyncio.sleep(1.0)
                stop.set()

            watcher = asyncio.ensure_future(watch_parent())
        print(f"{READY_PREFIX} http://{args.host}:{port}", flush=True)
        await stop.wait()
        if args.exit_with_parent:
            watcher.cancel()
        await runner.cleanup()

    try:
        import uvloop  # a faster loop keeps the stub's own overhead out of client measurements
    except ImportError:
        asyncio.run(serve())
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
