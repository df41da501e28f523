"""The process between the pipeline and a server it launches: hands over the API key, redacts it from the log, and
takes the server down with the pipeline.

``python -m eagle_assets.serving.supervisor --parent-pid P --log FILE [--secret-env VAR [--key-config]] -- CMD ...``

``eagle_assets.serving.launch`` starts this module as the leader of a new process group, and it starts ``CMD`` (the
embedded server or ``sglang.launch_server``) in that group. It exists for what the server cannot do itself:

- **The key never rides on a command line.** SGLang 0.5.23 takes its API key only as ``--api-key KEY`` (argv is
  readable by every local user in ``ps`` and ``/proc/PID/cmdline``) or from a YAML file given as ``--config PATH``
  (``sglang.srt.server_args.prepare_server_args`` -> ``utils.server_args_config_parser.ConfigArgumentMerger``: the
  path must end in ``.yaml`` and exist; the file is opened once). With ``--key-config`` the supervisor makes a FIFO
  named ``api-key.yaml`` in a fresh ``0700`` folder, adds ``--config FIFO`` to ``CMD``, writes ``api-key: KEY`` into
  it when the server opens it, then removes it: the key is never on disk and never in an argv. ``VAR`` is removed
  from the server's environment (SGLang does not read it). The embedded server reads ``VAR`` itself
  (``--api-key-env``), so without ``--key-config`` the environment is left as it is.
- **The key never reaches the log.** SGLang prints its ``server_args`` at start-up, key included
  (``entrypoints/engine.py``: ``logger.info(f"server_args=...")``). The server's stdout and stderr come through a
  pipe, and every occurrence of the key is replaced by ``***`` before a byte is written to ``FILE``
  (:class:`StreamRedactor`), so the log tail a failed start quotes, ``run_logs/`` and the run database never hold it.
- **The server dies with the pipeline.** When the launching process ``P`` is gone (this process's parent changes:
  a SIGKILLed Dagster step runs no teardown), the supervisor SIGTERMs its process group, waits
  :data:`STOP_GRACE_S`, then SIGKILLs it, so a retried run does not find the GPU and the port still held.
  ``os.getppid()`` is polled rather than ``prctl(PR_SET_PDEATHSIG)``, which fires when the *thread* that started the
  child exits, not the process (Dagster launches from worker threads).

Exit status: the server's (``128 + signal`` when it was killed by one); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

POLL_S = 0.2
STOP_GRACE_S = 15.0  # SIGTERM to SIGKILL when the parent is gone (SGLang frees GPU memory on SIGTERM)
KEY_FILE = "api-key.yaml"  # SGLang's --config insists on a .yaml / .yml suffix
REDACTED = b"***"


class StreamRedactor:
    """Replaces every occurrence of the secrets in a byte stream fed in arbitrary chunks.

    A secret split across two chunks is still replaced: the end of a chunk that could be the start of a secret is
    held back until the next chunk (or :meth:`close`) shows whether it is. Nothing else is held back, so a line
    that ends a chunk (a server's ready line) is passed on at once.
    """

    def __init__(self, secrets: Sequence[str]):
        self.secrets = sorted({s.encode() for s in secrets if s}, key=len, reverse=True)
        self.pending = b""

    def _replace(self, data: bytes) -> bytes:
        for secret in self.secrets:
            data = data.replace(secret, REDACTED)
        return data

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``pending + chunk`` that can be written now, redacted."""
        data = self._replace(self.pending + chunk)
        hold = 0
        for secret in self.secrets:
            for n in range(min(len(secret) - 1, len(data)), hold, -1):
                if data.endswith(secret[:n]):
                    hold = n
                    break
        self.pending = data[len(data) - hold:] if hold else b""
        return data[: len(data) - hold]

    def close(self) -> bytes:
        """What is still held back (it was not the start of a secret after all)."""
        out, self.pending = self.pending, b""
        return out


def _write_key_when_read(fifo: str, key: str, done: threading.Event) -> None:
    """Write ``api-key: KEY`` into ``fifo`` once a reader opens it, then remove it (and its folder)."""
    import yaml

    payload = yaml.safe_dump({"api-key": key}).encode()
    try:
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: nobody has opened it for reading yet
                    return
                time.sleep(0.05)
                continue
            try:
                os.set_blocking(fd, True)
                os.write(fd, payload)
            finally:
                os.close(fd)
            return
    finally:
        shutil.rmtree(os.path.dirname(fifo), ignore_errors=True)


def _key_fifo() -> str:
    folder = tempfile.mkdtemp(prefix="eagle-assets-key-")  # 0700: only this user can even list it
    path = os.path.join(folder, KEY_FILE)
    os.mkfifo(path, 0o600)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    return path


def _copy_redacted(source, log, redactor: StreamRedactor) -> None:
    fd = source.fileno()
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        log.write(redactor.feed(chunk))
        log.flush()
    log.write(redactor.close())
    log.flush()


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eagle_assets.serving.supervisor", description=__doc__.split("\n")[0])
    p.add_argument("--parent-pid", type=int, required=True, help="stop the server when this process is gone")
    p.add_argument("--log", required=True, help="file the server's redacted stdout and stderr are appended to")
    p.add_argument("--secret-env", default=None, help="environment variable holding the API key")
    p.add_argument("--key-config", action="store_true",
                   help="hand the key to the server as SGLang's --config YAML through a FIFO")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no server command after --")
    if args.key_config and not args.secret_env:
        p.error("--key-config needs --secret-env")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    key = os.environ.get(args.secret_env, "") if args.secret_env else ""
    if args.secret_env and not key:
        print(f"supervisor: ${args.secret_env} is unset or empty; export the API key in it", file=sys.stderr)
        return 2
    command, env = list(args.command), dict(os.environ)
    done = threading.Event()
    writer = None
    if args.key_config:
        fifo = _key_fifo()
        command += ["--config", fifo]
        env.pop(args.secret_env, None)
        writer = threading.Thread(target=_write_key_when_read, args=(fifo, key, done), daemon=True)
        writer.start()
    # The launcher's SIGTERM reaches the whole group: the supervisor outlives the server, to copy its last lines and
    # report its exit status, and the launcher SIGKILLs the group if the server does not stop.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    with open(args.log, "ab") as log:
        try:
            child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            log.write(f"supervisor: cannot start {command[0]}: {exc}\n".encode())
            done.set()
            return 127
        copier = threading.Thread(target=_copy_redacted, args=(child.stdout, log, StreamRedactor([key])),
                                  daemon=True)
        copier.start()
        orphaned_at = None
        while child.poll() is None:
            if orphaned_at is None and os.getppid() != args.parent_pid:
                orphaned_at = time.monotonic()
                log.write(f"supervisor: launching process {args.parent_pid} is gone; stopping the server\n".encode())
                log.flush()
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                os.killpg(os.getpgrp(), signal.SIGTERM)
            if orphaned_at is not None and time.monotonic() - orphaned_at > STOP_GRACE_S:
                done.set()
                os.killpg(os.getpgrp(), signal.SIGKILL)  # this process included
            time.sleep(POLL_S)
        done.set()
        # a server's own children may keep the pipe open after it exited: do not wait for them forever
        copier.join(timeout=5.0)
    if writer is not None:
        writer.join(timeout=1.0)
    code = child.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
