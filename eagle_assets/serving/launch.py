"""Start a ``/generate`` server process and wait until it serves: ours (embedded) or SGLang's.

- ``embedded``: ``python -m eagle_assets.serving.server --model-path DIR --host H --port P``; with port 0 the server
  binds any free port and prints ``EAGLE_ASSETS_SERVER_READY http://H:PORT``, which is read from its log.
- ``sglang``: ``python -m sglang.launch_server --model-path DIR --host H --port P``, with the ``python`` of an
  environment that has SGLang (default this one: ``pip install 'eagle-assets[sglang]'`` on a GPU host); a free port
  is chosen first when port is 0, and readiness is ``GET /health`` answering 200 (SGLang answers 503 until its
  warm-up request has run). ``device``: ``cuda``, ``cpu``, or ``auto`` (``cpu`` when torch sees no CUDA device).
  On ``cpu`` the server runs SGLang's CPU engine (:func:`cpu_server_args`: ``SGLANG_USE_CPU_ENGINE=1``,
  ``--device cpu``, the checkpoint's stored dtype, ``--disable-overlap-schedule``), which needs SGLang's CPU kernel
  package ``sgl_kernel`` importable (PyPI has no x86 CPU build of it: build it from SGLang's source).
- ``aux_capture`` (served drafter features): both kinds get SGLang's capture-only flags
  (``--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states [--return-aux-hidden-state-layer-ids ..]``,
  which our server mirrors); SGLang also ``--disable-radix-cache`` and a ``--chunked-prefill-size`` that holds the
  longest row (:meth:`eagle_assets.serving.aux_capture.AuxCapture.server_args`).

The child runs in its own process group with stdout and stderr in a log file (its tail is quoted when start-up
fails), and is stopped with SIGTERM to the group, then SIGKILL. Servers still running when the interpreter exits
are stopped by an ``atexit`` hook, and the embedded server exits by itself when its launching process dies
(``--exit-with-parent``), so a crashed or killed caller does not leak a model server.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from eagle_assets.serving.aux_capture import AuxCapture

LAUNCH_KINDS = ("embedded", "sglang")
DEVICES = ("auto", "cpu", "cuda")
# printed by eagle_assets.serving.server once it accepts connections, followed by its base URL
READY_PREFIX = "EAGLE_ASSETS_SERVER_READY"

_live: set["LaunchedServer"] = set()
_live_lock = threading.Lock()


@dataclass(eq=False)
class LaunchedServer:
    """A running server process.

    Attributes:
        url: base URL, ``http://host:port``.
        model_path: the model it serves.
        launch: ``embedded`` or ``sglang``.
        process: the child process (leader of its own process group).
        log_path: file holding the child's stdout and stderr.
        command: the command line, with any API key replaced by ``***``.
    """

    url: str
    model_path: str
    launch: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM the process group, wait up to ``timeout_s``, then SIGKILL. Returns the exit code."""
        with _live_lock:
            _live.discard(self)
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


@atexit.register
def _stop_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live)
    for server in leftovers:
        server.stop(timeout_s=5.0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('' if unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _health_ok(url: str, api_key: str | None) -> bool:
    req = urllib.request.Request(url + "/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _ready_url(log_path: Path) -> str | None:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(READY_PREFIX):
            return line[len(READY_PREFIX):].strip()
    return None


def resolve_device(device: str) -> str:
    """``cpu`` or ``cuda``: ``auto`` is ``cuda`` when torch sees a CUDA device, else ``cpu``.

    Raises:
        ValueError: a device not in :data:`DEVICES`.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_server_args(model_path: str, given: Sequence[str] = ()) -> list[str]:
    """SGLang's flags for its CPU engine, those the user already put in ``given`` left out: ``--device cpu``, the
    checkpoint's stored dtype (``--dtype``; SGLang's ``auto`` serves a float32 checkpoint as float16, which on a CPU is
    slow and not what the weights say), ``--disable-overlap-schedule`` (the overlap scheduler needs CUDA streams) and
    ``--sleep-on-idle`` (an idle scheduler otherwise polls at full speed on a core the pipeline's own steps need).
    """
    present = set(given)
    args = [] if "--device" in present else ["--device", "cpu"]
    if "--dtype" not in present:
        args += ["--dtype", _stored_dtype(model_path)]
    if "--disable-overlap-schedule" not in present:
        args.append("--disable-overlap-schedule")
    if "--sleep-on-idle" not in present:  # an idle scheduler otherwise polls at full speed on a core
        args.append("--sleep-on-idle")
    return args


def _stored_dtype(model_path: str) -> str:
    """The dtype ``config.json`` stores the weights in (``dtype`` / ``torch_dtype``, top level or ``text_config``);
    ``auto`` when there is no readable local config (a hub id: SGLang reads it itself)."""
    try:
        config = json.loads((Path(os.path.expanduser(model_path)) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    for level in (config, config.get("text_config") or {}):
        name = level.get("dtype") or level.get("torch_dtype") if isinstance(level, dict) else None
        if name in ("float32", "bfloat16", "float16"):
            return name
    return "auto"


def server_command(
    model_path: str,
    *,
    launch: str = "embedded",
    host: str = "127.0.0.1",
    port: int = 0,
    extra_args: Sequence[str] = (),
    api_key_env: str | None = None,
    api_key: str | None = None,
    python: str = sys.executable,
    aux_capture: AuxCapture | None = None,
    device: str = "cuda",
) -> tuple[list[str], list[str]]:
    """The command line :func:`launch_server` runs, and the same with the API key replaced by ``***``.

    ``embedded``: ``python -m eagle_assets.serving.server --model-path M --host H --port P --exit-with-parent
    [--api-key-env VAR]``; ``sglang``: ``python -m sglang.launch_server --model-path M --host H --port P
    [--api-key KEY]`` (with ``device`` ``cpu``: :func:`cpu_server_args`); then ``extra_args``, then the capture flags
    of ``aux_capture``
    (:meth:`~eagle_assets.serving.aux_capture.AuxCapture.server_args`, e.g. from ``AuxCapture.for_target``, which
    names ``--return-aux-hidden-state-layer-ids`` only for a non-default capture set), skipping flags the user
    already put in ``extra_args``.
    """
    if launch not in LAUNCH_KINDS:
        raise ValueError(f"launch must be one of {LAUNCH_KINDS}, got {launch!r}")
    if launch == "embedded":
        cmd = [python, "-m", "eagle_assets.serving.server", "--model-path", str(model_path), "--host", host,
               "--port", str(port), "--exit-with-parent"]
        if api_key_env:
            cmd += ["--api-key-env", api_key_env]
        shown = list(cmd)
    else:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
               "--port", str(port)]
        shown = list(cmd)
        if api_key:
            cmd += ["--api-key", api_key]
            shown += ["--api-key", "***"]
    extra = list(extra_args)
    if launch == "sglang" and device == "cpu":
        extra = cpu_server_args(model_path, extra) + extra
    if aux_capture is not None:
        extra += aux_capture.server_args(launch, extra)
    return cmd + extra, shown + extra


def launch_server(
    model_path: str,
    *,
    launch: str = "embedded",
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout_s: float = 300.0,
    extra_args: Sequence[str] = (),
    api_key_env: str | None = None,
    log_dir: str | Path | None = None,
    python: str = sys.executable,
    aux_capture: AuxCapture | None = None,
    device: str = "auto",
) -> LaunchedServer:
    """Start a server for ``model_path`` and return once ``/health`` answers 200.

    Args:
        model_path: model directory (or hub id for ``sglang``).
        launch: ``embedded`` or ``sglang``.
        host: bind address; loopback by default.
        port: 0 = pick a free port.
        startup_timeout_s: seconds to wait for readiness (model load and warm-up included).
        extra_args: appended to the server's command line (e.g. ``["--max-batch-size", "16"]``).
        api_key_env: environment variable holding the API key the server must require. The embedded server reads
            it from its environment; SGLang only takes ``--api-key`` on its command line.
        log_dir: where the log file goes (default: a new temp directory).
        python: interpreter for the child (for ``sglang``: one whose environment has SGLang).
        aux_capture: launch the server in aux-hidden-state capture mode (flags the user already put in
            ``extra_args`` win).
        device: for ``sglang``: ``auto`` | ``cpu`` | ``cuda`` (see the module docstring).
    Raises:
        ValueError: unknown ``launch`` or ``device``, or ``api_key_env`` set but empty.
        FileNotFoundError: ``model_path`` is a filesystem path (absolute, ``./``, ``~``) that does not exist.
        RuntimeError: the process exited before becoming ready (message quotes the log tail).
        TimeoutError: not ready within ``startup_timeout_s`` (the process is stopped first).
    """
    if launch not in LAUNCH_KINDS:
        raise ValueError(f"launch must be one of {LAUNCH_KINDS}, got {launch!r}")
    path_like = os.path.isabs(str(model_path)) or str(model_path).startswith((".", "~"))
    if path_like and not os.path.exists(os.path.expanduser(str(model_path))):
        raise FileNotFoundError(f"model path {model_path} does not exist; build or download the model first")
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"api_key_env={api_key_env!r} names an unset or empty environment variable")
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="eagle-assets-server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = None
    if launch == "sglang":
        port = port or free_port(host)
        device = resolve_device(device)
        if device == "cpu":
            env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    cmd, shown = server_command(str(model_path), launch=launch, host=host, port=port, extra_args=extra_args,
                                api_key_env=api_key_env, api_key=api_key, python=python, aux_capture=aux_capture,
                                device=device)
    log_path = log_dir / f"{launch}-server-{os.getpid()}-{int(time.time() * 1000)}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    server = LaunchedServer(url="", model_path=str(model_path), launch=launch, process=process, log_path=log_path,
                            command=shown)
    with _live_lock:
        _live.add(server)
    deadline = time.monotonic() + startup_timeout_s
    url = None if launch == "embedded" else f"http://{host}:{port}"
    try:
        while True:
            if process.poll() is not None:
                hint = ""
                if launch == "sglang":
                    hint = ("\n(SGLang needs a GPU host and `pip install 'eagle-assets[sglang]'`; on a CPU machine "
                            "use launch: embedded)")
                raise RuntimeError(
                    f"{launch} server exited with code {process.returncode} before it was ready.\n"
                    f"command: {' '.join(shown)}\nlog {log_path}, last lines:\n{log_tail(log_path)}{hint}"
                )
            if url is None:
                url = _ready_url(log_path)
            if url is not None and _health_ok(url, api_key):
                server.url = url
                return server
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{launch} server not ready after {startup_timeout_s:g}s (raise startup_timeout_s for large "
                    f"models).\ncommand: {' '.join(shown)}\nlog {log_path}, last lines:\n{log_tail(log_path)}"
                )
            time.sleep(0.2)
    except BaseException:
        server.stop(timeout_s=5.0)
        raise


@contextlib.contextmanager
def launched_server(model_path: str, **kwargs) -> Iterator[LaunchedServer]:
    """Context manager around ``launch_server`` (same arguments) that stops the server on exit."""
    server = launch_server(model_path, **kwargs)
    try:
        yield server
    finally:
        server.stop()
