"""Shared fixtures: the embedded demo target (shipped in the package) and the shared data dir."""

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# The session starts ~100 Python processes (xdist workers, Dagster run workers and code servers, torchrun ranks,
# embedded target servers), each importing torch, transformers and dagster. The README installs with
# `pip --no-compile`, so those modules are byte-compiled on first import and the .pyc files reused after -- unless
# the environment sets PYTHONDONTWRITEBYTECODE (container images often do): then every process compiles them from
# source again, ~3x the import time (test_drafter_ddp.py: 154 CPU-s instead of 55). The test session, and every
# process it starts (they inherit the environment; xdist starts its workers after this conftest is loaded), writes
# them. The files land in __pycache__ folders of the venv and the checkout (git-ignored).
if os.environ.get("PYTHONDONTWRITEBYTECODE"):
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    sys.dont_write_bytecode = False

# One torch (OpenMP) thread per process, unless the environment says otherwise. The session runs a worker per core
# plus one, and most of them start servers, Dagster runs and trainers of their own, so every core is taken: an OpenMP
# team of two then spin-waits at each barrier for a thread whose core is busy elsewhere. Measured on a 2-core
# machine, a tiny-matrix torch loop beside one busy process took 5.1 CPU-s with two threads and 2.1 with one (and
# less wall time); the whole session, 578 instead of 697 CPU-s of its processes. The catalog's
# ``training.threads: 1`` says the same for training. Every process the session starts inherits it (SGLang's CPU
# engine too: without AMX it leaves torch's thread count alone); a test that is about threads sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# In-process pipeline tests run on ``dg.DagsterInstance.ephemeral()`` (Dagster's in-memory run and event storage),
# not ``dg.instance_for_test`` (sqlite files): the sqlite event log opens a new engine for every event it stores,
# 20-25% of such a test's CPU (test_orchestration_automation.py: 28 CPU-s instead of 34-40). The storages the
# deployment uses are tested where they are the subject: sqlite under ``dagster dev`` (test_orchestration_live.py,
# test_orchestration_instance.py), Postgres (test_orchestration_postgres.py); schedule and sensor contexts need an
# instance ref, so test_orchestration_sensors.py keeps ``instance_for_test``.


@pytest.fixture(scope="session")
def demo_target() -> Path:
    """Directory of the embedded demo target (a real tiny Qwen3 + tokenizer) as the package ships it, checked
    against this checkout's recipe (``demo.shipped.demo_target``); tests of the build itself use small recipes
    (``test_demo_build.py``)."""
    from eagle_assets.demo.shipped import demo_target

    return demo_target()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"../shared/data is absent ({SHARED_DATA}): the real public samples are not on this machine")
    return SHARED_DATA


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one torch thread is faster and unaffected by other processes competing for the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_leftover_defs_state_storage():
    """Each test starts without a Dagster defs-state storage left current by an earlier test's instance.

    A ``DagsterInstance`` makes its defs-state storage current in a ContextVar on ``__enter__``; an instance that a
    sensor test evaluated against can leave that storage current after it is disposed, and the next
    ``dg.materialize`` then fails with "Attempted to resolve undefined DagsterInstance weakref". Long-lived
    processes (daemon, webserver) open one instance and never hit this; only a test process that opens many does.
    """
    from dagster._core.storage.defs_state.base import _current_storage

    token = _current_storage.set(None)
    yield
    _current_storage.reset(token)


def _slow_seconds(item) -> float:
    marker = item.get_closest_marker("slow")
    return float(marker.kwargs.get("seconds", 60)) if marker else 0.0


def pytest_configure(config):
    # pytest-xdist reorders ``loadfile`` scopes by their number of tests unless told not to, which would undo the
    # order below and start the longest module (6 tests, ~6 minutes) last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Modules holding a ``slow`` test run first, the longest first (``slow(seconds=N)``: about N seconds of a
    parallel session; 60 when not given), their order inside kept: under ``-n auto --dist loadfile`` a long module
    that starts last leaves the other workers idle while it finishes (longest-first is the classic fix for that
    tail)."""
    seconds: dict[str, float] = {}
    for item in items:
        seconds[item.module.__name__] = max(seconds.get(item.module.__name__, 0.0), _slow_seconds(item))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds[item.module.__name__], order[id(item)]))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable core, plus one. ``test_orchestration_live.py`` spends most of its minutes
    waiting for a daemon's ticks and for runs in other processes; with a worker per core its worker would sit idle
    through that wait while the rest of the suite queues on the other cores, the extra worker fills it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1


@pytest.fixture(scope="session")
def target8(demo_target, tmp_path_factory) -> Path:
    """An 8-layer variant of the demo target (``tiny_targets.write_deeper_copy``: its tokenizer and trained layers,
    four more near-identity ones), for the aux-capture tests: SGLang's default ids ``[2, 4, 5]`` are distinct there
    and other layer sets exist. Written in about a second."""
    from eagle_assets_tests.tiny_targets import write_deeper_copy

    return write_deeper_copy(demo_target, tmp_path_factory.mktemp("target8") / "model")


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The Python of the SGLang 0.5.23 CPU venv (``real_sglang``: built once per machine); skips with the build's
    reason where it cannot be built."""
    from eagle_assets_tests.real_sglang import SGLangUnavailable, ensure_sglang_python

    try:
        return ensure_sglang_python()
    except SGLangUnavailable as exc:
        pytest.skip(f"no SGLang 0.5.23 CPU venv on this machine: {exc}")
