"""Dagster resource for the ``/generate`` server(s): connect to given URLs, or launch one lazily for the run.

The only Dagster-aware module of ``eagle_assets.serving``. Launching happens on the first ``base_urls()`` call,
never when the resource is initialized: Dagster initializes resources in every step process, and most steps never
generate, so an eager launch would load the model once per step. When the run's steps are done with the resource, a
launched server is stopped (process group SIGTERM, then SIGKILL); see ``eagle_assets.serving.launch``.

A server can also outlive runs: :func:`shared_launcher` registers a :class:`ServerLauncher` under a key, and a
resource with ``shared`` set to that key launches through it (still lazily) and leaves the server running at the end
of its run. ``eagle-assets run`` does this for its partition runs, so one model load serves every partition (a
launch costs ~10 s for the embedded target on a 2-core machine and minutes for SGLang on a GPU host); the key only
means something inside the process that registered it, i.e. with the in-process executor.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from typing import Iterator

import dagster as dg

from eagle_assets.assets.resources import CatalogResource
from eagle_assets.serving.aux_capture import AuxCapture
from eagle_assets.serving.client import GenerateClient, ServerUnavailable, normalize_url, run_sync
from eagle_assets.serving.launch import LAUNCH_KINDS, LaunchedServer, launch_server


class ServerLauncher:
    """Launches one ``/generate`` server on first use and hands out its URL until :meth:`stop`.

    Args: as :func:`eagle_assets.serving.launch.launch_server` (``launch``, ``host``, ``port``,
    ``startup_timeout_s``, ``extra_args``, ``api_key_env``, ``log_dir``, ``device``; ``python``: None = this
    interpreter). Thread-safe.
    """

    def __init__(self, launch: str = "embedded", host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 300.0, extra_args: list[str] | None = None,
                 api_key_env: str | None = None, log_dir: str | None = None, device: str = "auto",
                 python: str | None = None):
        if launch not in LAUNCH_KINDS:
            raise ValueError(f"launch must be one of {LAUNCH_KINDS}, got {launch!r}")
        self.launch, self.host, self.port = launch, host, port
        self.startup_timeout_s, self.extra_args = startup_timeout_s, list(extra_args or [])
        self.api_key_env, self.log_dir = api_key_env, log_dir
        self.device, self.python = device, python or sys.executable
        self.server: LaunchedServer | None = None
        self._capture: AuxCapture | None = None
        self._lock = threading.Lock()

    def url_for(self, model_path: str, aux_capture: AuxCapture | None = None) -> str:
        """The URL of the server for ``model_path`` (launching it, or relaunching it with other capture flags or
        after it died).

        Raises:
            ValueError: a second model asked of one launched server.
            RuntimeError / TimeoutError: the server did not start (the message quotes its log).
        """
        with self._lock:
            server = self.server
            if server is not None:
                if server.model_path != str(model_path):
                    raise ValueError(
                        f"this resource already serves {server.model_path}; one launched server serves one model "
                        f"(asked for {model_path})"
                    )
                if server.alive() and self._capture == aux_capture:
                    return server.url
                server.stop()  # it died, or other capture flags are needed: start a fresh one below
            self.server = launch_server(
                str(model_path), launch=self.launch, host=self.host, port=self.port,
                startup_timeout_s=self.startup_timeout_s, extra_args=list(self.extra_args),
                api_key_env=self.api_key_env, log_dir=self.log_dir, aux_capture=aux_capture, device=self.device,
                python=self.python,
            )
            self._capture = aux_capture
            return self.server.url

    def stop(self) -> None:
        """Stop the launched server (no-op before a launch)."""
        with self._lock:
            server, self.server = self.server, None
        if server is not None:
            server.stop()


_shared: dict[str, ServerLauncher] = {}


@contextlib.contextmanager
def shared_launcher(**kwargs) -> Iterator[str]:
    """Register a :class:`ServerLauncher` (``kwargs`` as its constructor's) for ``SGLangServerResource(shared=key)``;
    yields the key, and on exit stops its server (if one was launched) and forgets it."""
    key = uuid.uuid4().hex
    _shared[key] = launcher = ServerLauncher(**kwargs)
    try:
        yield key
    finally:
        _shared.pop(key, None)
        launcher.stop()


class SGLangServerResource(CatalogResource):
    """Where ``/generate`` requests go (a :class:`~eagle_assets.assets.resources.CatalogResource`: set from the
    catalog's ``server`` section, never from run config: it chooses the executable that is launched, the URLs the
    API key is sent to and the variable the key is read from).

    Each run gets its own copy (:meth:`for_run`), so a server one run launched is stopped when that run's steps are
    done (:meth:`end_run`), and never shared with a concurrent run of the same process.

    Args (keyword only; attributes of the same names):
        urls: connect mode: real SGLang server(s) or one ``sglang-router`` URL; when non-empty nothing is launched.
        launch: when ``urls`` is empty: ``embedded`` (``python -m eagle_assets.serving.server``, CPU friendly) or
            ``sglang`` (``python -m sglang.launch_server``, GPU host).
        model_path: model to serve when ``base_urls()`` is called without one.
        host: bind address of a launched server (loopback by default).
        port: port of a launched server; 0 = a free one.
        startup_timeout_s: seconds to wait for a launched server to answer ``/health``.
        extra_args: appended to the launched server's command line (e.g. ``["--max-batch-size", "16"]`` or SGLang
            flags such as ``["--tp", "8"]``).
        api_key_env: environment variable holding the API key; the launched server requires it and clients send it.
        log_dir: directory for the launched server's log (default: a temp directory).
        device: for ``launch: sglang``: ``auto`` (CPU when torch sees no CUDA device), ``cpu`` or ``cuda``.
        python: for ``launch: sglang``: the interpreter of an environment with SGLang (default this one).
        shared: key of a :func:`shared_launcher` of this process: launch through it, and leave the server running
            when the run ends (the launch settings are the launcher's; the fields above are then unused).
        max_reply_bytes: cap on one reply body (None: derived from each request's ``max_new_tokens``;
            ``serving.client.GenerateClient``).
    """

    def __init__(self, *, urls: list[str] | tuple[str, ...] = (), launch: str = "embedded", model_path: str = "",
                 host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 300.0,
                 extra_args: list[str] | tuple[str, ...] = (), api_key_env: str | None = None,
                 log_dir: str | None = None, device: str = "auto", python: str | None = None,
                 shared: str | None = None, max_reply_bytes: int | None = None):
        self.urls, self.launch, self.model_path = list(urls), launch, model_path
        self.host, self.port, self.startup_timeout_s = host, int(port), float(startup_timeout_s)
        self.extra_args, self.api_key_env, self.log_dir = list(extra_args), api_key_env, log_dir
        self.device, self.python, self.shared = device, python, shared
        self.max_reply_bytes = max_reply_bytes
        self._own: ServerLauncher | None = None
        self._lock = threading.Lock()
        where = (f"the servers {self.urls}" if self.urls else f"a server it launches ({launch})")
        super().__init__(f"/generate requests go to {where}"
                         + (f", with the API key from ${api_key_env}" if api_key_env else "") + ".",
                         resource_fn=self._per_run)

    SETTINGS = ("urls", "launch", "model_path", "host", "port", "startup_timeout_s", "extra_args", "api_key_env",
                "log_dir", "device", "python", "shared", "max_reply_bytes")

    def settings(self) -> dict:
        """The constructor's arguments (names the API key's variable, never holds the key)."""
        return {name: getattr(self, name) for name in self.SETTINGS}

    def __repr__(self) -> str:
        return "SGLangServerResource(" + ", ".join(f"{k}={v!r}" for k, v in self.settings().items()) + ")"

    def for_run(self) -> "SGLangServerResource":
        """A copy with the same settings and no launched server: the run's own."""
        return SGLangServerResource(**self.settings())

    def _per_run(self, _context: dg.InitResourceContext) -> Iterator["SGLangServerResource"]:
        run = self.for_run()
        try:
            yield run
        finally:
            run.stop()  # a server this run launched (a shared launcher's stays up)

    def base_urls(self, model_path: str | None = None, aux_capture: AuxCapture | None = None) -> list[str]:
        """Base URLs to send ``/generate`` to, launching a server on the first call when ``urls`` is empty.

        Args:
            model_path: the model to serve (defaults to the ``model_path`` field); ignored in connect mode.
            aux_capture: launch in SGLang's aux-hidden-state capture mode (served drafter features); a server this
                resource launched with other capture settings is stopped and launched again with these. In connect
                mode the given servers must already run in that mode (the feature source checks ``/server_info``).
        Raises:
            ValueError: no model path, an unknown ``launch``, or a second model asked of one launched server.
            RuntimeError / TimeoutError: the server did not start (the message quotes its log).
        """
        if self.urls:
            return [normalize_url(u) for u in self.urls]
        path = model_path or self.model_path
        if not path:
            raise ValueError(
                "SGLangServerResource has no urls and no model path: set urls to a running server, or pass the "
                "model directory to base_urls() (or the model_path field) to launch one"
            )
        return [self._launcher().url_for(str(path), aux_capture)]

    def generate_client(self, model_path: str, *, concurrency: int, timeout_s: float
                        ) -> tuple[GenerateClient, dict[str, dict]]:
        """A ``GenerateClient`` to ``base_urls(model_path)`` whose every server answered ``/health`` and
        ``/get_model_info`` (``GenerateClient.probe``), and those servers' model info (URL -> body).

        Raises:
            dg.Failure: a server did not answer (the description names the URL and the error; nothing was sent).
            As ``base_urls`` when a launch fails.
        """
        client = GenerateClient(self.base_urls(model_path), concurrency_per_server=concurrency,
                                timeout_s=timeout_s, api_key_env=self.api_key_env,
                                max_reply_bytes=self.max_reply_bytes)
        try:
            infos = run_sync(client.probe())
        except ServerUnavailable as exc:
            raise dg.Failure(description=str(exc), metadata={"url": exc.url, "error": exc.error},
                             allow_retries=False) from exc
        return client, infos

    def _launcher(self) -> ServerLauncher:
        if self.shared is not None:
            launcher = _shared.get(self.shared)
            if launcher is None:
                raise ValueError(
                    f"SGLangServerResource.shared={self.shared!r} names no shared launcher of this process: it only "
                    "works with the in-process executor inside the `with shared_launcher()` that made the key; "
                    "drop `shared` to launch a server per run"
                )
            return launcher
        if self.launch not in LAUNCH_KINDS:
            raise ValueError(f"SGLangServerResource.launch must be one of {LAUNCH_KINDS}, got {self.launch!r}")
        with self._lock:
            if self._own is None:
                self._own = ServerLauncher(launch=self.launch, host=self.host, port=self.port,
                                           startup_timeout_s=self.startup_timeout_s,
                                           extra_args=list(self.extra_args), api_key_env=self.api_key_env,
                                           log_dir=self.log_dir, device=self.device, python=self.python)
            return self._own

    @property
    def launched(self) -> LaunchedServer | None:
        """The server this resource launched (or its shared launcher holds), if any."""
        if self.shared is not None:
            launcher = _shared.get(self.shared)
            return launcher.server if launcher is not None else None
        return self._own.server if self._own is not None else None

    def stop(self) -> None:
        """Stop the server this resource launched (no-op in connect mode, before a launch, and for a shared
        launcher's server, which its ``shared_launcher`` block stops)."""
        with self._lock:
            own, self._own = self._own, None
        if own is not None:
            own.stop()
