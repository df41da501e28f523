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

Every server runs under ``eagle_assets.serving.supervisor`` (the leader of a new process group): it hands SGLang the
API key through a FIFO read as ``--config`` (never argv), writes the server's stdout and stderr to a log file with
the key replaced by ``***`` (its tail is quoted when start-up fails), and stops the group when the launching
process dies, however it died. The launcher stops the group with SIGTERM, then SIGKILL; servers still running when
the interpreter exits are stopped by an ``atexit`` hook.

Readiness is polled without the key (``/health`` needs none, in SGLang as here), and a server is only handed out
once the socket listening on its port is held by a process of its group (:func:`listener_pids`), so a local
process that took the port between :func:`free_port` and the server's bind never receives a request, or the key.
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
from contextlib import suppress
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
        process: the supervisor process (``eagle_assets.serving.supervisor``, leader of the server's process group).
        log_path: file holding the server's stdout and stderr, the API key replaced by ``***``.
        command: the server's command line as shown to people (it never holds the key).
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


def _health_ok(url: str) -> bool:
    # no Authorization header: /health needs none, and the port is not yet known to be the server's
    req = urllib.request.Request(url + "/health")
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
    python: str = sys.executable,
    aux_capture: AuxCapture | None = None,
    device: str = "cuda",
) -> list[str]:
    """The server's command line (run under the supervisor, which adds SGLang's ``--config`` with the key).

    ``embedded``: ``python -m eagle_assets.serving.server --model-path M --host H --port P --exit-with-parent
    [--api-key-env VAR]``; ``sglang``: ``python -m sglang.launch_server --model-path M --host H --port P`` (with
    ``device`` ``cpu``: :func:`cpu_server_args`); then ``extra_args``, then the capture flags of ``aux_capture``
    (:meth:`~eagle_assets.serving.aux_capture.AuxCapture.server_args`, e.g. from ``AuxCapture.for_target``, which
    names ``--return-aux-hidden-state-layer-ids`` only for a non-default capture set), skipping flags the user
    already put in ``extra_args``. It never holds the API key: only the name of its variable.
    """
    if launch not in LAUNCH_KINDS:
        raise ValueError(f"launch must be one of {LAUNCH_KINDS}, got {launch!r}")
    if launch == "embedded":
        cmd = [python, "-m", "eagle_assets.serving.server", "--model-path", str(model_path), "--host", host,
               "--port", str(port), "--exit-with-parent"]
        if api_key_env:
            cmd += ["--api-key-env", api_key_env]
    else:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
               "--port", str(port)]
    extra = list(extra_args)
    if launch == "sglang" and device == "cpu":
        extra = cpu_server_args(model_path, extra) + extra
    if aux_capture is not None:
        extra += aux_capture.server_args(launch, extra)
    return cmd + extra


def supervised(command: Sequence[str], log_path: Path, *, api_key_env: str | None, key_config: bool) -> list[str]:
    """``command`` run under ``eagle_assets.serving.supervisor`` (this interpreter), watching this process.

    ``key_config``: hand the key in ``$api_key_env`` to the server as SGLang's ``--config`` YAML (through a FIFO);
    otherwise the server reads the variable itself.
    """
    sup = [sys.executable, "-m", "eagle_assets.serving.supervisor", "--parent-pid", str(os.getpid()),
           "--log", str(log_path)]
    if api_key_env:
        sup += ["--secret-env", api_key_env] + (["--key-config"] if key_config else [])
    return sup + ["--", *command]


def redact(text: str, secret: str | None) -> str:
    """``text`` with ``secret`` replaced by ``***`` (the log is redacted already; this covers what else is quoted)."""
    return text.replace(secret, "***") if secret else text


def listener_pids(port: int) -> set[int] | None:
    """Pids of this user's processes holding a TCP socket that listens on ``port`` (any address, IPv4 or IPv6).

    Read from ``/proc/net/tcp{,6}`` (state ``0A`` = LISTEN, the socket's inode) and ``/proc/PID/fd`` links
    (``socket:[inode]``). A listening socket of another user's process matches no pid (its fds are not readable),
    so it shows as a listener with no pid: the result is then a set without any pid of ours.

    Returns: the pids, with ``-1`` for a listening socket whose holder was not found; None where ``/proc`` has no
    TCP table (not Linux): the ownership cannot be checked there.
    """
    inodes: set[str] = set()
    tables = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    if not tables:
        return None
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or len(found) == len(inodes):
            continue
        with suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with suppress(OSError):
                    link = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        found[link[8:-1]] = int(entry)
    return {found.get(inode, -1) for inode in inodes}


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _held_by_group(holders: set[int], group: int) -> bool:
    """Whether every listener pid is a process of process group ``group`` (and there is one)."""
    def group_of(pid: int) -> int | None:
        try:
            return os.getpgid(pid)
        except OSError:
            return None

    return bool(holders) and all(group_of(pid) == group for pid in holders)


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
    """Start a server for ``model_path`` and return once ``/health`` answers 200 from a socket the server holds.

    Args:
        model_path: model directory (or hub id for ``sglang``).
        launch: ``embedded`` or ``sglang``.
        host: bind address; loopback by default.
        port: 0 = pick a free port (the embedded server binds port 0 and reports its port; SGLang is given one
            that was free a moment before, and is only used once the check below shows it holds it).
        startup_timeout_s: seconds to wait for readiness (model load and warm-up included).
        extra_args: appended to the server's command line (e.g. ``["--max-batch-size", "16"]``).
        api_key_env: environment variable holding the API key the server must require. The embedded server reads
            it from its environment; SGLang gets it from the supervisor through a FIFO read as ``--config``
            (``eagle_assets.serving.supervisor``): never on a command line, never in the log.
        log_dir: where the log file goes (default: a new temp directory).
        python: interpreter for the server (for ``sglang``: one whose environment has SGLang).
        aux_capture: launch the server in aux-hidden-state capture mode (flags the user already put in
            ``extra_args`` win).
        device: for ``sglang``: ``auto`` | ``cpu`` | ``cuda`` (see the module docstring).
    Raises:
        ValueError: unknown ``launch`` or ``device``, or ``api_key_env`` set but empty.
        FileNotFoundError: ``model_path`` is a filesystem path (absolute, ``./``, ``~``) that does not exist.
        RuntimeError: the process exited before becoming ready, or another process answers on its port (the
            message quotes the log tail, redacted).
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
    cmd = server_command(str(model_path), launch=launch, host=host, port=port, extra_args=extra_args,
                         api_key_env=api_key_env, python=python, aux_capture=aux_capture, device=device)
    command = cmd + (["--config", f"<FIFO: api-key from ${api_key_env}>"] if api_key and launch == "sglang" else [])
    shown = " ".join(command)
    log_path = log_dir / f"{launch}-server-{os.getpid()}-{int(time.time() * 1000)}.log"
    with open(log_path, "ab") as supervisor_errors:  # the supervisor's own errors, if any, land in the log too
        process = subprocess.Popen(
            supervised(cmd, log_path, api_key_env=api_key_env, key_config=launch == "sglang"),
            stdout=subprocess.DEVNULL, stderr=supervisor_errors, stdin=subprocess.DEVNULL, start_new_session=True,
            env=env,
        )
    server = LaunchedServer(url="", model_path=str(model_path), launch=launch, process=process, log_path=log_path,
                            command=command)
    with _live_lock:
        _live.add(server)
    deadline = time.monotonic() + startup_timeout_s
    url = None if launch == "embedded" else f"http://{host}:{port}"

    def failure(what: str) -> str:
        return redact(f"{what}\ncommand: {shown}\nlog {log_path}, last lines:\n{log_tail(log_path)}", api_key)

    try:
        while True:
            if process.poll() is not None:
                hint = ""
                if launch == "sglang":
                    hint = ("\n(SGLang needs a GPU host and `pip install 'eagle-assets[sglang]'`; on a CPU machine "
                            "use launch: embedded)")
                raise RuntimeError(failure(f"{launch} server exited with code {process.returncode} before it was "
                                           "ready.") + hint)
            if url is None:
                url = _ready_url(log_path)
            if url is not None and _health_ok(url):
                holders = listener_pids(_port_of(url))
                if holders is not None and not _held_by_group(holders, process.pid):
                    raise RuntimeError(failure(
                        f"{url} answers /health, but the socket listening on its port is not held by the launched "
                        f"server (its process group is {process.pid}; listeners: "
                        f"{sorted(holders) if holders else 'none found'}, -1 = another user's). Another process "
                        "took the port; nothing, and no API key, was sent to it. Set server.port to a free port or "
                        "launch again."))
                server.url = url
                return server
            if time.monotonic() > deadline:
                raise TimeoutError(failure(f"{launch} server not ready after {startup_timeout_s:g}s (raise "
                                           "startup_timeout_s for large models)."))
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
