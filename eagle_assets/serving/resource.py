"""Dagster resource for the ``/generate`` server(s): connect to given URLs, or launch one lazily for the run.

The only Dagster-aware module of ``eagle_assets.serving``. Launching happens on the first ``base_urls()`` call,
never in ``setup_for_execution``: Dagster runs setup in every step process, and most steps never generate, so an
eager launch would load the model once per step. ``teardown_after_execution`` stops a launched server (process
group SIGTERM, then SIGKILL); see ``eagle_assets.serving.launch``.
"""

from __future__ import annotations

import threading

import dagster as dg
from pydantic import PrivateAttr

from eagle_assets.serving.aux_capture import AuxCapture
from eagle_assets.serving.client import normalize_url
from eagle_assets.serving.launch import LAUNCH_KINDS, LaunchedServer, launch_server


class SGLangServerResource(dg.ConfigurableResource):
    """Where ``/generate`` requests go.

    Fields:
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
    """

    urls: list[str] = []
    launch: str = "embedded"
    model_path: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    startup_timeout_s: float = 300.0
    extra_args: list[str] = []
    api_key_env: str | None = None
    log_dir: str | None = None

    _server: LaunchedServer | None = PrivateAttr(default=None)
    _capture: AuxCapture | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

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
        if self.launch not in LAUNCH_KINDS:
            raise ValueError(f"SGLangServerResource.launch must be one of {LAUNCH_KINDS}, got {self.launch!r}")
        with self._lock:
            server = self._server
            if server is not None:
                if server.model_path != str(path):
                    raise ValueError(
                        f"this resource already serves {server.model_path}; one launched server serves one model "
                        f"(asked for {path})"
                    )
                if server.alive() and self._capture == aux_capture:
                    return [server.url]
                server.stop()  # it died, or other capture flags are needed: start a fresh one below
            self._server = launch_server(
                str(path),
                launch=self.launch,
                host=self.host,
                port=self.port,
                startup_timeout_s=self.startup_timeout_s,
                extra_args=list(self.extra_args),
                api_key_env=self.api_key_env,
                log_dir=self.log_dir,
                aux_capture=aux_capture,
            )
            self._capture = aux_capture
            return [self._server.url]

    @property
    def launched(self) -> LaunchedServer | None:
        """The server this resource launched, if any."""
        return self._server

    def stop(self) -> None:
        """Stop a launched server (no-op in connect mode or before a launch)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.stop()
