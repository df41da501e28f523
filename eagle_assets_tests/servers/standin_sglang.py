"""A stand-in for the Python of an SGLang environment, for the launched-SGLang path where SGLang cannot run.

:func:`write_standin` writes an executable that answers ``<it> -m sglang.launch_server ARGS`` the way SGLang 0.5.23
does as far as secrets go: it reads ``--config PATH`` (YAML, ``api-key``) or ``--api-key KEY``, then prints its
``server_args`` with the key in them (SGLang logs ``server_args={... 'api_key': KEY ...}`` at start-up), and then:

- ``fail``: prints a traceback-like line quoting the key again and exits 1 (a start-up that fails);
- ``serve``: answers ``GET /health`` with 200 on ``--host``/``--port`` until SIGTERM.

It records what it saw in ``$EAGLE_STANDIN_RECORD`` (a JSON file): its argv, the names of its environment
variables, the SHA-256 of the key it received (so a test can tell the key arrived without the file holding it) and
its pid.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

BODY = r'''
import hashlib, http.server, json, os, signal, sys
argv = sys.argv[1:]
assert argv[:2] == ["-m", "sglang.launch_server"], argv
args = argv[2:]
key = None
if "--config" in args:
    import yaml
    with open(args[args.index("--config") + 1]) as f:
        key = (yaml.safe_load(f) or {}).get("api-key")
if "--api-key" in args:
    key = args[args.index("--api-key") + 1]
record = os.environ.get("EAGLE_STANDIN_RECORD")
if record:
    with open(record, "w") as f:
        json.dump({"argv": sys.argv, "env": sorted(os.environ), "pid": os.getpid(),
                   "key_sha256": hashlib.sha256(key.encode()).hexdigest() if key else None}, f)
print(f"server_args=ServerArgs(model_path={args[args.index('--model-path') + 1]!r}, api_key={key!r})", flush=True)
if MODE == "fail":
    print(f"RuntimeError: could not load the model (api_key={key!r}): no GPU", file=sys.stderr, flush=True)
    sys.exit(1)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass

server = http.server.HTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Health)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
print("The server is fired up and ready to roll!", flush=True)
server.serve_forever()
'''


def write_standin(path: Path, mode: str) -> Path:
    """Write the stand-in interpreter to ``path`` (``mode``: ``fail`` or ``serve``) and return ``path``."""
    if mode not in ("fail", "serve"):
        raise ValueError(f"mode must be fail or serve, got {mode!r}")
    path = Path(path)
    path.write_text(f"#!{sys.executable}\nMODE = {mode!r}\n{BODY}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def pids_of_group(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid`` (from ``/proc``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat_line = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat_line.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
    return out
