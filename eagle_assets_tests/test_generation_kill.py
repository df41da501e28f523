"""Kill tests: SIGKILL the generation process at random points, resume, and check exactly-once results.

The generation runs in a child process (``run_generation`` with the real ``GenerateClient``, forked from a
pre-imported ``python -c`` zygote so that a trial costs a fork, not an interpreter start) and is killed with SIGKILL,
so no ``finally`` and no atexit hook runs: only what reached the disk survives.

Two servers, for two reasons:
- ``StubServer`` (model-free, deterministic ids derived from ``input_ids``, a few ms of latency) for 12 seeded
  trials of one or two kills each: replies are cheap, so many kill points fit in the time budget, and the stub itself
  sends the SIGKILL when the trial's chosen request number arrives, which places kills at exact points of progress
  (the child writes a shard every 4 replies, so kills also land inside writes: a writer without temp file + rename
  leaves torn shards and fails here). Some prompts always fail (HTTP 400, or ids outside
  the vocab) so the "minus recorded failures" part of the invariant is exercised.
- Our embedded server on a tiny random Qwen3 (``serve_in_thread``) for the temperature-0 check with a real model:
  the resumed run's batches differ from the uninterrupted run's, and its tokens must still be equal.

Invariant after every resume: rows == unique sample ids == prompts minus the recorded failures, and the tokens
equal those of a run that never stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle_assets.generations.run import FAILURES_FILE, run_generation
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets.storage.shards import read_shards, shard_paths
from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

pytestmark = pytest.mark.slow(seconds=55)  # its share of a parallel session: scheduled early (conftest)

REPO = Path(__file__).resolve().parents[1]
# A zygote: one interpreter imports the generation code once, then forks one child per run on request, so a trial
# costs a fork instead of an interpreter start (~1 s of imports on 2 busy cores). Protocol, one line each: the test
# sends a JSON config; the zygote forks and answers the child's pid; the test arms its killer and sends "go"; the
# child runs run_generation; the zygote answers the child's exit code (-9 after SIGKILL). The zygote never runs an
# event loop or a thread, so forking it is safe.
ZYGOTE = r"""
import json, os, sys, traceback
from eagle_assets.generations.run import run_generation
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams

def child(cfg):
    client = GenerateClient([cfg["url"]], concurrency_per_server=cfg["concurrency"], timeout_s=60, max_attempts=2,
                            backoff_base_s=0.01)
    stats = run_generation([tuple(p) for p in cfg["prompts"]], cfg["out"], client,
                           SamplingParams(**cfg["sampling"]), cfg["vocab"], flush_rows=cfg["flush_rows"],
                           flush_seconds=0.5)
    with open(cfg["out"] + ".summary.json", "w") as fh:
        json.dump(stats.summary(), fh)

for line in sys.stdin:
    cfg = json.loads(line)
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.read(go_r, 1)
        code = 0
        try:
            child(cfg)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    os.close(go_r)
    print(pid, flush=True)
    assert sys.stdin.readline().strip() == "go"
    os.write(go_w, b"g")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class Zygote:
    """Runs ``run_generation`` in forked child processes of one pre-imported interpreter (see ``ZYGOTE``)."""

    def __init__(self, tmp: Path):
        self.log = tmp / "zygote.log"
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(self.log, "wb"), text=True, bufsize=1)

    def start(self, cfg: dict) -> int:
        """Fork a child for ``cfg`` and return its pid; it waits for ``go()`` before it starts."""
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), f"zygote failed:\n{self.log.read_text()[-3000:]}"
        return int(line)

    def go(self) -> None:
        self.proc.stdin.write("go\n")

    def wait(self) -> int:
        """The child's exit code (-9 when it was SIGKILLed)."""
        return int(self.proc.stdout.readline())

    def run(self, cfg: dict) -> int:
        self.start(cfg)
        self.go()
        return self.wait()

    def stderr_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def zygote(tmp_path):
    z = Zygote(tmp_path)
    yield z
    z.close()


def _rows(out: Path) -> dict[str, list[int]]:
    """sample_id -> output_ids over all shards; asserts no id is in two rows and every shard is readable."""
    table = read_shards(out, columns=["sample_id", "output_ids", "completion_tokens"])
    if table is None:
        return {}
    rows = table.to_pylist()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), f"a sample id was written twice in {out}"
    assert all(len(r["output_ids"]) == r["completion_tokens"] for r in rows)
    return {r["sample_id"]: r["output_ids"] for r in rows}


def _failures(out: Path) -> dict[str, str]:
    path = out / FAILURES_FILE
    return {f["sample_id"]: f["kind"] for f in pq.read_table(path).to_pylist()} if path.exists() else {}


def _check_final(out: Path, prompt_ids: list[str], baseline: dict[str, list[int]], expected_failures: dict) -> None:
    rows = _rows(out)
    failures = _failures(out)
    assert failures == expected_failures
    assert set(rows) == set(prompt_ids) - set(failures)
    assert len(rows) == len(set(prompt_ids)) - len(failures)
    assert rows == baseline, "a resumed partition must hold the same tokens as a run that never stopped"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


# --------------------------------------------------------------------------------------------------- stub server
STUB_VOCAB = 1000
STUB_SAMPLING = {"max_new_tokens": 40, "temperature": 0.0, "stop_token_ids": [2]}


def _stub_prompts() -> list[tuple[str, list[int]]]:
    rng = random.Random(7)
    prompts = [(f"s{i:03d}", [rng.randrange(8, STUB_VOCAB) for _ in range(rng.randrange(4, 30))]) for i in range(80)]
    prompts += [(f"refused{i}", [9, 9, i + 10]) for i in range(3)]  # the stub answers HTTP 400: not retried
    prompts += [(f"oov{i}", [9, STUB_VOCAB + i]) for i in range(2)]  # the client refuses: bad_input, no request
    prompts.insert(40, prompts[3])  # a repeated sample id is generated once
    return prompts


class _Killer:
    """``on_request`` hook of the stub: SIGKILL ``pid`` when the server's request count reaches ``at``."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.at: int | None = None

    def __call__(self, n: int) -> None:
        if self.pid is not None and self.at is not None and n >= self.at:
            os.kill(self.pid, signal.SIGKILL)
            self.at = None


def test_sigkill_at_random_points_then_resume_is_exactly_once(tmp_path, zygote):
    prompts = _stub_prompts()
    prompt_ids = [sid for sid, _ in prompts]
    expected_failures = {**{f"refused{i}": "bad_request" for i in range(3)},
                         **{f"oov{i}": "bad_input" for i in range(2)}}
    killer = _Killer()
    fault = (lambda rid, attempt, body: "http_400" if rid.startswith("refused") else None)
    stub = StubServer(vocab_size=STUB_VOCAB, latency_s=0.003, fault=fault, on_request=killer)
    rng = random.Random(20240611)
    kills = mid_run = 0
    with serve_stub_in_thread(stub) as running:
        base_dir = tmp_path / "uninterrupted"
        client = GenerateClient([running.url], concurrency_per_server=8, max_attempts=2, backoff_base_s=0.01)
        run_generation(prompts, base_dir, client, SamplingParams(**STUB_SAMPLING), STUB_VOCAB, flush_rows=4)
        baseline = _rows(base_dir)
        assert _failures(base_dir) == expected_failures and len(baseline) == 80

        for trial in range(12):
            out = tmp_path / f"trial{trial}"
            cfg = {"url": running.url, "prompts": prompts, "out": str(out), "vocab": STUB_VOCAB, "concurrency": 8,
                   "sampling": STUB_SAMPLING, "flush_rows": 4}
            for _ in range(rng.choice([1, 1, 2])):
                done = _rows(out)
                to_send = len({s for s in prompt_ids if s not in done and not s.startswith("oov")})
                pid = zygote.start(cfg)
                killer.pid, killer.at = pid, stub.stats.requests + rng.randint(1, to_send)
                zygote.go()
                code = zygote.wait()
                killer.pid = killer.at = None
                assert code == -signal.SIGKILL, zygote.stderr_tail()
                kills += 1
                # what survived a kill is always consistent: readable shards, unique ids, exact tokens
                survived = _rows(out)
                assert all(baseline[s] == ids for s, ids in survived.items())
                mid_run += 0 < len(survived) < len(baseline)
            assert zygote.run(cfg) == 0, zygote.stderr_tail()
            summary = json.loads(Path(str(out) + ".summary.json").read_text())
            assert summary["skipped_done"] + summary["requested"] == summary["prompts"] == len(set(prompt_ids))
            _check_final(out, prompt_ids, baseline, expected_failures)
    assert kills >= 12 and mid_run >= 8, (kills, mid_run)


# -------------------------------------------------------------------------------------- real model, temperature 0
TINY_VOCAB = 126


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from eagle_assets.serving.server import serve_in_thread
    from eagle_assets_tests.servers.tiny_model import write_tiny_causal_lm

    model_dir = write_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model", seed=5)
    with serve_in_thread(str(model_dir), max_batch_size=16, context_length=128) as running:
        yield running


def test_killed_and_resumed_partition_equals_uninterrupted_run_on_a_real_model(tiny_server, tmp_path, zygote):
    rng = random.Random(3)
    prompts = [(f"p{i:02d}", [rng.randrange(6, TINY_VOCAB) for _ in range(rng.randrange(3, 12))]) for i in range(24)]
    prompt_ids = [sid for sid, _ in prompts]
    sampling = {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [2]}
    base_dir = tmp_path / "uninterrupted"
    client = GenerateClient([tiny_server.url], concurrency_per_server=8)
    stats = run_generation(prompts, base_dir, client, SamplingParams(**sampling), TINY_VOCAB, flush_rows=2)
    baseline = _rows(base_dir)
    assert stats.succeeded == 24 and len(baseline) == 24
    assert len({tuple(v) for v in baseline.values()}) > 12, "the tiny model must answer prompts differently"

    for trial in range(2):
        out = tmp_path / f"trial{trial}"
        cfg = {"url": tiny_server.url, "prompts": prompts, "out": str(out), "vocab": TINY_VOCAB, "concurrency": 8,
               "sampling": sampling, "flush_rows": 2}
        pid = zygote.start(cfg)
        zygote.go()
        target = rng.randint(2, 7)
        deadline = time.monotonic() + 60
        while len(shard_paths(out)) < target and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        assert zygote.wait() == -signal.SIGKILL, "the run finished before the kill; lower the target shard count"
        partial = _rows(out)
        assert 0 < len(partial) < 24 and all(baseline[s] == ids for s, ids in partial.items())
        assert zygote.run(cfg) == 0, zygote.stderr_tail()
        _check_final(out, prompt_ids, baseline, {})
