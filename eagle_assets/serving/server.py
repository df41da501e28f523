"""A small server speaking SGLang's native HTTP protocol over any local transformers causal LM.

It lets the pipeline use one client code path everywhere: on a machine without a GPU the embedded default target is
served here; on a GPU host the same client talks to ``python -m sglang.launch_server``.

Endpoints (shapes from sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py``):

- ``POST /generate`` (also PUT): ``GenerateReqInput`` of ``python/sglang/srt/managers/io_struct.py``:
  ``{"input_ids": [..] | [[..], ..], "text": str | [str] (alternative), "sampling_params": {..} | [{..}],
  "rid": str | [str]}``. Reply: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency"}}``, or a list of them for a batch input. Like SGLang, a
  missing ``max_new_tokens`` means 128 (logged), an invalid request is HTTP 400 ``{"error": {"message": ..}}``, a
  prompt at or over the context length is refused, and ``max_new_tokens`` is capped to the context left.
  ``stream: true`` is refused (400). A failed forward or a shutdown answers HTTP 200 with an ``abort`` reason.
  ``max_new_tokens: 0`` is a prefill-only request (SGLang's ``Req.is_prefill_only``): ``output_ids`` [],
  ``finish_reason`` ``{"type": "length", "length": 0}``.
- Hidden states (SGLang 0.5.23, see :mod:`eagle_assets.serving.aux_capture` for the launch side): with
  ``--enable-return-aux-hidden-states`` (or ``--enable-return-hidden-states`` for the final-normed state) a request
  with ``return_hidden_states: true`` gets ``meta_info.hidden_states`` built as SGLang's scheduler builds it
  (``scheduler_components/batch_result_processor.py::_append_prefill_hidden_states`` /
  ``_append_decode_hidden_states``, then ``output_streamer.py`` slices it to ``[: finished_len]``): a list whose
  first element is the prompt block ``[T][W]`` and whose further elements are one ``[W]`` row per decode step (the
  fed token; the last sampled token is never fed), so ``max_new_tokens: N`` giving ``n`` tokens returns
  ``1 + (n - 1)`` entries. Consequences copied on purpose: ``max_new_tokens: 0`` returns ``[]`` (``finished_len``
  is 0), so features need ``max_new_tokens: 1``, which returns ``[[row_0, ..., row_{T-1}]]``; the final-layer
  state is not in it. ``return_hidden_states: "last"`` returns the latest row alone, ``[W]``. ``W`` is ``k * H``
  (capture layers in ascending capture id). Non-finite values are sent as ``null``, as SGLang's orjson does. A
  request asking for more than the server allows is HTTP 400 with SGLang's message.
- Logprobs (``tokenizer_manager.py::add_logprob_to_meta_info``, ``logprob_result_processor.py``): with
  ``return_logprob: true``, ``logprob_start_len`` (-1 = output tokens only) and ``top_logprobs_num``:
  ``meta_info.input_token_logprobs`` ``[[logprob | None, token_id, text | None], ..]`` for prompt tokens
  ``logprob_start_len ..`` (the first entry's logprob is None), ``output_token_logprobs`` (one per output token),
  ``output_token_logprobs_length``, and with ``top_logprobs_num > 0`` ``input_top_logprobs`` (entry ``i`` = the
  top-k of the distribution that predicts prompt token ``logprob_start_len + i``; entry 0 is None) and
  ``output_top_logprobs``. Logprobs are ``log_softmax`` of the raw logits (SGLang's value for greedy requests and
  for all input logprobs); ``return_text_in_logprobs`` fills the text slot. ``token_ids_logprob`` is refused. One
  known difference: a ``max_new_tokens: 0`` request gets no output logprobs here, where SGLang reports one for the
  dummy token id 0 it puts in place of sampling (``tp_worker.py``).
- ``GET /health``, ``GET /health_generate``: 200 with an empty body while the decode thread is alive, else 503.
- ``GET /get_model_info`` (alias ``/model_info``, the newer name): ``{"model_path", "tokenizer_path",
  "is_generation": true, "preferred_sampling_params", "weight_version"}`` as SGLang, plus ``vocab_size``,
  ``context_length``, ``eos_token_ids``, ``dtype``, ``max_batch_size``.
- ``GET /get_server_info`` (alias ``/server_info``): the model info plus ``engine`` (``EngineStats``: forward calls,
  prefill and decode batches, mean decode batch) and ``running``/``queued`` counts: the batching counters tests
  assert on. ``sglang-router`` reads these two endpoints when it registers a worker.
- ``GET|POST /flush_cache``: no-op 200 (there is no prefix cache), for tools that call it.

API key: with ``api_key`` set every path except ``/health*`` needs ``Authorization: Bearer <key>``, else HTTP 401
``{"error": "Unauthorized"}`` (SGLang's ``add_api_key_middleware``).

Parsing a body and building its reply: :mod:`eagle_assets.serving.generate_io`. Batching and determinism: see
``eagle_assets.serving.engine``. The model runs in the engine thread, so the event
loop keeps answering ``/health`` and accepting requests while a batch decodes.

CLI: ``python -m eagle_assets.serving.server --model-path DIR [--host 127.0.0.1] [--port 30000]
[--max-batch-size 64] [--api-key-env VAR] [--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states
[--return-aux-hidden-state-layer-ids I J K]] [--enable-return-hidden-states] [--return-hidden-states-mode
last|full]``; prints ``EAGLE_ASSETS_SERVER_READY http://HOST:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from aiohttp import web

from eagle_assets.serving.aux_capture import (
    CAPTURE_ALGORITHMS,
    AuxCaptureError,
    capture_convention,
    capture_ids_from_flag,
    num_layers_of,
)
from eagle_assets.serving.engine import DecodeEngine, EngineRequest, EngineResult, load_causal_lm, model_eos_ids
from eagle_assets.serving.generate_io import BadRequest, GenerateIO
from eagle_assets.serving.launch import READY_PREFIX
from eagle_assets.serving.protocol import SamplingParams

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        status=status, body=json.dumps({"error": {"message": message}}).encode(), content_type="application/json"
    )


def _deliver(fut: asyncio.Future, result: EngineResult) -> None:
    if not fut.done():
        fut.set_result(result)


class ModelServer:
    """Model, tokenizer and decode engine behind the HTTP endpoints.

    Args:
        model_path: local transformers model directory (or hub id).
        tokenizer_path: defaults to ``model_path``; when no tokenizer loads, ``text`` inputs are refused and replies
            carry ``"text": ""``.
        max_batch_size: most sequences decoded together.
        batch_wait_s: how long an idle engine waits after a first request for others to batch with it.
        dtype: ``auto`` | ``float64`` | ``float32`` | ``bfloat16`` | ``float16`` (see ``engine.resolve_dtype``).
        device: torch device.
        api_key: require ``Authorization: Bearer <api_key>`` (except on ``/health*``).
        context_length: prompt + completion limit; defaults to ``config.max_position_embeddings``.
        seed: seeds the per-request seeds of sampled requests without ``sampling_seed``.
        enable_return_aux_hidden_states / speculative_algorithm / return_aux_hidden_state_layer_ids: SGLang's
            capture-only mode (see :mod:`eagle_assets.serving.aux_capture`); ``speculative_algorithm`` only names
            the convention (EAGLE3; no draft runs).
        enable_return_hidden_states: allow ``return_hidden_states`` for the final-normed state (no aux capture).
        return_hidden_states_mode: the most a request may ask (``last`` | ``full``); default ``full`` when either
            flag is on, else hidden states are refused.
    Raises:
        ValueError / OSError when the model cannot be loaded; AuxCaptureError (a ValueError) for capture settings
        SGLang would refuse, with SGLang's message.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        dtype: str = "auto",
        device: str = "cpu",
        api_key: str | None = None,
        context_length: int | None = None,
        seed: int | None = None,
        enable_return_aux_hidden_states: bool = False,
        speculative_algorithm: str | None = None,
        return_aux_hidden_state_layer_ids: list[int] | None = None,
        enable_return_hidden_states: bool = False,
        return_hidden_states_mode: str | None = None,
    ):
        self._check_capture_args(enable_return_aux_hidden_states, speculative_algorithm,
                                 return_aux_hidden_state_layer_ids, return_hidden_states_mode)
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.model = load_causal_lm(self.model_path, dtype=dtype, device=device)
        self.tokenizer = self._load_tokenizer(self.tokenizer_path)
        config = self.model.config
        self.vocab_size = int(getattr(config, "vocab_size", None) or self.model.get_output_embeddings().weight.shape[0])
        self.context_length = context_length or getattr(config, "max_position_embeddings", None)
        self.eos_ids = model_eos_ids(self.model, self.tokenizer)
        self.api_key = api_key or None
        self.enable_return_aux_hidden_states = bool(enable_return_aux_hidden_states)
        self.return_aux_hidden_state_layer_ids = (
            [int(i) for i in return_aux_hidden_state_layer_ids] if return_aux_hidden_state_layer_ids is not None
            else None
        )
        self.capture_ids: list[int] = []
        self.capture_convention: str | None = None
        if self.enable_return_aux_hidden_states:
            self.capture_convention = capture_convention(config)
            self.capture_ids = capture_ids_from_flag(
                self.return_aux_hidden_state_layer_ids, num_layers_of(config), self.capture_convention
            )
        self.enable_return_hidden_states = bool(enable_return_hidden_states) or return_hidden_states_mode is not None
        if return_hidden_states_mode is None and (self.enable_return_hidden_states
                                                  or self.enable_return_aux_hidden_states):
            return_hidden_states_mode = "full"
        self.return_hidden_states_mode = return_hidden_states_mode
        source = "aux" if self.enable_return_aux_hidden_states else ("final" if return_hidden_states_mode else None)
        self.engine = DecodeEngine(
            self.model, self.eos_ids, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, seed=seed,
            hidden_states=source, capture_ids=self.capture_ids,
        )
        self.io = GenerateIO(self.tokenizer, self.vocab_size, self.context_length, self.return_hidden_states_mode,
                             lambda: self.engine.recording_error)

    @staticmethod
    def _check_capture_args(enabled: bool, algorithm: str | None, layer_ids: list[int] | None,
                            mode: str | None) -> None:
        """SGLang's ``handle_aux_hidden_state_capture`` / ``handle_return_hidden_states_mode`` checks."""
        if mode not in (None, "last", "full"):
            raise AuxCaptureError("return_hidden_states_mode must be one of: None, 'last', or 'full'.")
        if not enabled:
            if layer_ids is not None:
                raise AuxCaptureError(
                    "--return-aux-hidden-state-layer-ids requires --enable-return-aux-hidden-states."
                )
            if algorithm is not None:
                raise AuxCaptureError(
                    f"--speculative-algorithm {algorithm}: this server runs no speculative decoding; it takes the "
                    "flag only with --enable-return-aux-hidden-states, to name the capture convention"
                )
            return
        method = (algorithm or "").upper()
        if method not in CAPTURE_ALGORITHMS:
            raise AuxCaptureError(
                "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3, DFLASH or DSPARK to name "
                f"the capture convention, got {algorithm!r}."
            )
        if method != "EAGLE3":
            raise AuxCaptureError(f"this server implements the EAGLE3 capture convention only, not {method}")

    @staticmethod
    def _load_tokenizer(path: str) -> Any | None:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path))
        except Exception as exc:  # a model dir without tokenizer files can still serve input_ids
            log.warning("no tokenizer loaded from %s (%s); text inputs are refused, replies carry no text", path, exc)
            return None

    # ---------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread and run one tiny request so the first real batch does not pay warm-up."""
        self.engine.start()
        done = threading.Event()
        self.engine.submit(
            [EngineRequest("warmup", [0, 0], SamplingParams(max_new_tokens=2, temperature=0.0), lambda r: done.set())]
        )
        done.wait(300)

    def stop(self) -> None:
        """Stop the engine thread (pending requests get an ``abort`` reply)."""
        self.engine.stop()

    def model_info(self) -> dict[str, Any]:
        """Body of ``GET /get_model_info``."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "eos_token_ids": sorted(self.eos_ids),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "max_batch_size": self.engine.max_batch_size,
        }

    def capture_info(self) -> dict[str, Any]:
        """The hidden-state fields of ``/server_info``, under SGLang's resolved server-arg names (SGLang resets
        ``speculative_algorithm`` to None in capture mode and records the convention in
        ``aux_hidden_state_capture``), plus ``aux_capture_ids`` (ours: what the columns hold)."""
        return {
            "enable_return_aux_hidden_states": self.enable_return_aux_hidden_states,
            "return_aux_hidden_state_layer_ids": self.return_aux_hidden_state_layer_ids,
            "aux_hidden_state_capture": "eagle3" if self.enable_return_aux_hidden_states else None,
            "speculative_algorithm": None,
            "enable_return_hidden_states": self.enable_return_hidden_states,
            "return_hidden_states_mode": self.return_hidden_states_mode,
            "chunked_prefill_size": -1,  # prompts are never split here
            "disable_radix_cache": True,  # there is no prefix cache
            "aux_capture_ids": list(self.capture_ids),
            "aux_capture_convention": self.capture_convention,
        }

    # ------------------------------------------------------------------------------------------------ handlers
    async def _handle_generate(self, request: web.Request) -> web.Response:
        arrival = time.monotonic()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        try:
            items, single = self.io.parse(body)
        except BadRequest as exc:
            return _error(400, str(exc))
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        reqs: list[EngineRequest] = []
        for item in items:
            fut = loop.create_future()

            def on_done(result: EngineResult, fut: asyncio.Future = fut) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                    loop.call_soon_threadsafe(_deliver, fut, result)

            futures.append(fut)
            reqs.append(EngineRequest(item.rid, item.ids, item.sp, on_done, arrival=arrival, hidden=item.hidden,
                                      prefill_only=item.prefill_only, logprob_start=item.logprob_start,
                                      top_logprobs=item.top_logprobs))
        self.engine.submit(reqs)
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for r in reqs:
                r.cancelled = True
            raise
        replies = [self.io.reply(res, item) for res, item in zip(results, items)]
        payload = replies[0] if single else replies
        return web.Response(body=json.dumps(payload).encode(), content_type="application/json")

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def _handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.model_info())

    async def _handle_server_info(self, request: web.Request) -> web.Response:
        info = self.model_info()
        info.update(self.capture_info())
        info.update(
            {
                "engine": self.engine.stats.to_json(),
                "continuous_batching": self.engine.continuous,
                "running": self.engine.running,
                "queued": self.engine.queued,
            }
        )
        return web.json_response(info)

    async def _handle_flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")

    def build_app(self) -> web.Application:
        """The aiohttp application (routes above, API-key middleware when ``api_key`` is set)."""
        middlewares = []
        if self.api_key:
            expected = f"Bearer {self.api_key}".encode()

            @web.middleware
            async def require_api_key(request: web.Request, handler):
                if request.method == "OPTIONS" or request.path.startswith("/health"):
                    return await handler(request)
                given = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return web.json_response({"error": "Unauthorized"}, status=401)
                return await handler(request)

            middlewares.append(require_api_key)
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.router.add_post("/generate", self._handle_generate)
        app.router.add_put("/generate", self._handle_generate)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/health_generate", self._handle_health)
        # newer SGLang (and sglang-router's worker discovery) use /model_info and /server_info; both names work
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self._handle_model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self._handle_server_info)
        app.router.add_route("*", "/flush_cache", self._handle_flush_cache)
        return app


async def start_site(server: ModelServer, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve ``server`` on ``host:port`` in the running loop (port 0 = any free port). Returns (runner, port).

    Handlers are cancelled when their client disconnects, which drops the request from the decode batch.
    """
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)


@dataclass
class RunningServer:
    """A server started by ``serve_in_thread``: ``url`` is ``http://host:port``."""

    url: str
    server: ModelServer


@contextlib.contextmanager
def serve_in_thread(model_path: str, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> Iterator[RunningServer]:
    """Run a ``ModelServer`` with its own event loop in a background thread of this process (tests, benchmarks).

    ``kwargs`` go to ``ModelServer``. Yields once the server answers; stops it on exit.
    """
    server = ModelServer(model_path, **kwargs)
    server.start()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            state["runner"], state["port"] = loop.run_until_complete(start_site(server, host, port))
        except BaseException as exc:  # surfaced to the caller below
            state["error"] = exc
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(state["runner"].cleanup())
        loop.close()

    thread = threading.Thread(target=run, name="eagle-assets-server", daemon=True)
    thread.start()
    ready.wait()
    if "error" in state:
        server.stop()
        raise state["error"]
    try:
        yield RunningServer(url=f"http://{host}:{state['port']}", server=server)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        server.stop()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eagle_assets.serving.server",
        description="Serve a local transformers causal LM over SGLang's native /generate protocol.",
    )
    p.add_argument("--model-path", required=True, help="local transformers model directory")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000, help="0 = any free port (printed in the ready line)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="idle wait for more requests to batch with")
    p.add_argument("--dtype", default="auto", help="auto (float64 for small CPU models) | float32 | bfloat16 | ...")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--api-key-env", default=None, help="environment variable holding the API key")
    p.add_argument("--api-key", default=None, help="API key (visible in the process list; prefer --api-key-env)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampled requests without sampling_seed")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true",
                   help="SGLang's capture-only mode: return_hidden_states returns the aux hidden states")
    p.add_argument("--speculative-algorithm", default=None,
                   help="with --enable-return-aux-hidden-states: the capture convention (EAGLE3); nothing else")
    p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+", default=None,
                   help="SGLang's layer ids (model-class rule, see eagle_assets.serving.aux_capture)")
    p.add_argument("--enable-return-hidden-states", action="store_true",
                   help="allow return_hidden_states (the final-normed hidden state)")
    p.add_argument("--return-hidden-states-mode", choices=["last", "full"], default=None)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="shut down when the launching process dies (set by eagle_assets.serving.launch)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(f"error: --api-key-env {args.api_key_env} is set but that environment variable is empty or "
                  "missing; export it or drop the flag", file=sys.stderr)
            return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("binding %s without an API key: anyone who can reach this port can use the model", args.host)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars only clutter the server log
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    try:
        server = ModelServer(
            args.model_path,
            tokenizer_path=args.tokenizer_path,
            max_batch_size=args.max_batch_size,
            batch_wait_s=args.batch_wait_ms / 1000.0,
            dtype=args.dtype,
            device=args.device,
            api_key=api_key,
            context_length=args.context_length,
            seed=args.seed,
            enable_return_aux_hidden_states=args.enable_return_aux_hidden_states,
            speculative_algorithm=args.speculative_algorithm,
            return_aux_hidden_state_layer_ids=args.return_aux_hidden_state_layer_ids,
            enable_return_hidden_states=args.enable_return_hidden_states,
            return_hidden_states_mode=args.return_hidden_states_mode,
        )
    except (OSError, ValueError) as exc:
        print(f"error: cannot serve {args.model_path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    server.start()

    async def serve() -> None:
        runner, port = await start_site(server, args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if args.exit_with_parent:
            parent = os.getppid()

            async def watch_parent() -> None:
                # a SIGKILLed launcher runs no teardown; its orphaned server must not keep the model loaded
                while os.getppid() == parent:
                    await asyncio.sleep(1.0)
                log.warning("launching process %d is gone; shutting down", parent)
                stop.set()

            watcher = asyncio.ensure_future(watch_parent())
        info = server.model_info()
        print(f"{READY_PREFIX} http://{args.host}:{port}", flush=True)
        log.info("serving %s (dtype %s, max batch %d, continuous batching %s)", args.model_path, info["dtype"],
                 args.max_batch_size, server.engine.continuous)
        await stop.wait()
        if args.exit_with_parent:
            watcher.cancel()
        await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
