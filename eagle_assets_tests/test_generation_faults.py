"""``run_generation`` end to end against a real HTTP server that misbehaves on purpose.

The server is ``eagle_assets_tests.servers.stub_server.StubServer`` on 127.0.0.1 (aiohttp, its own event loop in a
thread): replies are a pure function of the prompt, so every row that reaches a shard can be checked id by id, and
faults are scripted per sample id and attempt. The client is the real ``GenerateClient``; the shards and the
failures table are real Parquet files read back with pyarrow.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import zlib
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_assets.generations.run import FAILURES_FILE, LOCK_FILE, PartitionBusyError, run_generation
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets.storage.shards import read_shards, shard_paths
from eagle_assets_tests.servers.stub_server import SGLANG_ECHO_IDS, StubServer, serve_stub_in_thread, stub_output_ids

VOCAB = 500
STOP = 2
SP = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[STOP])
SECRET = "sk-never-print-this-7f3a"
TIMEOUT_S = 0.3
# fault -> the failure kind the client must record when the fault happens on every attempt
PERSISTENT = {
    "http_500": "http_5xx",
    "http_400": "bad_request",
    "abort": "abort",
    "truncated": "bad_json",
    "ct_mismatch": "length_mismatch",
    "echo": "prompt_echo",
    "oov": "id_out_of_vocab",
    "drop": "connection",
    "reset": "connection",
    "hang": "timeout",
    "echo_auth": "http_5xx",
}
TRANSIENT = ["http_500", "http_503", "http_429", "abort", "truncated", "ct_mismatch", "echo", "oov", "drop", "reset",
             "hang"]


def _prompt(i: int) -> list[int]:
    return [8 + (i * 53 + k * 17) % (VOCAB - 8) for k in range(5 + i % 7)]


def _expected(prompt: list[int]) -> tuple[list[int], str]:
    ids, finish = stub_output_ids(prompt, SP.max_new_tokens, VOCAB, SP.stop_token_ids)
    return ids, finish["type"]


class Script:
    """Fault plan: a burst of 503s for every request in the first ``burst_s`` seconds, then per-rid faults."""

    def __init__(self, burst_s: float = 0.3):
        self.burst_s = burst_s
        self.t0: float | None = None
        self.transient_done: set[str] = set()

    def __call__(self, rid: str, attempt: int, body: dict) -> str | None:
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        if now - self.t0 < self.burst_s:
            return "http_503"
        kind, _, fault = rid.partition(":")
        if kind == "always":
            return fault
        if kind == "once" and rid not in self.transient_done:
            self.transient_done.add(rid)
            return fault
        return None


def _client(url: str, **kw) -> GenerateClient:
    kw.setdefault("max_attempts", 5)
    return GenerateClient([url], concurrency_per_server=8, timeout_s=TIMEOUT_S, backoff_base_s=0.05,
                          backoff_max_s=0.5, **kw)


def _rows(out_dir) -> dict[str, dict]:
    table = read_shards(out_dir)
    rows = [] if table is None else table.to_pylist()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), f"duplicate sample ids in shards: {Counter(ids).most_common(3)}"
    return {r["sample_id"]: r for r in rows}


def _assert_rows_are_exact(rows: dict[str, dict], prompts: dict[str, list[int]]) -> None:
    for sid, row in rows.items():
        ids, finish = _expected(prompts[sid])
        assert row["output_ids"] == ids, sid
        assert row["finish_reason"] == finish and row["completion_tokens"] == len(ids), sid
        assert row["prompt_tokens"] == len(prompts[sid])
        assert row["matched_stop"] == (STOP if finish == "stop" else None)


def test_faults_become_failure_rows_and_never_reach_a_shard(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_TEST_KEY", SECRET)
    prompts = {f"ok:{i}": _prompt(i) for i in range(40)}
    prompts.update({f"always:{f}": _prompt(100 + j) for j, f in enumerate(PERSISTENT)})
    prompts.update({f"once:{f}": _prompt(200 + j) for j, f in enumerate(TRANSIENT)})
    prompts["bad_input:oov_prompt"] = [5, VOCAB + 1]
    out = tmp_path / "gen"
    messages: list[str] = []
    stub = StubServer(vocab_size=VOCAB, fault=Script(), hang_s=3 * TIMEOUT_S)
    with serve_stub_in_thread(stub) as running:
        client = _client(running.url, api_key_env="EAGLE_TEST_KEY")
        t0 = time.monotonic()
        stats = run_generation(list(prompts.items()), out, client, SP, VOCAB, flush_rows=7, progress=messages.append,
                               progress_every_s=0.25)
        wall = time.monotonic() - t0
        sent = Counter(stub.stats.per_rid)
        burst = stub.stats.faults["http_503"]

    rows = _rows(out)
    failures = {f["sample_id"]: f for f in pq.read_table(out / FAILURES_FILE).to_pylist()}
    good = {s for s in prompts if s.startswith(("ok:", "once:"))}
    assert set(rows) == good, "every healthy or transiently failing request must end as exactly one row"
    _assert_rows_are_exact(rows, prompts)
    assert {s: f["kind"] for s, f in failures.items()} == {
        **{f"always:{f}": kind for f, kind in PERSISTENT.items()}, "bad_input:oov_prompt": "bad_input"}
    assert not set(failures) & set(rows)
    # attempts are what the server saw; a refusal (400) is not retried once it is reached
    for sid, f in failures.items():
        assert f["attempts"] == sent[sid], sid
        assert f["last_error"]
    assert failures["always:http_400"]["attempts"] <= 2  # one burst 503 at most, then the refusal
    assert all(failures[f"always:{f}"]["attempts"] == 5 for f in PERSISTENT if f != "http_400")
    assert "prompt" in failures["always:echo"]["last_error"]  # prompt-tail ids are named as such
    assert failures["bad_input:oov_prompt"]["attempts"] == 0 and "bad_input:oov_prompt" not in sent
    for sid in good:
        assert rows[sid]["attempts"] == sent[sid]
    assert all(rows[f"once:{f}"]["attempts"] >= 2 for f in TRANSIENT)

    assert burst >= 8, "the burst must have hit many requests"
    assert stats.requested == len(prompts) and stats.succeeded == len(good) and stats.failed == len(failures)
    assert stats.retried == sum(sent.values()) - (len(prompts) - 1)
    assert stats.finish_reasons == Counter(row["finish_reason"] for row in rows.values())
    summary = stats.summary()
    for key in ("requested", "succeeded", "failed", "retried", "finish_reasons", "requests_per_s",
                "output_tokens_per_s", "latency_p50_ms", "latency_p99_ms"):
        assert key in summary
    assert summary["failure_kinds"]["connection"] == 2 and summary["latency_p99_ms"] >= summary["latency_p50_ms"] > 0
    # progress comes from a timer: bounded by the wall time, never one line per request
    assert 1 <= len(messages) <= wall / 0.25 + 2 < len(prompts)
    assert messages[-1].startswith("generation finished")
    # the key never leaves the client, even when a server echoes the request headers into its error body
    assert "Bearer ***" in failures["always:echo_auth"]["last_error"]
    shown = repr(summary) + "".join(messages) + repr(pq.read_table(out / FAILURES_FILE).to_pylist()) + repr(client)
    assert SECRET not in shown
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())

    # a later materialization against a healed server sends only the failed ids and clears the failures table
    with serve_stub_in_thread(StubServer(vocab_size=VOCAB)) as healed:
        again = run_generation(list(prompts.items()), out, _client(healed.url, api_key_env="EAGLE_TEST_KEY"), SP,
                               VOCAB)
        resent = set(healed.stub.stats.per_rid)
    assert resent == set(failures) - {"bad_input:oov_prompt"}
    assert again.skipped_done == len(good) and again.succeeded == len(PERSISTENT)
    rows = _rows(out)
    assert set(rows) == set(prompts) - {"bad_input:oov_prompt"}
    _assert_rows_are_exact(rows, prompts)
    assert [f["sample_id"] for f in pq.read_table(out / FAILURES_FILE).to_pylist()] == ["bad_input:oov_prompt"]


def test_requests_are_sglang_native_and_a_finished_partition_sends_no_request(tmp_path):
    prompts = [(f"s{i}", _prompt(i)) for i in range(30)]
    out = tmp_path / "gen"
    with serve_stub_in_thread(StubServer(vocab_size=VOCAB, keep_bodies=True)) as running:
        first = run_generation(prompts, out, _client(running.url), SP, VOCAB, flush_rows=8)
        n_shards = len(shard_paths(out))
        before = running.stub.stats.requests
        second = run_generation(prompts + prompts[:3], out, _client(running.url), SP, VOCAB)
        assert running.stub.stats.requests == before == 30
        bodies = running.stub.bodies
    # rid = sample id; explicit max_new_tokens (SGLang would default to 128), stop ids, special tokens kept
    assert sorted(b["rid"] for b in bodies) == sorted(sid for sid, _ in prompts)
    assert all(b["input_ids"] == dict(prompts)[b["rid"]] for b in bodies)
    assert all(b["sampling_params"] == {"max_new_tokens": 24, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                        "skip_special_tokens": False, "stop_token_ids": [STOP]} for b in bodies)
    assert first.succeeded == 30 and n_shards == 4
    assert (second.prompts, second.requested, second.skipped_done, second.succeeded) == (30, 0, 30, 0)
    assert len(shard_paths(out)) == n_shards and len(_rows(out)) == 30
    with serve_stub_in_thread(StubServer(vocab_size=VOCAB)) as running:
        third = run_generation(prompts, out, _client(running.url), SP, VOCAB, regenerate=True)
        assert running.stub.stats.requests == 30  # only the regenerate option sends requests again
    assert third.requested == 30 and len(shard_paths(out)) == 1 and len(_rows(out)) == 30


def test_partial_buffer_is_flushed_by_the_timer_while_a_slow_request_runs(tmp_path):
    # 20 quick replies, then one that takes ~1 s: with flush_rows far above 20 only the timer can write them early
    prompts = [(f"q{i}", _prompt(i)) for i in range(20)] + [("always:hang", _prompt(99))]
    out = tmp_path / "gen"
    seen_mid_run: list[int] = []

    def progress(message: str) -> None:
        if not message.startswith("generation finished"):
            seen_mid_run.append(len(_rows(out)))

    stub = StubServer(vocab_size=VOCAB, fault=Script(burst_s=0.0), hang_s=1.0)
    with serve_stub_in_thread(stub) as running:
        client = GenerateClient([running.url], concurrency_per_server=4, timeout_s=5.0, max_attempts=1)
        stats = run_generation(prompts, out, client, SP, VOCAB, flush_rows=1000, flush_seconds=0.2,
                               progress=progress, progress_every_s=0.4)
    assert stats.succeeded == 21 and stats.shards_written == 2
    assert seen_mid_run and max(seen_mid_run) == 20, seen_mid_run


def test_one_writer_per_partition_and_stale_temp_files_are_removed(tmp_path):
    out = tmp_path / "gen"
    out.mkdir()
    stale = out / ".shard-00000.parquet.k1ll3d.tmp"
    stale.write_bytes(b"half a parquet file")
    prompts = [(f"s{i}", _prompt(i)) for i in range(5)]
    with serve_stub_in_thread(StubServer(vocab_size=VOCAB)) as running:
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer holds the partition
            with pytest.raises(PartitionBusyError, match="another process is generating"):
                run_generation(prompts, out, _client(running.url), SP, VOCAB)
            assert running.stub.stats.requests == 0 and stale.exists()
        finally:
            os.close(fd)
        stats = run_generation(prompts, out, _client(running.url), SP, VOCAB)
    assert stats.succeeded == 5 and not stale.exists()
    assert len(_rows(out)) == 5


def test_redaction_covers_the_key_and_url_credentials(monkeypatch):
    monkeypatch.setenv("EAGLE_TEST_KEY", SECRET)
    client = GenerateClient(["http://127.0.0.1:1"], api_key_env="EAGLE_TEST_KEY")
    text = client.redact(f"proxy said: Authorization: Bearer {SECRET} at http://user:pw@10.0.0.1:8000/generate")
    assert SECRET not in text and "user:pw" not in text
    assert text == "proxy said: Authorization: Bearer *** at http://***@10.0.0.1:8000/generate"


# ------------------------------------------------------------------ a prompt echo counted in completion_tokens
IM_START, ASSISTANT, NL = 3, 77, 10  # a generation prompt: a control id, then ordinary ids
CONTROL = frozenset({STOP, IM_START})


def _chat_prompt(i: int) -> list[int]:
    return _prompt(i) + [IM_START, ASSISTANT, NL]


def _echo_half(rid: str, attempt: int, body: dict) -> str | None:
    kind, _, n = rid.partition(":")
    if kind == "s":
        return "echo_counted" if zlib.crc32(rid.encode()) % 2 else None
    if kind == "once":
        return "echo_counted" if attempt == 1 else None
    if kind == "tail":
        return "tail_like"
    return None


def test_counted_prompt_echo_is_retried_then_a_failure_and_never_a_row(tmp_path):
    # 300 replies, half of them echoing the prompt's last 5 ids WITH completion_tokens counting them (the counts
    # agree), as some SGLang versions answer; plus transient echoes and replies that legitimately begin with the
    # prompt's last (ordinary) ids.
    prompts = {f"s:{i}": _chat_prompt(i) for i in range(300)}
    prompts.update({f"once:{i}": _chat_prompt(400 + i) for i in range(10)})
    prompts.update({f"tail:{i}": _chat_prompt(500 + i) for i in range(10)})
    echoing = {s for s in prompts if s.startswith("s:") and zlib.crc32(s.encode()) % 2}
    assert 120 < len(echoing) < 180
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=[STOP])
    out = tmp_path / "gen"
    with serve_stub_in_thread(StubServer(vocab_size=VOCAB, fault=_echo_half)) as running:
        stats = run_generation(list(prompts.items()), out, _client(running.url, max_attempts=3), sp, VOCAB,
                               control_ids=CONTROL)
        sent = Counter(running.stub.stats.per_rid)
    rows = _rows(out)
    failures = {f["sample_id"]: f for f in pq.read_table(out / FAILURES_FILE).to_pylist()}
    assert set(failures) == echoing and set(rows) == set(prompts) - echoing
    assert all(f["kind"] == "prompt_echo" and f["attempts"] == 3 == sent[s] for s, f in failures.items())
    assert "last 5 prompt ids" in next(iter(failures.values()))["last_error"]
    assert all(rows[f"once:{i}"]["attempts"] == 2 for i in range(10))  # retried, then the good reply
    for i in range(10):  # kept: the first ids equal the prompt's last ids, but they are ordinary ids
        row = rows[f"tail:{i}"]
        assert row["output_ids"][:2] == [ASSISTANT, NL] and row["attempts"] == 1
    assert stats.failure_kinds == Counter({"prompt_echo": len(echoing)})


def test_qc_drops_counted_echoes_that_another_producer_stored(tmp_path):
    # The report: against a server echoing half of 300 replies with matching counts, an older client stored them as
    # good rows. Such shards (written here as that producer wrote them: the stub's replies, echo included, counts
    # agreeing) are what QC gets; segment_row, QC's call, must name every echo and keep every other row.
    from eagle_assets.generations.run import GENERATION_SCHEMA
    from eagle_assets.structure.segment import segment_row
    from eagle_assets.target_model.profile import FamilyProfile

    prompts = {f"s:{i}": _chat_prompt(i) for i in range(300)}
    prompts.update({f"tail:{i}": _chat_prompt(500 + i) for i in range(10)})
    echoing = {s for s in prompts if s.startswith("s:") and zlib.crc32(s.encode()) % 2}
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=[STOP])
    rows = []
    for sid, prompt in prompts.items():
        ids, finish = stub_output_ids(prompt, sp.max_new_tokens, VOCAB, sp.stop_token_ids)
        if sid in echoing:
            ids = prompt[-SGLANG_ECHO_IDS:] + ids
        elif sid.startswith("tail:"):
            ids = prompt[-2:] + ids[2:]
        rows.append({"sample_id": sid, "output_ids": ids, "finish_reason": finish["type"],
                     "matched_stop": finish.get("matched"), "completion_tokens": len(ids),
                     "prompt_tokens": len(prompt), "latency_s": 0.0, "attempts": 1,
                     "sampling_params": json.dumps(sp.to_json())})
    out = tmp_path / "gen"
    out.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), out / "shard-00000.parquet")
    profile = FamilyProfile("custom", None, None, (), (), STOP, (STOP,))
    stored = _rows(out)
    reasons = {s: segment_row(r, profile, prompt_opens_think=False, prompt_ids=prompts[s], vocab_size=VOCAB,
                              control_ids=CONTROL).drop_reason for s, r in stored.items()}
    assert {s for s, why in reasons.items() if why == "prompt_echo"} == echoing
    assert all(reasons[s] in (None, "truncated_in_answer") for s in stored if s not in echoing)
    assert [reasons[f"tail:{i}"] for i in range(10)].count(None) >= 5  # begins like the prompt's end, kept


# -------------------------------- an echo of ordinary prompt ids, counted: only the reply's shape betrays it (issue 27)
QWEN3_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / "qwen3-0.6b"


class QwenEchoServer(StubServer):
    """The stub's HTTP server and fault machinery, answering with real Qwen3 replies (ids of the real tokenizer):
    ``s:`` / ``once:`` rids get ``<think>\\n...\\n</think>\\n\\nanswer<|im_end|>``; ``cut:`` rids a reasoning cut at
    ``max_new_tokens`` (finish ``length``); ``tail:`` rids a whole reply without reasoning that begins with the
    prompt's last 1 or 2 ids. ``echo(rid, attempt) -> k`` puts the prompt's last k ids in front, COUNTED in
    ``completion_tokens`` (a cut keeps the cap: echo + reasoning = max_new_tokens ids), as a server echoing
    SGLang's detokenization window answers: the counts agree."""

    def __init__(self, tok, echo):
        super().__init__(vocab_size=len(tok))
        self.tok, self.echo = tok, echo
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def enc(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def reply(self, body: dict, started: float) -> dict:
        rid, prompt = str(body["rid"]), list(body["input_ids"])
        kind, i = rid.split(":")[0], int(rid.split(":")[1])
        cap = int(body["sampling_params"]["max_new_tokens"])
        k = self.echo(rid, self.stats.per_rid[rid])
        finish = {"type": "stop", "matched": self.im_end}
        if kind == "cut":
            ids = self.enc("<think>\nLet me add " + " and ".join(str(j) for j in range(i, i + 60)))[: cap - k]
            finish = {"type": "length", "length": cap}
        elif kind == "tail":
            ids = prompt[-(1 + i % 2):] + self.enc(f"The sum is {2 * i + 1}.<|im_end|>")
        else:
            ids = self.enc(f"<think>\nAdd {i} and {i + 1}.\n</think>\n\n{2 * i + 1}<|im_end|>")
        ids = prompt[-k:] + ids if k else ids
        return {"text": "", "output_ids": ids, "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(ids),
            "cached_tokens": 0, "e2e_latency": 0.0}}


def _shape_echo(rid: str, attempt: int) -> int:
    """k ids echoed: half of the ``s:`` and ``cut:`` rids on every attempt (1 or 2 ids: Qwen3's generation prompt
    ends ``assistant\\n``, ordinary ids), ``once:`` rids on the first attempt only, ``tail:`` rids never."""
    kind = rid.partition(":")[0]
    h = zlib.crc32(rid.encode())
    if kind in ("s", "cut"):
        return 1 + (h >> 1) % 2 if h % 2 else 0
    return 1 + h % 2 if kind == "once" and attempt == 1 else 0


def test_echo_that_only_the_reply_shape_betrays_is_retried_then_a_failure_and_qc_names_it(tmp_path):
    # The report: 300 replies, half echoing the prompt's last ids with counts that agree, and no control id among
    # the echoed ids; about half were stored as good rows. With the generation stage's structure check none is.
    if not QWEN3_DIR.exists():
        pytest.skip(f"../shared/data is absent: {QWEN3_DIR} not found")
    from eagle_assets.qc.qc_pass import qc_partition
    from eagle_assets.structure.segment import StructureCheck, segment_row
    from eagle_assets.target_model import detect_profile, load_tokenizer, render_prompt
    from eagle_assets.target_model.profile import target_vocab_size
    from eagle_assets.target_model.render import control_token_ids
    from eagle_assets.target_model.setup import blank_token_ids
    from eagle_assets.tokenized_prompts.prompts_file import PromptsFile

    tok = load_tokenizer(QWEN3_DIR)
    profile = detect_profile(tok)
    vocab, control, blank = target_vocab_size(QWEN3_DIR, tok), control_token_ids(tok), blank_token_ids(tok)
    sids = [f"s:{i}" for i in range(300)] + [f"once:{i}" for i in range(10)] + [f"cut:{i}" for i in range(20)] + \
        [f"tail:{i}" for i in range(10)]
    rendered = {sid: render_prompt(tok, [{"role": "user", "content": f"What is {n} + {n + 1}? ({sid})"}], None,
                                   profile=profile) for n, sid in enumerate(sids)}
    table = pa.table({"sample_id": sids, "prompt_ids": pa.array([rendered[s].prompt_ids for s in sids],
                                                                  pa.list_(pa.int32())),
                      "prompt_opens_think": [rendered[s].opens_think for s in sids]})
    assert tok.decode(rendered["s:0"].prompt_ids[-2:]) == "assistant\n" and not rendered["s:0"].opens_think
    echoing = {s for s in sids if s.startswith(("s:", "cut:")) and _shape_echo(s, 1)}
    assert 120 < len({s for s in echoing if s.startswith("s:")}) < 180
    assert all(not any(t in control for t in rendered[s].prompt_ids[-_shape_echo(s, 1):]) for s in echoing)
    sp = SamplingParams(max_new_tokens=48, temperature=0.0, stop_token_ids=list(profile.stop_ids))

    def generate(out, well_formed):
        prompts = PromptsFile.from_table(table)
        with serve_stub_in_thread(QwenEchoServer(tok, _shape_echo)) as running:
            stats = run_generation(prompts, out, _client(running.url, max_attempts=3), sp, vocab,
                                   control_ids=control, well_formed=well_formed)
            return stats, Counter(running.stub.stats.per_rid)

    # as the generations asset builds it: QC's rules, tokenized_prompts' prompt_opens_think, the partition's policy
    prompts = PromptsFile.from_table(table)
    check = StructureCheck(profile, prompt_opens_think=prompts.opens_map(profile), blank_ids=blank)
    stats, sent = generate(tmp_path / "gen", check)
    rows = _rows(tmp_path / "gen")
    failures = {f["sample_id"]: f for f in pq.read_table(tmp_path / "gen" / FAILURES_FILE).to_pylist()}
    assert not set(rows) & echoing, "an echo must never be stored as a generation"
    assert set(failures) == echoing and set(rows) == set(sids) - echoing
    assert all(f["kind"] == "prompt_echo" and f["attempts"] == 3 == sent[s] for s, f in failures.items())
    assert "well-formed for its family only without them" in failures[min(echoing)]["last_error"]
    assert stats.failure_kinds == Counter({"prompt_echo": len(echoing)})
    assert all(rows[f"once:{i}"]["attempts"] == 2 for i in range(10))  # retried, then the good reply
    for i in range(10):  # begins like the prompt's tail, whole as it stands: kept at the first attempt
        row, prompt = rows[f"tail:{i}"], rendered[f"tail:{i}"].prompt_ids
        k = 1 + i % 2
        assert row["output_ids"][:k] == prompt[-k:] and row["attempts"] == 1

    def qc(out):
        gen = shard_paths(out)
        summary = qc_partition(gen, table, tmp_path / f"qc-{out.name}", profile, partition="p", blank_ids=blank,
                               vocab_size=vocab, control_ids=control)
        stored = _rows(out)
        per_row = {s: segment_row(r, profile, prompt_opens_think=rendered[s].opens_think,
                                  prompt_ids=rendered[s].prompt_ids, blank_ids=blank, vocab_size=vocab,
                                  control_ids=control).drop_reason for s, r in stored.items()}
        assert summary.reasons == Counter(why for why in per_row.values() if why is not None)  # vectorised = per row
        return per_row

    # every stored row is whole (cuts at the cap excepted)
    assert {s: why for s, why in qc(tmp_path / "gen").items() if why is not None} == \
        {s: "truncated_in_reasoning" for s in rows if s.startswith("cut:")}
    # a producer without the check (the report's client) stores the echoes; QC names every one prompt_echo
    _, _ = generate(tmp_path / "old", None)
    old = qc(tmp_path / "old")
    echoed_once = echoing | {s for s in sids if s.startswith("once:")}  # their first reply echoes too
    assert set(old) == set(sids) and {s for s, why in old.items() if why == "prompt_echo"} == echoed_once
    assert all(old[s] in (None, "truncated_in_reasoning") for s in sids if s not in echoed_once)


# ------------------------------------------------------------------ bounds: oversized, nested and key-quoting replies
class BoundsServer(StubServer):
    """The stub with three more faults (issue 48): ``stream_big`` (300 MB of body, chunked, generated as it is sent),
    ``huge_length`` (a 300 MB Content-Length), ``deep`` (a 100k-deep JSON array) and ``auth_cut`` (HTTP 500 whose
    body quotes the request's ``Authorization`` header so that the key straddles the client's 300-byte excerpt)."""

    BIG = 300_000_000

    def __init__(self, **kw):
        super().__init__(**kw)
        self.streamed: Counter = Counter()

    async def _misbehave(self, action, request, body, started):
        from aiohttp import web

        rid = str(body.get("rid"))
        if action in ("stream_big", "huge_length"):
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            if action == "huge_length":
                resp.content_length = self.BIG
            else:
                resp.enable_chunked_encoding()
            await resp.prepare(request)
            chunk = b"7," * 32768
            try:
                await resp.write(b'{"output_ids":[')
                while self.streamed[rid] < self.BIG:
                    await resp.write(chunk)
                    self.streamed[rid] += len(chunk)
            except (ConnectionError, RuntimeError):  # the client hung up
                pass
            return resp
        if action == "deep":
            return web.Response(body=b"[" * 100_000 + b"]" * 100_000, content_type="application/json")
        if action == "auth_cut":
            auth = request.headers.get("Authorization", "")
            pad = "p" * (300 - len("proxy error ") - len("Bearer ") - 7)  # the key's first 7 chars before the cut
            return web.Response(status=500, text=f"proxy error {pad}{auth} (request headers)")
        return await super()._misbehave(action, request, body, started)


def test_oversized_nested_and_key_quoting_replies_are_failure_rows_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_TEST_KEY", SECRET)
    prompts = {f"ok:{i}": _prompt(i) for i in range(12)}
    prompts.update({f"always:{f}": _prompt(300 + j) for j, f in enumerate(("stream_big", "huge_length", "deep",
                                                                             "auth_cut"))})
    prompts["once:stream_big"] = _prompt(320)
    out = tmp_path / "gen"
    stub = BoundsServer(vocab_size=VOCAB, fault=Script(burst_s=0.0))
    with serve_stub_in_thread(stub) as running:
        client = GenerateClient([running.url], concurrency_per_server=4, timeout_s=60, backoff_base_s=0.01,
                                backoff_max_s=0.05, max_attempts=3, api_key_env="EAGLE_TEST_KEY")
        stats = run_generation(list(prompts.items()), out, client, SP, VOCAB, flush_rows=5)
        sent = Counter(stub.stats.per_rid)
        streamed = dict(stub.streamed)
    rows = _rows(out)
    table = pq.read_table(out / FAILURES_FILE)
    failures = {f["sample_id"]: f for f in table.to_pylist()}
    # the partition finished: every healthy request is a row, every fault exactly one failure row of its kind
    assert set(rows) == {s for s in prompts if s.startswith("ok:")}
    _assert_rows_are_exact(rows, prompts)
    assert {s: (f["kind"], f["attempts"]) for s, f in failures.items()} == {
        "always:stream_big": ("reply_too_large", 1), "always:huge_length": ("reply_too_large", 1),
        "once:stream_big": ("reply_too_large", 1),  # not retried, even though the next answer would be good
        "always:deep": ("bad_json", 3), "always:auth_cut": ("http_5xx", 3)}
    assert all(f["attempts"] == sent[s] for s, f in failures.items())
    assert stats.failure_kinds == Counter({"reply_too_large": 3, "bad_json": 1, "http_5xx": 1})
    cap = 1_048_576 + 512 * SP.max_new_tokens
    big = failures["always:stream_big"]["last_error"]
    assert f"{cap:,}-byte limit" in big and "server.max_reply_bytes" in big and "bytes read" in big
    assert "Content-Length 300,000,000 bytes" in failures["always:huge_length"]["last_error"]
    assert all(n < 100 * cap for n in streamed.values()), streamed  # the 300 MB were never pulled
    # the key: not whole, not its head, anywhere in the table the run wrote
    shown = repr(table.to_pylist())
    assert not any(SECRET[:n] in shown for n in range(4, len(SECRET) + 1))
    assert "proxy error ppp" in failures["always:auth_cut"]["last_error"]
