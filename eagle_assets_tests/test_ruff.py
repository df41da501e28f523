"""The tree is clean under ruff (pyflakes, pycodestyle at 120 columns, import sorting; ``[tool.ruff]`` in
pyproject.toml): the package, the tests and the benchmarks."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "eagle_assets", "eagle_assets_tests",
                           "bench"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
