"""SGLang 0.5.23's own parse of decoded replies, for the tests that hold ``generations.reply`` to it.

Live where an SGLang venv is on this machine (``$EAGLE_ASSETS_SGLANG_PYTHON``, else
``.eagle_assets/sglang-cpu-venv/bin/python``; ``../shared/tools/setup_venv_sgl_cpu.sh DIR`` builds one in a few
minutes): the cases go through ``servers/sglang_reply_parse.py`` under that Python, and every case also recorded in
``data/sglang_0.5.23_reply_parses.json`` must have been recorded with the same parse. Elsewhere (CI installs only the
project) the recorded parses answer, and a case that was never recorded fails with the command that records it:

    EAGLE_ASSETS_SGLANG_PYTHON=<venv>/bin/python EAGLE_ASSETS_RECORD_SGLANG=1 \\
        pytest eagle_assets_tests/test_reply_sglang.py

A recording is SGLang's output for that exact input (parser names, force_reasoning, text, tools, history count),
never an expectation written by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "data" / "sglang_0.5.23_reply_parses.json"
SCRIPT = HERE / "servers" / "sglang_reply_parse.py"


def sglang_python() -> Path | None:
    """The Python of an SGLang 0.5.23 venv on this machine, or None."""
    given = os.environ.get("EAGLE_ASSETS_SGLANG_PYTHON")
    if given and Path(given).is_file():
        return Path(given)
    venv = HERE.parent / ".eagle_assets" / "sglang-cpu-venv"
    return venv / "bin" / "python" if venv_complete(venv) else None


def venv_complete(venv: Path) -> bool:
    """Whether the SGLang venv at ``venv`` finished its build (``.complete``, written last) and the base venv whose
    packages it reads (the line ``sglang_cpu/setup_venv.sh`` writes with ``BASE_PYTHON``, as ``real_sglang``
    builds it) is still there."""
    try:
        contents = json.loads((venv / ".complete").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(contents, dict) or contents.get("specforge") != "0.2.0":  # built before SpecForge was added
        return False
    return all(Path(pth.read_text().strip()).is_dir()
               for pth in venv.glob("lib/python*/site-packages/eagle_assets_base_venv.pth"))


def _key(case: dict) -> str:
    return json.dumps(case, sort_keys=True, ensure_ascii=False)


def _recorded() -> dict[str, dict]:
    if not RECORDED.exists():
        return {}
    return {_key(r["case"]): r["parse"] for r in json.loads(RECORDED.read_text())}


_workers: dict[Path, subprocess.Popen] = {}


def _live(python: Path, cases: list[dict]) -> list[dict]:
    """The parses from one ``servers/sglang_reply_parse.py`` process per session (started on first use)."""
    worker = _workers.get(python)
    if worker is None or worker.poll() is not None:
        worker = _workers[python] = subprocess.Popen(
            [str(python), str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    worker.stdin.write(json.dumps(cases) + "\n")
    worker.stdin.flush()
    line = worker.stdout.readline()
    assert line, f"SGLang's parsers under {python} exited ({worker.poll()}); run servers/sglang_reply_parse.py by hand"
    return json.loads(line)


def sglang_parses(cases: list[dict]) -> tuple[list[dict], str]:
    """SGLang's parse of each case (see the module doc), and ``"live"`` or ``"recorded"``."""
    recorded = _recorded()
    python = sglang_python()
    if python is None:
        missing = [c for c in cases if _key(c) not in recorded]
        if missing:
            pytest.fail(f"{len(missing)} reply shapes were never parsed by SGLang 0.5.23 (first: {missing[0]}); "
                        "record them with EAGLE_ASSETS_SGLANG_PYTHON=<sglang venv>/bin/python "
                        "EAGLE_ASSETS_RECORD_SGLANG=1 pytest eagle_assets_tests/test_reply_sglang.py")
        return [recorded[_key(c)] for c in cases], "recorded"
    live = _live(python, cases)
    if os.environ.get("EAGLE_ASSETS_RECORD_SGLANG"):
        recorded.update({_key(c): p for c, p in zip(cases, live)})
        rows = [{"case": json.loads(k), "parse": v} for k, v in sorted(recorded.items())]
        RECORDED.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    stale = [c for c, p in zip(cases, live) if _key(c) in recorded and recorded[_key(c)] != p]
    assert not stale, f"{len(stale)} recorded parses differ from SGLang's live parse (first: {stale[0]}); record again"
    return live, "live"
