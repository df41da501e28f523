"""The real SGLang 0.5.23 server on CPU, for the tests that hold the pipeline to it (test-only, never installed).

PyPI has no x86 CPU build of SGLang's compiled kernel package ``sgl_kernel``. SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, the ``torch_native`` attention backend on a CPU without AMX) imports eight names from
it and, for greedy ``/generate``, hidden-state return, aux capture and radix-cache hits, calls none of them: the
stand-in ``sglang_cpu/sgl_kernel`` defines them and raises ``NotImplementedError`` naming the op if one is ever
called. Seeded sampling (``murmur_hash32_cpu``) and EAGLE speculative decoding need the compiled kernels and do not
run this way.

The venv: ``$EAGLE_ASSETS_SGLANG_PYTHON`` when set, else ``<repo>/.eagle_assets/sglang-cpu-venv`` (the path
``sglang_parses`` looks at too), built on first use by ``sglang_cpu/setup_venv.sh`` under a file lock and reused by
every later session. It is built on the tests' own venv (``BASE_PYTHON``: it reads torch 2.13.0 and the other
packages both need from there, and installs only SGLang's own and the versions SGLang pins differently; 40 s instead
of 70 s from a local package index on an idle 2-core machine), so it is rebuilt when that venv has gone. A venv that
cannot be built makes the tests that need it skip, with the build's last lines as the reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

from eagle_assets_tests.sglang_parses import sglang_python, venv_complete

HERE = Path(__file__).resolve().parent
STUB_DIR = HERE / "sglang_cpu"
SETUP_SCRIPT = STUB_DIR / "setup_venv.sh"
DEFAULT_VENV = HERE.parent / ".eagle_assets" / "sglang-cpu-venv"
BUILD_TIMEOUT_S = 900


class SGLangUnavailable(RuntimeError):
    """The SGLang CPU venv could not be built here; the message says why (the tests skip with it)."""


# what a complete venv holds (written to its .complete last; a venv of other contents is built again)
VENV_CONTENTS = {"sglang": "0.5.23", "specforge": "0.2.0"}


def ensure_sglang_python() -> Path:
    """The Python of an SGLang 0.5.23 CPU venv: an existing one, or one built now (once per machine, locked).

    Raises:
        SGLangUnavailable: the build failed or timed out (its log's last lines in the message).
    """
    found = sglang_python()
    if found is not None:
        return found
    DEFAULT_VENV.parent.mkdir(parents=True, exist_ok=True)
    log = DEFAULT_VENV.parent / "sglang-cpu-venv.build.log"
    with open(DEFAULT_VENV.parent / ".sglang-cpu-venv.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other xdist workers wait for one build
        python = DEFAULT_VENV / "bin" / "python"
        if venv_complete(DEFAULT_VENV):
            return python
        # a build that did not finish, or one on a base venv that has gone
        subprocess.run(["rm", "-rf", str(DEFAULT_VENV)], check=False)
        try:
            with open(log, "w") as out:
                proc = subprocess.run(["bash", str(SETUP_SCRIPT), str(DEFAULT_VENV)], stdout=out,
                                      stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S,
                                      env={**os.environ, "PYTHON": sys.executable, "BASE_PYTHON": sys.executable})
        except subprocess.TimeoutExpired:
            raise SGLangUnavailable(f"building the SGLang CPU venv took over {BUILD_TIMEOUT_S} s (log {log})") from None
        if proc.returncode != 0:
            tail = log.read_text()[-1500:]
            raise SGLangUnavailable(f"building the SGLang CPU venv failed (exit {proc.returncode}; log {log}):\n{tail}")
        (DEFAULT_VENV / ".complete").write_text(json.dumps(VENV_CONTENTS) + "\n")
        return python


def sglang_env() -> dict[str, str]:
    """The environment a real SGLang server runs under here: the CPU engine and the ``sgl_kernel`` stand-in."""
    path = os.pathsep.join(p for p in (str(STUB_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}


def run_sglang_driver(sglang_python: Path, script: str, cases: list[dict], folder: Path) -> dict:
    """Run the driver ``sglang_cpu/<script>`` in the SGLang CPU venv on ``cases`` (written to
    ``folder/cases.json``); its report (``folder/out.json``). Asserts it exited 0, with its stderr's tail."""
    (folder / "cases.json").write_text(json.dumps({"cases": cases}))
    proc = subprocess.run([str(sglang_python), str(STUB_DIR / script), str(folder / "cases.json"),
                           str(folder / "out.json")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **sglang_env()})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((folder / "out.json").read_text())
