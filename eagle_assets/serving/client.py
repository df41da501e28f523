"""Asynchronous client for SGLang's native ``/generate``: bounded concurrency, retries, several servers.

Protocol: see ``eagle_assets.serving.protocol`` (request built from ``GenerateReqInput`` fields, replies validated
by ``parse_generate_reply``). Transport choices and why:

- One ``aiohttp.ClientSession`` per ``generate_many`` call with a keep-alive pool sized to the concurrency, and a
  fixed set of worker coroutines pulling from the items iterator: no task per item, natural back-pressure on a lazy
  iterator, no reconnect per request.
- The request body is assembled from pre-encoded bytes (the sampling params are encoded once) and the reply is
  parsed once, in ``parse_generate_reply``.
- Retried (exponential backoff with jitter, ``Retry-After`` honoured): connection errors, timeouts, HTTP 408/429/5xx,
  and replies that fail validation (bad or truncated JSON, ``completion_tokens`` disagreeing with ``output_ids``,
  a prompt echo in ``output_ids`` whether counted or not (with the caller's ``well_formed`` check, also one that only
  the reply's shape betrays), ``finish_reason`` abort, ...). Not retried: HTTP 400/422 (the request is invalid),
  401/403 (API key), 404 (wrong URL), aborts carrying a 4xx status. A retry prefers another server when there are
  several.
- ``post_many`` / ``post_all`` send prepared bodies of other ``/generate`` requests (aux-hidden-state capture for
  served drafter features) through the same loop: the caller's ``parse`` raises ``ReplyError`` for an unusable reply.
- Server choice: least requests in flight, servers that just failed are avoided for a short cool-down, ties go round
  robin. A single ``sglang-router`` URL works the same way.
- Every reply body is read up to a size cap (``max_reply_bytes``; for ``/generate`` derived from the request's
  ``max_new_tokens`` by :func:`generate_reply_cap`): a ``Content-Length`` over it is refused without reading the
  body, any other body is read in chunks and dropped as soon as it passes the cap (its connection is closed, not
  reused), so one misbehaving server or proxy costs at most the cap per request in flight (a 300 MB reply once took
  a run to 3.4 GB of RSS). Such an attempt fails with kind ``reply_too_large`` and is NOT retried: the cap is far
  above any genuine reply (see :func:`generate_reply_cap`), so an oversized one is a server or proxy fault that the
  same request will meet again, and each retry would pull another cap's worth of bytes; a rerun of the partition
  resends the failed ids. The message names the limit, the bytes seen and the fix (``server.max_reply_bytes``).
- The API key is read from the environment variable named by ``api_key_env`` and sent as
  ``Authorization: Bearer``; it never appears in errors, logs or ``repr``: error texts are redacted, since they
  quote server replies and a misbehaving proxy may echo the request's headers back. A quoted body is redacted
  before it is cut to an excerpt, and a key prefix left just before a cut another layer made (``CUT_MARK``, e.g.
  ``parse_generate_reply`` quoting an error object) or at the end of a text is removed as well (``redact``).
- ``run_sync`` (used by ``generate_all`` and ``eagle_assets.generations.run.run_generation``) runs the loop on uvloop
  when it is installed. Measured with ``bench/bench_client.py`` (1,000-token replies, one process): about 2,500
  validated requests/s on a free core, 2-4x a thread pool of blocking clients.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Callable, Collection, Iterable, Sequence

import aiohttp
import orjson

from eagle_assets.figures.running import DurationSketch
from eagle_assets.serving.protocol import (
    CUT_MARK,
    GenerateFailure,
    GenerateReply,
    GenerateRequest,
    ReplyError,
    SamplingParams,
    WellFormed,
    clip_text,
    parse_generate_reply,
)

Result = GenerateReply | GenerateFailure
_USERINFO = re.compile(r"//[^/@\s]+@")
_INT_ONLY = {int}
OnResult = Callable[[str, Result], Any]

# The size cap of a /generate reply (generate_reply_cap). A reply is {"text", "output_ids", "meta_info"}; per token
# it carries one id in output_ids (at most 7 bytes with its comma for a 151k vocab) and that token's text, JSON-
# escaped. Measured: the embedded server's replies of 256-1,024 tokens are 9.1-9.7 bytes per token (demo target,
# meta_info 155-164 bytes); the longest decoded token of the Qwen3 (151,669 ids) and DeepSeek-V3 (128,815) vocabs is
# 128 bytes of JSON text (a run of spaces or dots), and \u-escaping (json.dumps' ensure_ascii) at most triples a
# token's UTF-8 bytes. 512 bytes per token covers a reply made only of the longest tokens, escaped, with room to
# spare (about 50x the measured mean); the 1 MiB base covers meta_info (SGLang adds fields over versions, an abort
# message, a proxy's own fields) and pretty-printed JSON. A 32k-token request gets 17 MiB.
REPLY_BASE_BYTES = 1 << 20
REPLY_BYTES_PER_TOKEN = 512
# post_many without a cap from its caller or the client: the largest /generate reply of 128k tokens by the rule above.
# Callers whose replies are larger by design (hidden states) pass their own.
POST_DEFAULT_MAX_REPLY_BYTES = 64 << 20
# GET /health, /get_model_info, /server_info: a few kB from SGLang (its server args included).
INFO_MAX_REPLY_BYTES = 4 << 20
# How many characters of a body an error message quotes.
EXCERPT_CHARS = 300
# Where an explicit cap comes from, for the reply_too_large message.
_CATALOG_CAP = ("server.max_reply_bytes in the catalog (GenerateClient(max_reply_bytes=...)); raise it if such replies "
                "are genuine")
# The shortest key prefix removed before a cut: shorter ones say nothing about the key and would blank ordinary
# words that end a text.
MIN_KEY_PREFIX = 4


def generate_reply_cap(max_new_tokens: int) -> int:
    """The default size cap, in bytes, of the reply to a ``/generate`` request asking for ``max_new_tokens``
    tokens: ``REPLY_BASE_BYTES + REPLY_BYTES_PER_TOKEN * max_new_tokens`` (1 MiB + 512 B per token; the reasoning
    and the measurements are at those constants). Raises ValueError for ``max_new_tokens`` < 1."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return REPLY_BASE_BYTES + REPLY_BYTES_PER_TOKEN * int(max_new_tokens)


def _check_cap(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (bytes) or None, got {value!r}")
    return int(value)


class _Oversized:
    """A body over its cap: ``size`` bytes announced by ``Content-Length`` (``announced``) or read so far."""

    __slots__ = ("size", "announced", "cap")

    def __init__(self, size: int, announced: bool, cap: int):
        self.size, self.announced, self.cap = size, announced, cap

    def describe(self) -> str:
        if self.announced:
            return (f"Content-Length {self.size:,} bytes is over the {self.cap:,}-byte limit on one reply; the body "
                    "was not read")
        return (f"the body passed the {self.cap:,}-byte limit on one reply ({self.size:,} bytes read when reading "
                "stopped)")


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes | _Oversized:
    """The body of ``resp`` if it has at most ``cap`` bytes (after aiohttp's decompression), else ``_Oversized``.

    A ``Content-Length`` over ``cap`` is refused before any byte of the body is read; otherwise chunks are read as
    they arrive and reading stops at the first one that passes ``cap``, so at most ``cap`` plus one chunk (aiohttp
    reads 64 KiB at a time and decompresses in bounded steps) is held. An oversized response's connection is
    closed, never returned to the pool: the rest of its body is still in flight on it.
    """
    announced = resp.content_length
    if announced is not None and announced > cap:
        resp.close()
        return _Oversized(announced, True, cap)
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > cap:
            resp.close()
            return _Oversized(size, False, cap)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


@dataclass
class ClientStats:
    """What one ``generate_many`` call did.

    Attributes:
        requests: items taken from the iterator.
        succeeded / failed: results delivered as ``GenerateReply`` / ``GenerateFailure``.
        attempts: HTTP requests sent; retries = attempts beyond the first of each item.
        attempt_errors: kind -> count over every failed attempt (retried or not).
        failure_kinds: kind -> count over final failures.
        latencies_s: client-side seconds per succeeded request (first attempt to validated reply, retries included).
        wall_s: seconds the whole call took.
    """

    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    attempts: int = 0
    retries: int = 0
    attempt_errors: Counter = field(default_factory=Counter)
    failure_kinds: Counter = field(default_factory=Counter)
    latencies_s: DurationSketch = field(default_factory=DurationSketch)  # bounded: no list per row
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Flat dict: counts, requests/s, latency p50/p99 in ms."""
        lat = self.latencies_s  # quantiles within 0.5% (figures.running.DurationSketch)

        def q(p: float) -> float:
            return round(1000.0 * lat.at(min(len(lat) - 1, int(p * (len(lat) - 1) + 0.5))), 2) if len(lat) else 0.0

        return {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "attempts": self.attempts,
            "retries": self.retries,
            "attempt_errors": dict(self.attempt_errors),
            "failure_kinds": dict(self.failure_kinds),
            "requests_per_s": round((self.succeeded + self.failed) / self.wall_s, 2) if self.wall_s > 0 else 0.0,
            "latency_p50_ms": q(0.5),
            "latency_p99_ms": q(0.99),
            "wall_s": round(self.wall_s, 3),
        }


class _Server:
    __slots__ = ("url", "generate_url", "in_flight", "failures", "avoid_until")

    def __init__(self, url: str):
        self.url = url
        self.generate_url = url + "/generate"
        self.in_flight = 0
        self.failures = 0
        self.avoid_until = 0.0


class _Attempt:
    """Outcome of one failed HTTP attempt."""

    __slots__ = ("kind", "message", "retryable", "retry_after", "server_fault")

    def __init__(self, kind: str, message: str, retryable: bool, retry_after: float | None = None,
                 server_fault: bool = False):
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.retry_after = retry_after
        self.server_fault = server_fault


class ServerUnavailable(RuntimeError):
    """A server did not answer ``/health`` and ``/get_model_info`` (``GenerateClient.probe``)."""

    def __init__(self, url: str, error: str):
        self.url, self.error = url, error
        super().__init__(f"server {url} is not serving: {error}. Nothing was sent and no stored row was touched; "
                         "start the server (or fix server.url in the catalog) and run the partition again")


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port`` (no trailing slash, no ``/generate``)."""
    url = url.strip().rstrip("/")
    if url.endswith("/generate"):
        url = url[: -len("/generate")]
    if "://" not in url:
        url = "http://" + url
    return url


def _retry_after(resp_headers: Any) -> float | None:
    value = resp_headers.get("Retry-After") if resp_headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class GenerateClient:
    """Client for one or more SGLang ``/generate`` servers (or one ``sglang-router``).

    Args:
        urls: base URL(s), e.g. ``http://127.0.0.1:30000`` (a trailing ``/generate`` is accepted).
        concurrency_per_server: requests in flight per URL; the connection pool has the same size.
        timeout_s: total seconds for one HTTP attempt (a long generation must fit).
        max_attempts: HTTP attempts per item, first included (>= 1).
        backoff_base_s: first retry waits about this long; each further retry doubles it (with jitter), up to
            ``backoff_max_s``.
        backoff_max_s: cap on one backoff wait.
        api_key_env: name of the environment variable holding the API key; None = no key.
        cooldown_s: how long a server that just failed (connection error, timeout, 5xx, oversized reply) is
            avoided when another server is available.
        max_reply_bytes: cap, in bytes, on one reply body (``/generate`` and ``post_many`` replies); None = derived
            per request: ``generate_reply_cap(max_new_tokens)`` for generation, the caller's cap (or
            ``POST_DEFAULT_MAX_REPLY_BYTES``) for ``post_many``. A larger reply is one ``reply_too_large`` failure
            (module docstring). The catalog's ``server.max_reply_bytes``.
    Raises:
        ValueError: no URL, bad numbers (``max_reply_bytes`` must be an int >= 1 or None), or ``api_key_env``
            names a variable that is unset or empty.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        concurrency_per_server: int = 32,
        timeout_s: float = 600.0,
        max_attempts: int = 5,
        backoff_base_s: float = 0.5,
        api_key_env: str | None = None,
        *,
        backoff_max_s: float = 30.0,
        cooldown_s: float = 2.0,
        max_reply_bytes: int | None = None,
    ):
        if isinstance(urls, str):
            urls = [urls]
        self.urls = [normalize_url(u) for u in urls]
        if not self.urls:
            raise ValueError("GenerateClient needs at least one server URL")
        if concurrency_per_server < 1 or max_attempts < 1 or timeout_s <= 0:
            raise ValueError(
                f"concurrency_per_server ({concurrency_per_server}) and max_attempts ({max_attempts}) must be >= 1 "
                f"and timeout_s ({timeout_s}) > 0"
            )
        self.concurrency_per_server = int(concurrency_per_server)
        self.timeout_s = float(timeout_s)
        self.max_attempts = int(max_attempts)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.cooldown_s = float(cooldown_s)
        self.max_reply_bytes = _check_cap("max_reply_bytes", max_reply_bytes)
        self.api_key_env = api_key_env
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        self._secrets: tuple[str, ...] = ()
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(
                    f"api_key_env={api_key_env!r} but that environment variable is unset or empty; export the "
                    "server's API key in it, or set api_key_env to None for a server without --api-key"
                )
            self._headers["Authorization"] = f"Bearer {key}"
            self._secrets = (key,)
        self._rr = 0
        self.last_stats: ClientStats | None = None

    def __repr__(self) -> str:
        return (
            f"GenerateClient(urls={self.urls}, concurrency_per_server={self.concurrency_per_server}, "
            f"timeout_s={self.timeout_s}, max_attempts={self.max_attempts}, api_key_env={self.api_key_env!r}, "
            f"max_reply_bytes={self.max_reply_bytes})"
        )

    # ------------------------------------------------------------------------------------------------ session
    def _session(self, connections: int) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=connections, limit_per_host=self.concurrency_per_server,
                                         ttl_dns_cache=300, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(self.timeout_s, 30.0))
        # default headers on the session: aiohttp then skips merging per-request headers on every call
        return aiohttp.ClientSession(connector=connector, timeout=timeout, raise_for_status=False,
                                     headers=self._headers)

    async def get_json(self, path: str, url: str | None = None) -> Any:
        """GET ``path`` (e.g. ``/get_model_info``) from ``url`` (default the first) and return the parsed JSON.

        Raises aiohttp.ClientResponseError for a non-200 status, ValueError for a body over
        ``INFO_MAX_REPLY_BYTES`` or not JSON, aiohttp.ClientError / TimeoutError otherwise.
        """
        base = normalize_url(url) if url else self.urls[0]
        async with self._session(1) as session:
            async with session.get(base + path) as resp:
                resp.raise_for_status()
                raw = await _read_capped(resp, INFO_MAX_REPLY_BYTES)
        if isinstance(raw, _Oversized):
            raise ValueError(f"GET {path}: {raw.describe()}")
        return json.loads(raw)

    async def probe(self, attempts: int = 3, timeout_s: float = 10.0) -> dict[str, dict]:
        """Ask every server ``GET /health`` then ``GET /get_model_info`` before any request is sent.

        A partition's run calls this first, so a wrong or dead URL fails the run at once, with the URL and the error,
        instead of after every prompt has used up its retries. SGLang answers ``/health`` 503 until its warm-up
        request has run, so each URL gets ``attempts`` tries, 1 s apart.

        Returns: URL -> the ``/get_model_info`` body (SGLang: ``model_path``, ``tokenizer_path``, ...).
        Raises:
            ServerUnavailable: a URL did not answer both with 200 (the message names the URL, redacted, and the
                error: refused connection, timeout, HTTP status and body).
        """
        infos: dict[str, dict] = {}
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers) as session:
            for url in self.urls:
                error = ""
                for attempt in range(max(1, attempts)):
                    if attempt:
                        await asyncio.sleep(1.0)
                    try:
                        for path in ("/health", "/get_model_info"):
                            async with session.get(url + path) as resp:
                                raw = await _read_capped(resp, INFO_MAX_REPLY_BYTES)
                                if isinstance(raw, _Oversized):
                                    raise ValueError(f"GET {path} answered HTTP {resp.status}: {raw.describe()}")
                                if resp.status != 200:
                                    raise ValueError(f"GET {path} answered HTTP {resp.status}: {self._excerpt(raw)}")
                        infos[url] = json.loads(raw) if raw.strip() else {}
                        break
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                else:
                    raise ServerUnavailable(self.redact(url), self.redact(error))
        return infos

    # ------------------------------------------------------------------------------------------------- public
    async def generate_many(
        self,
        items: Iterable[tuple],
        sampling: SamplingParams,
        vocab_size: int | None = None,
        on_result: OnResult | None = None,
        control_ids: Collection[int] | None = None,
        well_formed: WellFormed | None = None,
    ) -> ClientStats:
        """Generate every item; call ``on_result(rid, GenerateReply | GenerateFailure)`` as each one finishes.

        Args:
            items: ``(rid, input_ids)`` or ``(rid, input_ids, SamplingParams)`` tuples; consumed lazily. ``rid`` is
                sent as SGLang's ``rid`` and must be a string; ``input_ids`` a non-empty sequence of ints.
            sampling: default sampling params (``max_new_tokens`` is required by ``SamplingParams``).
            vocab_size: target vocab size for validating ids (input and output); None skips the range check.
            on_result: sync or async callable; results arrive in completion order, not input order. An exception it
                raises cancels the remaining work and propagates.
            control_ids: the target's special and added token ids (``target_model.render.control_token_ids``);
                with them a prompt echo is found even when the server counts it in ``completion_tokens``
                (``protocol.prompt_echo_length``); None = unknown (then 3 or more ids repeating the prompt's end
                are the evidence). An echo is retried like every invalid reply, then recorded as a ``prompt_echo``
                failure.
            well_formed: the target family's structure check (``protocol.WellFormed``: ``(prompt_ids, output_ids,
                finish_type, rid) -> bool``, e.g. ``structure.segment.StructureCheck``, built by the generation
                stage): a reply whose first ids repeat the prompt's last ids and that is well-formed only without
                them is a ``prompt_echo`` too, even when the counts agree and the ids are ordinary (retried, then
                a failure); a reply well-formed as it stands is kept. None = that evidence is off.
        Returns:
            ``ClientStats`` (also kept as ``self.last_stats``).
        Invalid items (empty ids, non-int or out-of-vocab ids) become ``GenerateFailure(kind="bad_input",
        attempts=0)`` without a request.
        """
        stats = ClientStats()
        self.last_stats = stats
        started = time.monotonic()
        servers = [_Server(u) for u in self.urls]
        workers = self.concurrency_per_server * len(servers)
        default_bytes = orjson.dumps(sampling.to_json())

        def sampling_bytes(sp: SamplingParams) -> bytes:
            # the shared params are encoded once; an item's own (a per-row seed) each time, so nothing accumulates
            return default_bytes if sp is sampling else orjson.dumps(sp.to_json())

        control = None if control_ids is None else frozenset(control_ids)
        iterator = iter(items)

        async def worker(session: aiohttp.ClientSession) -> None:
            while True:
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                stats.requests += 1
                if not isinstance(item, (tuple, list)) or len(item) < 2 or (
                    len(item) > 2 and item[2] is not None and not isinstance(item[2], SamplingParams)
                ):
                    rid = _item_rid(item)
                    result: Result = GenerateFailure(
                        rid=rid, kind="bad_input", attempts=0,
                        last_error=f"an item must be (rid, input_ids) or (rid, input_ids, SamplingParams), got "
                                   f"{repr(item)[:200]}",
                    )
                else:
                    rid, ids = str(item[0]), item[1]
                    sp = item[2] if len(item) > 2 and item[2] is not None else sampling
                    result = await self._generate_one(session, servers, rid, ids, sp, sampling_bytes(sp),
                                                      vocab_size, stats, control, well_formed)
                if isinstance(result, GenerateReply):
                    stats.succeeded += 1
                    stats.latencies_s.append(result.latency_s)
                else:
                    stats.failed += 1
                    stats.failure_kinds[result.kind] += 1
                if on_result is not None:
                    out = on_result(rid, result)
                    if inspect.isawaitable(out):
                        await out

        await self._run_workers(workers, worker, stats, started)
        return stats

    async def _run_workers(self, workers: int, worker: Callable, stats: Any, started: float) -> None:
        """Run ``workers`` copies of ``worker(session)`` on one session; on any error cancel the rest and re-raise.
        ``stats.wall_s`` is set however it ends."""
        try:
            async with self._session(workers) as session:
                tasks = [asyncio.ensure_future(worker(session)) for _ in range(workers)]
                try:
                    await asyncio.gather(*tasks)
                except BaseException:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
        finally:
            stats.wall_s = time.monotonic() - started

    def generate_all(
        self, items: Iterable[tuple], sampling: SamplingParams, vocab_size: int | None = None,
        control_ids: Collection[int] | None = None, well_formed: WellFormed | None = None,
    ) -> list[Result]:
        """Synchronous ``generate_many``: returns one result per item, in input order.

        Runs its own event loop (in a helper thread when called from inside a running loop).
        Raises ValueError for duplicate rids.
        """
        items = list(items)
        position: dict[str, int] = {}
        for i, item in enumerate(items):
            rid = _item_rid(item)
            if rid in position:
                raise ValueError(f"duplicate rid {rid!r} at items {position[rid]} and {i}; rids must be unique")
            position[rid] = i
        results: list[Result | None] = [None] * len(items)

        def on_result(rid: str, result: Result) -> None:
            results[position[rid]] = result

        run_sync(self.generate_many(items, sampling, vocab_size, on_result, control_ids, well_formed))
        return results  # type: ignore[return-value]

    async def post_many(self, items: Iterable[tuple[str, bytes]], parse: Callable[[str, bytes], Any],
                        on_result: Callable[[str, Any], Any], max_reply_bytes: int | None = None) -> ClientStats:
        """POST prepared ``/generate`` bodies with this client's servers, retries and backoff (the module
        docstring's rules), for requests other than plain generation (e.g. aux-hidden-state capture:
        ``eagle_assets.drafter.features.served_client``).

        Args:
            items: ``(rid, body)`` pairs, ``body`` the JSON request as bytes; consumed lazily.
            parse: ``parse(rid, raw)`` turns a 200 reply into a value; it raises ``ReplyError`` for an unusable
                reply (retried when ``retryable``, then delivered as a ``GenerateFailure`` of that kind). Any other
                exception cancels the remaining work and propagates.
            on_result: ``on_result(rid, value | GenerateFailure)`` in completion order (sync or async).
            max_reply_bytes: cap, in bytes, on each reply body, derived by the caller from what it asks for (e.g.
                ``ServedFeatureSource.reply_cap``); None = the client's ``max_reply_bytes``, else
                ``POST_DEFAULT_MAX_REPLY_BYTES``. A larger reply is a ``GenerateFailure`` of kind
                ``reply_too_large`` (not retried).
        Returns:
            ``ClientStats`` (also ``self.last_stats``).
        Raises:
            ValueError: ``max_reply_bytes`` not an int >= 1 or None.
        """
        cap = _check_cap("max_reply_bytes", max_reply_bytes)
        if cap is not None:
            cap_source = "the caller's, derived from what the request asks for (post_many(max_reply_bytes=...))"
        elif self.max_reply_bytes is not None:
            cap, cap_source = self.max_reply_bytes, _CATALOG_CAP
        else:
            cap = POST_DEFAULT_MAX_REPLY_BYTES
            cap_source = "post_many's default; pass post_many(max_reply_bytes=...) for replies larger by design"
        stats = ClientStats()
        self.last_stats = stats
        started = time.monotonic()
        servers = [_Server(u) for u in self.urls]
        workers = self.concurrency_per_server * len(servers)
        iterator = iter(items)

        async def worker(session: aiohttp.ClientSession) -> None:
            while True:
                try:
                    rid, body = next(iterator)
                except StopIteration:
                    return
                stats.requests += 1
                t0 = time.monotonic()
                sent = await self._send(session, servers, str(rid), body, lambda raw, r=str(rid): parse(r, raw),
                                        stats, cap, cap_source)
                if isinstance(sent, GenerateFailure):
                    stats.failed += 1
                    stats.failure_kinds[sent.kind] += 1
                    value = sent
                else:
                    stats.succeeded += 1
                    stats.latencies_s.append(time.monotonic() - t0)
                    value = sent[0]
                out = on_result(str(rid), value)
                if inspect.isawaitable(out):
                    await out

        await self._run_workers(workers, worker, stats, started)
        return stats

    def post_all(self, items: Sequence[tuple[str, bytes]], parse: Callable[[str, bytes], Any],
                 max_reply_bytes: int | None = None) -> list[Any]:
        """Synchronous :meth:`post_many` (``max_reply_bytes`` as there): one parsed value or ``GenerateFailure``
        per item, in input order (rids must be unique)."""
        position = {str(rid): i for i, (rid, _body) in enumerate(items)}
        if len(position) != len(items):
            raise ValueError("post_all needs unique rids")
        results: list[Any] = [None] * len(items)

        def on_result(rid: str, value: Any) -> None:
            results[position[rid]] = value

        run_sync(self.post_many(items, parse, on_result, max_reply_bytes))
        return results

    # ------------------------------------------------------------------------------------------------ internals
    def _pick(self, servers: list[_Server], avoid: _Server | None) -> _Server:
        if len(servers) == 1:
            return servers[0]
        now = time.monotonic()
        candidates = [s for s in servers if s is not avoid and s.avoid_until <= now]
        if not candidates:
            candidates = [s for s in servers if s is not avoid] or servers
            least_penalty = min(s.avoid_until for s in candidates)
            candidates = [s for s in candidates if s.avoid_until == least_penalty]
        fewest = min(s.in_flight for s in candidates)
        tied = [s for s in candidates if s.in_flight == fewest]
        self._rr += 1
        return tied[self._rr % len(tied)]

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2 ** (attempt - 1)))
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter spreads retries of a burst of failures
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.backoff_max_s))
        return delay

    @staticmethod
    def _check_input(ids: Any, vocab_size: int | None) -> tuple[list[int] | None, str]:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            return None, f"input_ids must be a sequence of ints, got {type(ids).__name__}"
        if len(ids) == 0:
            return None, "input_ids is empty"
        # set(map(type, ...)) runs in C: this check stays cheap at thousands of requests per second
        if type(ids) is not list or not set(map(type, ids)) <= _INT_ONLY:
            if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
                bad = next(t for t in ids if not isinstance(t, Integral) or isinstance(t, bool))
                return None, f"input_ids must hold ints, found {bad!r}"
            ids = [int(t) for t in ids]
        if vocab_size is not None:
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                return None, f"input id {bad} is outside the target vocab [0, {vocab_size})"
        return ids, ""

    async def _generate_one(
        self,
        session: aiohttp.ClientSession,
        servers: list[_Server],
        rid: str,
        ids: Any,
        sp: SamplingParams,
        sp_bytes: bytes,
        vocab_size: int | None,
        stats: ClientStats,
        control_ids: frozenset[int] | None = None,
        well_formed: WellFormed | None = None,
    ) -> Result:
        started = time.monotonic()
        ids, problem = self._check_input(ids, vocab_size)
        if ids is None:
            return GenerateFailure(rid=rid, kind="bad_input", attempts=0, last_error=problem)
        body = GenerateRequest(input_ids=ids, sampling_params=sp, rid=rid).to_bytes(sp_bytes)

        def parse(raw: bytes) -> GenerateReply:
            return parse_generate_reply(raw, ids, vocab_size, max_new_tokens=sp.max_new_tokens, rid=rid,
                                        control_ids=control_ids, well_formed=well_formed)

        cap, cap_source = self._generate_cap(sp.max_new_tokens)
        sent = await self._send(session, servers, rid, body, parse, stats, cap, cap_source)
        if isinstance(sent, GenerateFailure):
            return sent
        reply, attempt, server = sent
        reply.attempts = attempt
        reply.latency_s = time.monotonic() - started
        reply.server_url = server.url
        return reply

    async def _send(self, session: aiohttp.ClientSession, servers: list[_Server], rid: str, body: bytes,
                    parse: Callable[[bytes], Any], stats: ClientStats, max_bytes: int,
                    cap_source: str) -> tuple[Any, int, _Server] | GenerateFailure:
        """POST ``body`` to ``/generate`` until ``parse`` accepts a 200 reply: ``(parsed, attempts, server)``, or
        the :class:`GenerateFailure` of the last attempt (the retry rules of the module docstring; ``parse`` raises
        ``ReplyError`` for an unusable reply, retried when ``retryable``). Every body, whatever its status, is read
        up to ``max_bytes`` (``_read_capped``); a larger one ends the attempts as ``reply_too_large``, its message
        naming ``cap_source`` (where the cap comes from and how to raise it)."""
        errors: list[str] = []
        last: _Attempt | None = None
        server: _Server | None = None
        attempt = 0
        while attempt < self.max_attempts:
            attempt += 1
            stats.attempts += 1
            if attempt > 1:
                stats.retries += 1
            server = self._pick(servers, server if last is not None and last.server_fault else None)
            server.in_flight += 1
            try:
                async with session.post(server.generate_url, data=body) as resp:
                    status = resp.status
                    headers = resp.headers
                    raw = await _read_capped(resp, max_bytes)
            except asyncio.TimeoutError:
                last = _Attempt("timeout", f"no complete reply from {server.url} within {self.timeout_s:g}s "
                                           "(raise server.timeout_s for long generations)", True, server_fault=True)
            except aiohttp.ClientError as exc:
                last = _Attempt("connection", f"{server.url}: {type(exc).__name__}: {exc}", True, server_fault=True)
            else:
                if isinstance(raw, _Oversized):
                    last = self._too_large(server, status, raw, cap_source)
                elif status == 200:
                    try:
                        parsed = parse(raw)
                    except ReplyError as exc:
                        last = _Attempt(exc.kind, f"{server.url}: {exc.detail}", exc.retryable,
                                        server_fault=exc.kind == "abort")
                    else:
                        server.failures = 0
                        return parsed, attempt, server
                else:
                    last = self._http_failure(server, status, raw, headers)
            finally:
                server.in_flight -= 1
            errors.append(last.kind)
            stats.attempt_errors[last.kind] += 1
            if last.server_fault:
                server.failures += 1
                server.avoid_until = time.monotonic() + min(self.cooldown_s * server.failures, 30.0)
            if not last.retryable or attempt >= self.max_attempts:
                break
            await asyncio.sleep(self._backoff(attempt, last.retry_after))
        assert last is not None
        return GenerateFailure(rid=rid, kind=last.kind, attempts=attempt, last_error=self.redact(last.message),
                               errors=tuple(errors))

    def redact(self, text: str) -> str:
        """``text`` with the API key and any ``user:password@`` of a URL replaced by ``***``.

        Error texts quote server replies, and a misbehaving server or proxy may echo the request's headers. A
        quote may have been cut inside the key by a layer that does not know it (``parse_generate_reply``
        quoting an error object, ``clip_text``): a prefix of the key of ``MIN_KEY_PREFIX`` characters or more
        that ends right before a ``CUT_MARK`` or at the end of ``text`` is replaced too.
        """
        for secret in self._secrets:
            text = _redact_cut_prefixes(text.replace(secret, "***"), secret)
        return _USERINFO.sub("//***@", text)

    def _excerpt(self, raw: bytes, limit: int = EXCERPT_CHARS) -> str:
        """The first ``limit`` characters of a body, redacted BEFORE the cut (a key straddling the cut would
        otherwise leave its prefix), then ``CUT_MARK`` when something was cut."""
        # a character is at most 4 UTF-8 bytes, so the first `limit` characters lie in 4 * limit bytes; a key
        # starting among them ends within its own length more: every such key is whole in the window
        window = raw[: 4 * limit + max((len(k.encode()) for k in self._secrets), default=0)]
        text = self.redact(window.decode("utf-8", "replace"))
        if len(raw) > len(window) and len(text) <= limit:
            return text + CUT_MARK
        return clip_text(text, limit)

    def _too_large(self, server: _Server, status: int, big: _Oversized, cap_source: str) -> _Attempt:
        where = server.generate_url + ("" if status == 200 else f" (HTTP {status})")
        # not retried: the cap is far above a genuine reply, the same request would meet the same server fault,
        # and each retry would pull another cap's worth of bytes
        return _Attempt("reply_too_large", f"{where}: {big.describe()} (the connection was closed). The limit is "
                                           f"{cap_source}; a server or proxy that sends more is misbehaving",
                        False, server_fault=True)

    def _generate_cap(self, max_new_tokens: int) -> tuple[int, str]:
        """The cap on a ``/generate`` reply and where it comes from (for the ``reply_too_large`` message)."""
        if self.max_reply_bytes is not None:
            return self.max_reply_bytes, _CATALOG_CAP
        return generate_reply_cap(max_new_tokens), (
            f"derived from max_new_tokens={max_new_tokens} ({REPLY_BASE_BYTES:,} + {REPLY_BYTES_PER_TOKEN} bytes per "
            "token, generate_reply_cap); if such replies are genuine, set server.max_reply_bytes in the catalog "
            "above it")

    def _http_failure(self, server: _Server, status: int, raw: bytes, headers: Any) -> _Attempt:
        excerpt = self._excerpt(raw)
        where = f"{server.generate_url} answered HTTP {status}"
        if status in (400, 422):
            return _Attempt("bad_request", f"{where}: {excerpt} (the server refuses this request as sent)", False)
        if status in (401, 403):
            hint = (f"check the key in ${self.api_key_env}" if self.api_key_env
                    else "the server requires an API key: set api_key_env")
            return _Attempt("unauthorized", f"{where}: {hint}", False)
        if status == 404:
            return _Attempt("not_found", f"{where}: no /generate there; the URL must be an SGLang server or router "
                                         "base URL", False)
        if status == 429:
            return _Attempt("http_429", f"{where}: {excerpt}", True, _retry_after(headers))
        if status == 408:
            return _Attempt("timeout", f"{where}: {excerpt}", True, _retry_after(headers), server_fault=True)
        if status >= 500:
            return _Attempt("http_5xx", f"{where}: {excerpt}", True, _retry_after(headers), server_fault=True)
        return _Attempt(f"http_{status}", f"{where}: {excerpt}", False)


def _redact_cut_prefixes(text: str, secret: str) -> str:
    """``text`` with each prefix of ``secret`` (``MIN_KEY_PREFIX`` characters or more, the longest first) that
    ends right before a ``CUT_MARK`` or at the end of ``text`` replaced by ``***``."""
    if len(secret) <= MIN_KEY_PREFIX or secret[:MIN_KEY_PREFIX] not in text:
        return text  # the common case: no prefix anywhere, one scan
    ends = {len(text)}
    at = text.find(CUT_MARK)
    while at >= 0:
        ends.add(at)
        at = text.find(CUT_MARK, at + 1)
    for end in sorted(ends, reverse=True):  # from the back: earlier positions stay valid
        for n in range(min(len(secret) - 1, end), MIN_KEY_PREFIX - 1, -1):
            if text.startswith(secret[:n], end - n):
                text = text[: end - n] + "***" + text[end:]
                break
    return text


def _item_rid(item: Any) -> str:
    return str(item[0]) if isinstance(item, (tuple, list)) and item else repr(item)[:100]


def _new_event_loop() -> asyncio.AbstractEventLoop:
    # uvloop (installed with dagster-webserver's uvicorn[standard]) cuts the per-request event-loop and transport
    # cost of the client by about a tenth; EAGLE_ASSETS_NO_UVLOOP=1 falls back to the stdlib loop.
    if not os.environ.get("EAGLE_ASSETS_NO_UVLOOP"):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_sync(coro: Any) -> Any:
    """Run ``coro`` to completion on a fresh event loop (uvloop when installed) and return its result.

    From inside a running event loop the coroutine runs in a helper thread with its own loop (the caller blocks).
    Exceptions propagate to the caller.
    """
    def run() -> Any:
        with asyncio.Runner(loop_factory=_new_event_loop) as runner:
            return runner.run(coro)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    box: dict[str, Any] = {}

    def in_thread() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=in_thread, name="generate-all")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")
