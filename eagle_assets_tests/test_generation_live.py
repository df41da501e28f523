"""Live quality during generation: running figures, early alarms, fail-fast, and ``live_stats.json``.

The monitor is tested on hand-made rows first. Then ``run_generation`` runs against the model-free
``StubServer`` over real HTTP (its own event loop in a thread) with the real ``GenerateClient`` and real Parquet
shards: a server whose replies are mostly cut at ``max_new_tokens`` must be stopped right after the warm-up with every
received row on disk, and a healthy server must never be stopped. A small hand-made profile makes the stub's ids
segmentable: stub ids are drawn from ``[8, vocab)``, so the structural ids below 8 appear only where the stub puts
them (``think_end_id``, the stop id).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle_assets.catalog import LiveSpec, Thresholds
from eagle_assets.generations.run import FAILURES_FILE, LIVE_STATS_FILE, run_generation
from eagle_assets.qc.live import LiveQualityMonitor
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets.storage.shards import read_shards
from eagle_assets.target_model.profile import FamilyProfile
from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread, stub_truncates

VOCAB = 500
STOP, THINK_END, THINK_START, TOOL_START, TOOL_END = 2, 3, 4, 5, 6
PROFILE = FamilyProfile(name="custom", think_start_id=THINK_START, think_end_id=THINK_END,
                        tool_call_start_ids=(TOOL_START,), tool_call_end_ids=(TOOL_END,), end_of_turn_id=STOP,
                        stop_ids=(STOP,))
CONCURRENCY = 4


# ------------------------------------------------------------------------------------------------ hand-made rows
def _row(sid: str, reasoning: int = 30, answer: int = 10, finish: str = "stop", think_end: bool = True) -> dict:
    """A generations row: ``reasoning`` ids, think end, ``answer`` ids, stop (or cut: ``finish="length"``)."""
    if finish == "length":
        ids = [10] * (reasoning + answer)
    else:
        ids = [10] * reasoning + ([THINK_END] if think_end else []) + [11] * answer + [STOP]
    return {"sample_id": sid, "output_ids": ids, "finish_reason": finish,
            "matched_stop": STOP if finish == "stop" else None, "completion_tokens": len(ids)}


def _monitor(thresholds: Thresholds | None = None, **live) -> LiveQualityMonitor:
    live.setdefault("warmup_rows", 10)
    live.setdefault("report_every_rows", 5)
    return LiveQualityMonitor(PROFILE, thresholds or Thresholds(short_tokens=20), LiveSpec(**live), partition="P")


def _feed(monitor: LiveQualityMonitor, rows: list[dict]) -> list:
    """Observe ``rows`` one by one, evaluating whenever a report is due (as run_generation does)."""
    evaluations = []
    for row in rows:
        monitor.observe(row)
        if monitor.report_due():
            evaluations.append(monitor.evaluate())
    return evaluations


def test_no_evaluation_before_warmup_then_a_broken_partition_is_stopped():
    monitor = _monitor()
    evaluations = _feed(monitor, [_row(f"cut{i}", 40, 0, "length") for i in range(9)])
    # a report at 5 rows (live_stats.json is written) but nothing is judged before 10 rows
    assert evaluations == [None]
    assert monitor.stop is None and monitor.snapshot()["level"] == "WARMUP"
    assert monitor.snapshot()["share_truncated"] == 1.0

    evaluation = _feed(monitor, [_row("cut9", 40, 0, "length")])[0]
    assert evaluation.rows == 10 and evaluation.level == "ERROR"
    stop = evaluation.stop
    assert stop is monitor.stop and stop.figure == "share_dropped" and stop.value == 1.0 and stop.threshold == 0.2
    assert stop.example_ids == ("cut7", "cut8", "cut9")  # the latest offending rows, live.example_ids of them
    assert "truncated_in_reasoning" in stop.message() and "max_new_tokens" in stop.message()
    snap = monitor.snapshot()
    assert snap["stopped"] and snap["stop"]["figure"] == "share_dropped"
    assert snap["drop_reasons"] == {"truncated_in_reasoning": 10}
    json.dumps(snap)  # JSON-able as it is


def test_final_figures_of_a_small_partition_are_judged_but_never_stop_it():
    monitor = _monitor(warmup_rows=50)
    _feed(monitor, [_row(f"cut{i}", 40, 0, "length") for i in range(12)])
    assert monitor.evaluate() is None  # still warming up
    final = monitor.evaluate(final=True)  # every prompt was sent: report the figures, decide nothing
    assert final.rows == 12 and final.level == "ERROR" and final.stop is None and monitor.stop is None
    assert monitor.snapshot()["level"] == "ERROR" and not monitor.snapshot()["stopped"]


def test_length_drift_warns_with_figure_value_threshold_and_shortest_examples():
    thresholds = Thresholds(short_tokens=20, min_median_tokens=15, max_share_short_warn=0.3)
    monitor = _monitor(thresholds, warmup_rows=20)
    # 12 short rows (answers of 1..12 tokens, 3..14 ids in all) and 8 long ones: well formed, but short
    rows = [_row(f"short{i}", 0, i + 1) for i in range(12)] + [_row(f"long{i}", 60, 20) for i in range(8)]
    evaluation = _feed(monitor, rows)[-1]
    assert evaluation.rows == 20 and evaluation.level == "WARN" and evaluation.stop is None
    by_figure = {a.figure: a for a in evaluation.alarms}
    assert set(by_figure) == {"median_tokens", "share_under_short"}
    short = by_figure["share_under_short"]
    assert (short.level, short.value, short.threshold, short.comparison) == ("WARN", 0.6, 0.3, ">")
    assert short.example_ids == ("short0", "short1", "short2")  # the shortest rows
    assert "share_under_short = 0.6 > threshold 0.3 over 20 rows (examples: short0, short1, short2)" in short.message()
    median = by_figure["median_tokens"]
    assert median.comparison == "<" and median.threshold == 15 and median.value < 15
    assert set(evaluation.new_alarms) == set(evaluation.alarms)

    # the same levels at the next report: nothing new to log (an alarm is repeated only when its level changes)
    again = _feed(monitor, [_row(f"short_b{i}", 0, 2) for i in range(5)])[-1]
    assert again.rows == 25 and again.level == "WARN" and again.new_alarms == ()
    snap = monitor.snapshot()
    assert snap["answer_tokens"]["p10"] <= snap["answer_tokens"]["median"] <= snap["answer_tokens"]["p90"] == 20.0
    assert snap["reasoning_tokens"]["p90"] == 60.0


def test_per_reason_error_level_stops_only_with_fail_fast():
    thresholds = Thresholds(short_tokens=5, max_share_dropped_warn=0.05, max_share_dropped_error=0.5,
                            max_share_by_reason={"missing_think_end": {"warn": 0.02, "error": 0.1}})
    rows = [_row(f"ok{i}") for i in range(17)] + [_row(f"open{i}", think_end=False) for i in range(3)]

    monitor = _monitor(thresholds, warmup_rows=20)
    evaluation = _feed(monitor, rows)[-1]
    stop = evaluation.stop
    assert stop is not None and stop.figure == "share_missing_think_end"
    assert (stop.value, stop.threshold) == (0.15, 0.1) and stop.example_ids == ("open0", "open1", "open2")
    assert "chat template" in stop.hint
    levels = {a.figure: a.level for a in evaluation.alarms}
    assert levels == {"share_dropped": "WARN", "share_missing_think_end": "ERROR"}

    relaxed = _monitor(thresholds, warmup_rows=20, fail_fast=False)
    evaluation = _feed(relaxed, rows)[-1]
    assert evaluation.stop is None and relaxed.stop is None and evaluation.level == "ERROR"
    error = next(a for a in evaluation.alarms if a.level == "ERROR")
    assert "fail_fast is off" in error.message()


def test_rows_of_earlier_runs_count_but_a_stop_judges_this_run():
    broken = [_row(f"old{i}", 40, 0, "length") for i in range(30)]
    # the server was fixed: this run's rows are whole, the partition figure is still above the ERROR level
    fixed = _monitor()
    assert fixed.seed(broken) == 30
    evaluations = [e for e in _feed(fixed, [_row(f"new{i}") for i in range(60)]) if e is not None]
    assert evaluations and all(e.stop is None for e in evaluations) and fixed.stop is None
    assert evaluations[-1].level == "ERROR"  # 30 of 90 rows dropped
    assert "this run's own rows are within the ERROR level" in evaluations[-1].alarms[0].note
    assert fixed.snapshot()["rows_earlier_runs"] == 30 and fixed.snapshot()["rows_this_run"] == 60

    # not fixed: stopped once this run has its own warm-up rows, not before
    unfixed = _monitor()
    unfixed.seed(broken)
    # evaluations at 31, 36 and 41 rows (1, 6 and 11 of this run): the first one past this run's warm-up stops it
    evaluations = _feed(unfixed, [_row(f"new{i}", 40, 0, "length") for i in range(11)])
    assert [e.rows for e in evaluations] == [31, 36, 41]
    assert [e.stop is not None for e in evaluations] == [False, False, True]
    assert "not judged yet" in evaluations[0].alarms[0].note
    with pytest.raises(RuntimeError):
        unfixed.seed(broken)


# ------------------------------------------------------------------------------------------- real HTTP + Parquet
def _prompt(i: int) -> list[int]:
    return [8 + (i * 53 + k * 17) % (VOCAB - 8) for k in range(5 + i % 7)]


def _client(url: str) -> GenerateClient:
    return GenerateClient([url], concurrency_per_server=CONCURRENCY, timeout_s=10, backoff_base_s=0.05)


def _shard_rows(out: Path) -> list[dict]:
    table = read_shards(out)
    return [] if table is None else table.to_pylist()


def _live(out: Path) -> dict:
    return json.loads((out / LIVE_STATS_FILE).read_text())


def test_mostly_truncated_server_is_stopped_after_warmup_and_rerun_resumes(tmp_path):
    live = LiveSpec(warmup_rows=50, report_every_rows=25, log_every_s=0.2)
    prompts = [(f"s{i:04d}", _prompt(i)) for i in range(400)]
    assert 0.75 < sum(stub_truncates(sid, 0.8) for sid, _ in prompts) / len(prompts) < 0.85
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=[STOP])
    out = tmp_path / "gen"
    alarms: list[str] = []
    stub = StubServer(vocab_size=VOCAB, think_end_id=THINK_END, truncate_share=0.8)
    with serve_stub_in_thread(stub) as running:
        monitor = LiveQualityMonitor(PROFILE, Thresholds(short_tokens=5), live, partition="P")
        stats = run_generation(prompts, out, _client(running.url), sampling, VOCAB, flush_rows=16,
                               progress=lambda m: None, alarm=alarms.append, monitor=monitor)
    sent = set(stub.stats.per_rid)

    assert stats.stopped_early and "share_dropped" in stats.stop_reason
    assert stats.failed == 0 and stats.succeeded == len(sent) == stub.stats.requests
    snap = _live(out)
    assert snap["stopped"] and snap["final"] and snap["stop"]["figure"] == "share_dropped"
    assert snap["stop"]["value"] > 0.5 and snap["stop"]["threshold"] == 0.2 and len(snap["stop"]["example_ids"]) == 3
    # The stop is decided at an evaluation, after warmup_rows rows or one report later (80% cut replies break the
    # 20% ERROR level at once). The row that completes that evaluation frees its worker, which then finds the item
    # iterator ended; each of the other CONCURRENCY - 1 workers holds at most one request already sent. So at most
    # CONCURRENCY - 1 rows arrive after the deciding one, and none is sent after it.
    decided_at = snap["stop"]["rows"]
    assert decided_at in (live.warmup_rows, live.warmup_rows + live.report_every_rows)
    assert len(sent) <= decided_at + CONCURRENCY - 1 <= live.warmup_rows + live.report_every_rows + CONCURRENCY - 1
    assert stats.not_sent == len(prompts) - len(sent)
    # every row received is on disk, once
    rows = _shard_rows(out)
    assert len(rows) == stats.succeeded and {r["sample_id"] for r in rows} == sent
    assert snap["rows"] == len(rows) and snap["generation"]["not_sent"] == stats.not_sent
    assert pq.read_table(out / FAILURES_FILE).num_rows == 0  # unsent prompts are not failures
    assert any(a.startswith("stopping generation of P") for a in alarms)

    # The server is fixed; the rerun resumes: no done id is requested again, and the earlier run's broken rows
    # (still counted in the partition's figures) do not stop it.
    healthy = StubServer(vocab_size=VOCAB, think_end_id=THINK_END)
    with serve_stub_in_thread(healthy) as running:
        monitor = LiveQualityMonitor(PROFILE, Thresholds(short_tokens=5), live, partition="P")
        again = run_generation(prompts, out, _client(running.url), sampling, VOCAB, flush_rows=64,
                               progress=lambda m: None, alarm=alarms.append, monitor=monitor)
    assert not again.stopped_early and again.skipped_done == len(sent)
    assert not set(healthy.stats.per_rid) & sent and healthy.stats.requests == len(prompts) - len(sent)
    rows = _shard_rows(out)
    assert len(rows) == len({r["sample_id"] for r in rows}) == len(prompts)
    snap = _live(out)
    assert not snap["stopped"] and snap["rows"] == len(prompts) and snap["rows_earlier_runs"] == len(sent)


def test_healthy_run_is_never_stopped_and_live_stats_update_while_it_runs(tmp_path):
    live = LiveSpec(warmup_rows=50, report_every_rows=25, log_every_s=0.2)
    prompts = [(f"h{i:04d}", _prompt(i)) for i in range(200)]
    # lengths 1..400 ids: under 1% of replies are too short to hold an answer or hit the cap
    sampling = SamplingParams(max_new_tokens=400, temperature=0.0, stop_token_ids=[STOP])
    out = tmp_path / "gen"
    out.mkdir()
    seen_rows: list[int] = []
    done = threading.Event()

    def watch() -> None:  # what a user running `watch cat live_stats.json` sees
        path = out / LIVE_STATS_FILE
        while True:
            # one last read after the run ended: on a loaded machine this thread may sleep through the final write
            last = done.is_set()
            if path.exists():
                rows = json.loads(path.read_text())["rows"]
                if not seen_rows or seen_rows[-1] != rows:
                    seen_rows.append(rows)
            if last:
                return
            time.sleep(0.005)

    messages: list[str] = []
    alarms: list[str] = []
    # 20 ms per reply, 4 in flight: about 1 s in all, 0.12 s between reports
    stub = StubServer(vocab_size=VOCAB, think_end_id=THINK_END, latency_s=0.02)
    watcher = threading.Thread(target=watch, daemon=True)
    with serve_stub_in_thread(stub) as running:
        monitor = LiveQualityMonitor(PROFILE, Thresholds(short_tokens=20), live, partition="H")
        watcher.start()
        t0 = time.monotonic()
        try:
            stats = run_generation(prompts, out, _client(running.url), sampling, VOCAB, progress=messages.append,
                                   progress_every_s=60, alarm=alarms.append, monitor=monitor)
        finally:
            wall = time.monotonic() - t0
            done.set()
            watcher.join(5)

    assert not stats.stopped_early and stats.not_sent == 0 and stats.succeeded == len(prompts)
    assert not any(a.startswith("stopping") or "ERROR" in a for a in alarms), alarms
    snap = _live(out)
    assert snap["final"] and not snap["stopped"] and snap["rows"] == len(prompts)
    assert snap["level"] in ("OK", "WARN") and snap["evaluated_at_rows"] == len(prompts)
    assert snap["share_dropped"] < 0.05 and snap["completion_tokens"]["median"] > 20
    # rewritten at every report (every 25 rows) while the run went on, not only at the end
    assert len(seen_rows) >= 3 and seen_rows == sorted(seen_rows) and seen_rows[-1] == len(prompts), seen_rows
    # the live summary line reaches the log at most every log_every_s (plus the final one)
    live_lines = [m for m in messages if m.startswith("live quality of H")]
    assert 1 <= len(live_lines) <= wall / live.log_every_s + 2


# -------------------------------------------------------------------------------------------------- Dagster
def test_generations_asset_fails_fast_with_a_clear_description_and_keeps_rows(demo_target, tmp_path):
    import dagster as dg
    import yaml

    from eagle_assets.assets.server_resource import SGLangServerResource
    from eagle_assets.definitions import build_definitions

    repo = Path(__file__).resolve().parents[1]
    catalog = yaml.safe_load((repo / "catalogs" / "default.yaml").read_text())
    catalog.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    part = catalog["partitions"]["B1_glaive"]
    part["prompt_policy"] = "last_user"
    part["sources"] = [{"path": str(repo / "catalogs" / "demo_data" / "B1_glaive.json"), "format": "glaive"}]
    part["limit"] = 40
    part["sampling"]["max_new_tokens"] = 16
    part["live"] = {"warmup_rows": 8, "report_every_rows": 4}
    catalog["partitions"] = {"B1_glaive": part}
    catalog["server"]["concurrency"] = 2
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog))
    vocab = json.loads((demo_target / "config.json").read_text())["vocab_size"]
    stub = StubServer(vocab_size=vocab, truncate_share=1.0)  # every reply cut at max_new_tokens
    with serve_stub_in_thread(stub) as running, dg.DagsterInstance.ephemeral() as instance:
        defs = build_definitions(path, storage_root=tmp_path / "store", sglang=SGLangServerResource(urls=[running.url]))
        assets = [a for a in defs.assets
                  if len(a.keys) == 1 and a.key.path[0] in ("raw_prompts", "tokenized_prompts", "generations")]
        result = dg.materialize(assets, partition_key="B1_glaive", instance=instance, resources=defs.resources,
                                raise_on_error=False)
    assert not result.success
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1 and failures[0].step_key == "generations"
    description = failures[0].step_failure_data.user_failure_data.description
    assert "stopped early by live quality monitoring" in description
    assert "share_dropped" in description and "ERROR level 0.2" in description and "examples:" in description
    assert "fail_fast: false" in description and "max_new_tokens" in description
    out = tmp_path / "store" / "catalog" / "generations" / "B1_glaive"
    rows = _shard_rows(out)
    assert len(rows) == stub.stats.requests <= 8 + 4 + 2 - 1  # nothing received is lost, little is sent
    assert _live(out)["stopped"]
