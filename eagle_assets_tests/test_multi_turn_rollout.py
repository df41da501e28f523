"""``generations.rollout.run_conversations`` without Dagster: failed turn requests and live fail-fast stops end
conversations with a non-final reason, and the next run resumes them at that turn.

Server: ``ScriptedQwen3Server`` of ``test_multi_turn_pipeline`` (the stub server with replies scripted in the real
Qwen3 tokenizer's ids), with the stub's own fault injection (HTTP 500) for the failure case.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from test_multi_turn_pipeline import ScriptedQwen3Server, _rows

from eagle_assets.catalog import LiveSpec, Thresholds
from eagle_assets.generations.rollout import CONVERSATIONS_FILE, RolloutSettings, run_conversations
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets_tests.servers.stub_server import serve_stub_in_thread

DATASET = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": ""},
           {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": ""},
           {"role": "user", "content": "And a third?"}]


@pytest.fixture(scope="module")
def qwen(shared_data):
    from eagle_assets.target_model import detect_profile, load_tokenizer

    tok = load_tokenizer(shared_data / "tokenizers" / "qwen3-0.6b")
    return tok, detect_profile(tok)


def _run(tok, prof, url, out, convs, **kw):
    settings = RolloutSettings(tokenizer=tok, profile=prof, tools={}, vocab_size=len(tok), enable_thinking=True)
    client = GenerateClient([url], concurrency_per_server=2, max_attempts=2, backoff_base_s=0.01, cooldown_s=0.01) \
        if "fault" in kw.pop("note", "") else GenerateClient([url], concurrency_per_server=2)
    return run_conversations(convs, out, client, SamplingParams(max_new_tokens=48, stop_token_ids=list(prof.stop_ids)),
                             settings, **kw)


def _ends(out):
    return {(c["sample_id"], c["end_reason"], c["turns"]) for c in pq.read_table(out / CONVERSATIONS_FILE).to_pylist()}


def test_a_failed_turn_request_is_counted_and_resumed_at_that_turn(qwen, tmp_path):
    tok, prof = qwen
    convs = [(f"c{i}", DATASET) for i in range(3)]
    server = ScriptedQwen3Server(tok, {})
    server.fault = lambda rid, attempt, body: "http_500" if rid == "c1:on:2" else None
    with serve_stub_in_thread(server) as running:
        stats = _run(tok, prof, running.url, tmp_path, convs, note="fault")
        assert _ends(tmp_path) == {("c0", "complete", 3), ("c2", "complete", 3), ("c1", "request_failed", 1)}
        assert stats.failed >= 1 and stats.summary()["ends_by_turn"]["2"] == {"request_failed": 1}
        assert stats.rows_by_turn == {1: 3, 2: 2, 3: 2}
        # sent in one round only (2 attempts), not again in round 3; its failure row is kept
        assert server.stats.per_rid["c1:on:2"] == 2 and stats.rounds == 3
        failures = pq.read_table(tmp_path / "failures.parquet").to_pylist()
        assert [(f["sample_id"], f["kind"]) for f in failures] == [("c1:on:2", "http_5xx")]
        server.fault = None
        before = dict(server.stats.per_rid)
        again = _run(tok, prof, running.url, tmp_path, convs)
    assert _ends(tmp_path) == {(f"c{i}", "complete", 3) for i in range(3)}
    sent = {rid: n - before.get(rid, 0) for rid, n in server.stats.per_rid.items() if n - before.get(rid, 0)}
    assert sent == {"c1:on:2": 1, "c1:on:3": 1}  # only the missing turns of the failed conversation
    assert again.rows_by_turn == {1: 3, 2: 3, 3: 3} and len(_rows(tmp_path)) == 9


def test_live_fail_fast_stops_between_turns_keeps_rows_and_resumes(qwen, tmp_path):
    from eagle_assets.qc.live import LiveQualityMonitor

    tok, prof = qwen
    convs = [(f"c{i}", DATASET) for i in range(6)]

    class Rambling(ScriptedQwen3Server):  # turn 2 never closes its reasoning: cut at max_new_tokens
        def script(self, prompt):
            text = super().script(prompt)
            return "<think>\n" + "and so on " * 40 if prompt.count("<|im_start|>assistant") == 2 else text

    def make(opens, prompt_ids):
        return LiveQualityMonitor(prof, Thresholds(short_tokens=2, max_share_dropped_error=0.3,
                                             max_share_truncated_warn=1.0, max_share_truncated_error=1.0),
                                  LiveSpec(warmup_rows=8, report_every_rows=1), prompt_opens_think=opens,
                                  prompt_ids=prompt_ids, partition="P")

    server = Rambling(tok, {})
    with serve_stub_in_thread(server) as running:
        stats = _run(tok, prof, running.url, tmp_path, convs, make_monitor=make)
        # round 1 (6 good turn-1 rows) is under the 8 warm-up rows; round 2 judges the call's rows, both rounds
        assert stats.stopped_early and "share_dropped" in stats.stop_reason and stats.rounds == 2
        ends = _ends(tmp_path)
        assert {r for _, r, _ in ends} <= {"qc_dropped", "not_generated"} and any(r == "qc_dropped" for _, r, _ in ends)
        assert stats.monitor.snapshot()["by_turn"]["2"]["drop_reasons"] == {
            "truncated_in_reasoning": stats.rows_by_turn[2]}
        kept = len(_rows(tmp_path))
        stopped = _run(tok, prof, running.url, tmp_path, convs)  # no monitor: every remaining turn 2 is sent
    assert not stopped.stopped_early and len(_rows(tmp_path)) == kept + stopped.succeeded == 12
    assert {(r, n) for _, r, n in _ends(tmp_path)} == {("qc_dropped", 1)}  # each ends at turn 2, counted


class EchoingQwen3Server(ScriptedQwen3Server):
    """``ScriptedQwen3Server`` whose replies to the rids of ``echo(rid, attempt) -> True`` start with the turn
    prompt's last 2 ids (``assistant\\n``: ordinary ids), counted in ``completion_tokens``: the counts agree and no
    control id is echoed, so only the reply's shape (a ``<think>`` after them) betrays the echo."""

    def __init__(self, tokenizer, echo):
        super().__init__(tokenizer, {})
        self.echo = echo

    def reply(self, body: dict, started: float) -> dict:
        good = super().reply(body, started)
        rid = str(body.get("rid"))
        if self.echo(rid, self.stats.per_rid[rid]):
            good["output_ids"] = list(body["input_ids"][-2:]) + good["output_ids"]
            good["meta_info"]["completion_tokens"] = len(good["output_ids"])
        return good


def test_a_turn_whose_reply_echoes_the_prompt_tail_is_retried_then_failed_never_stored(qwen, tmp_path):
    tok, prof = qwen
    convs = [(f"c{i}", DATASET) for i in range(3)]
    server = EchoingQwen3Server(tok, lambda rid, attempt: rid == "c1:on:2" or (rid == "c2:on:2" and attempt == 1))
    with serve_stub_in_thread(server) as running:
        stats = _run(tok, prof, running.url, tmp_path, convs, note="fault")
    assert tok.decode(pq.read_table(tmp_path / "turns.parquet").to_pylist()[0]["prompt_ids"][-2:]) == "assistant\n"
    assert _ends(tmp_path) == {("c0", "complete", 3), ("c2", "complete", 3), ("c1", "request_failed", 1)}
    failures = pq.read_table(tmp_path / "failures.parquet").to_pylist()
    assert [(f["sample_id"], f["kind"], f["attempts"]) for f in failures] == [("c1:on:2", "prompt_echo", 2)]
    rows = {r["sample_id"]: r for r in _rows(tmp_path)}
    assert "c1:on:2" not in rows and rows["c2:on:2"]["attempts"] == 2  # retried, then the good reply
    assert stats.rows_by_turn == {1: 3, 2: 2, 3: 2}
