"""``all_turns`` partitions end to end: every turn regenerated through Dagster, resumed exactly once after SIGKILL.

The server: ``ScriptedQwen3Server``, the stub server (``serving.stub_server.StubServer``: a real aiohttp server
speaking SGLang's native ``/generate``) with its reply replaced by a script written in the real Qwen3 tokenizer's
ids (from ``../shared/data/tokenizers/qwen3-0.6b``, also the target's tokenizer and chat template): with thinking on
a ``<think>`` block then an answer naming the turn; with thinking off (the prompt closes the block) the answer
only; to a user turn the dataset answered with a tool call, that recorded call, or (for user texts of an even
length in characters) a call with other arguments, which no recorded result answers. The embedded demo target is trained
on single-turn transcripts only, so a scripted model that uses tools the way the datasets do is what exercises every
branch here; no weights are involved. Data: MT-bench's two-turn questions (``fastchat/mt_bench/question.jsonl``) and
glaive conversations with function responses (``llama_factory/glaive_toolcall_en_demo.json``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

pytestmark = pytest.mark.slow(seconds=60)  # its share of a parallel session: scheduled early (conftest)

REPO = Path(__file__).resolve().parents[1]


class ScriptedQwen3Server(StubServer):
    """Replies of a tool-using Qwen3 (see the module doc); ``calls``: last user text -> the dataset's tool calls;
    ``kill_on_turn``: (turn, pid): SIGKILL ``pid`` when the first request of that turn arrives."""

    def __init__(self, tokenizer, calls: dict[str, list[dict]], kill_on_turn: tuple[int, int] | None = None):
        super().__init__(vocab_size=len(tokenizer))
        self.tok, self.calls, self.kill_on_turn = tokenizer, calls, kill_on_turn
        self.turns_requested: Counter = Counter()

    def script(self, prompt: str) -> str:
        turn = prompt.count("<|im_start|>assistant")
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        think = "" if prompt.endswith("</think>\n\n") else f"<think>\nThinking about turn {turn}.\n</think>\n\n"
        calls = self.calls.get(last_user) if not last_user.startswith("<tool_response>") else None
        if calls:
            body = ""
            for call in calls:
                fn = dict(call["function"])
                if len(last_user) % 2 == 0:
                    fn["arguments"] = {"unrecorded": True}
                body += ("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]})
                         + "\n</tool_call>")
            return think + body + "<|im_end|>"
        return think + f"This is answer number {turn} of this conversation.<|im_end|>"

    def reply(self, body: dict, started: float) -> dict:
        rid = str(body.get("rid"))
        turn = int(rid.rsplit(":", 1)[-1]) if rid.count(":") == 2 else 0
        self.turns_requested[turn] += 1
        if self.kill_on_turn is not None and turn == self.kill_on_turn[0]:
            pid, self.kill_on_turn = self.kill_on_turn[1], None
            os.kill(pid, signal.SIGKILL)
        ids = self.tok(self.script(self.tok.decode(body["input_ids"])), add_special_tokens=False)["input_ids"]
        ids = ids[: body["sampling_params"]["max_new_tokens"]]
        stop = ids[-1] == self.tok.convert_tokens_to_ids("<|im_end|>")
        finish = {"type": "stop", "matched": ids[-1]} if stop else {"type": "length", "length": len(ids)}
        return {"text": "", "output_ids": ids, "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": 0.0}}


def _recorded_calls(path: Path, fmt: str) -> dict[str, list[dict]]:
    from eagle_assets.formats import build_prompt, load_records

    calls: dict[str, list[dict]] = {}
    for rec in load_records(path, fmt):
        if hasattr(rec, "messages"):
            calls_after_users(build_prompt(rec, "all_turns")[0], calls)
    return calls


def calls_after_users(msgs: list[dict], calls: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Add to ``calls`` each user text of ``msgs`` that the conversation answered with tool calls -> those calls
    (the first conversation to ask a text wins); returns ``calls``."""
    last_user = None
    for m in msgs:
        if m["role"] == "user":
            last_user = m["content"]
        elif m["role"] == "assistant" and m.get("tool_calls") and last_user is not None:
            calls.setdefault(last_user, m["tool_calls"])
            last_user = None
    return calls


@pytest.fixture(scope="module")
def qwen(shared_data):
    from eagle_assets.target_model import load_tokenizer

    return load_tokenizer(shared_data / "tokenizers" / "qwen3-0.6b")


def _catalog(tmp: Path, shared: Path) -> Path:
    lenient = {"short_tokens": 4, "min_median_tokens": 1, "max_share_short_warn": 1.0}
    part = {"prompt_policy": "all_turns", "sampling": {"max_new_tokens": 96}, "max_prompt_tokens": 4096,
            "thresholds": lenient, "live": {"warmup_rows": 4, "report_every_rows": 4}}
    catalog = {
        "target": {"model": str(shared / "tokenizers" / "qwen3-0.6b")},
        "server": {"concurrency": 4},
        "partitions": {
            "MT": {**part, "sources": [{"path": str(shared / "fastchat/mt_bench/question.jsonl"), "format": "mtbench"}],
                   "enable_thinking": "both", "limit": 6},
            "GL": {**part, "sources": [{"path": str(shared / "llama_factory/glaive_toolcall_en_demo.json"),
                                        "format": "sharegpt"}], "limit": 8, "max_turns": 6},
        },
    }
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog))
    return path


def _metadata(result, asset: str) -> dict:
    event = next(e for e in result.get_asset_materialization_events() if e.asset_key.path[0] == asset)
    return event.step_materialization_data.materialization.metadata


def _rows(directory: Path) -> list[dict]:
    from eagle_assets.storage.shards import shard_paths

    return [r for p in shard_paths(directory) for r in pq.read_table(p).to_pylist()]


def test_all_turns_partitions_regenerate_every_turn_through_dagster(qwen, shared_data, tmp_path):
    from eagle_assets.assets.server_resource import SGLangServerResource
    from eagle_assets.definitions import build_definitions

    calls = _recorded_calls(shared_data / "llama_factory/glaive_toolcall_en_demo.json", "sharegpt")
    server = ScriptedQwen3Server(qwen, calls)
    store = tmp_path / "store" / "catalog"
    with serve_stub_in_thread(server) as running, dg.DagsterInstance.ephemeral() as instance:
        defs = build_definitions(_catalog(tmp_path, shared_data), storage_root=tmp_path / "store",
                                 sglang=SGLangServerResource(urls=[running.url]))
        names = ("raw_prompts", "tokenized_prompts", "generations", "qc_shards", "length_report")
        assets = [a for a in defs.assets if len(a.keys) == 1 and a.key.path[0] in names]
        results = {}
        for key in ("MT", "GL"):
            results[key] = dg.materialize(assets, partition_key=key, instance=instance, resources=defs.resources,
                                          selection=[n for n in names if n != "length_report"])
            assert results[key].success
        report = dg.materialize(assets, instance=instance, resources=defs.resources, selection=["length_report"])
        sent = server.stats.requests
        again = dg.materialize(assets, partition_key="MT", instance=instance, resources=defs.resources,
                               selection=["generations"])
        assert again.success and server.stats.requests == sent  # a finished partition sends nothing

    # MT-bench: two turns per conversation, both thinking modes, every row a (sample_id, thinking, turn)
    mt = store / "generations" / "MT"
    turns = pq.read_table(mt / "turns.parquet").to_pylist()
    convs = pq.read_table(mt / "conversations.parquet").to_pylist()
    assert len(convs) == 12 and Counter(c["thinking"] for c in convs) == {"on": 6, "off": 6}
    assert all(c["end_reason"] == "complete" and c["turns"] == 2 for c in convs), convs
    assert Counter((t["thinking"], t["turn"]) for t in turns) == {("on", 1): 6, ("on", 2): 6, ("off", 1): 6,
                                                                   ("off", 2): 6}
    rows = {r["sample_id"]: r for r in _rows(mt)}
    assert set(rows) == {t["row_id"] for t in turns}
    by_id = {t["row_id"]: t for t in turns}
    for rid, t in by_id.items():
        assert rid == f"{t['sample_id']}:{t['thinking']}:{t['turn']}"
        if t["turn"] == 2:  # the model's own turn-1 answer is in the turn-2 prompt, thinking off has no block
            text = qwen.decode(t["prompt_ids"])
            assert "This is answer number 1 of this conversation." in text
            assert ("Thinking about turn" in qwen.decode(rows[rid]["output_ids"])) == (t["thinking"] == "on")
    # QC: the training rows are the turn prompts + the replies, every turn kept, figures by turn and mode
    qc = [r for p in sorted((store / "qc_shards" / "MT").glob("shard-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert len(qc) == 24
    for r in qc:
        assert r["input_ids"] == by_id[r["sample_id"]]["prompt_ids"] + rows[r["sample_id"]]["output_ids"]
    gen_meta = _metadata(results["MT"], "generations")
    assert gen_meta["rows_by_turn"].data == {"1": 12, "2": 12} and gen_meta["turns_per_conversation"].value == 2.0
    assert gen_meta["ends_by_turn"].data == {"2": {"complete": 12}}
    qc_meta = _metadata(results["MT"], "qc_shards")
    assert qc_meta["qc_by_turn"].data["off/2"] == {"rows": 6, "kept": 6, "dropped": 0, "drop_reasons": {},
                                                   "share_dropped": 0.0}
    live = json.loads((mt / "live_stats.json").read_text())
    assert set(live["by_turn"]) == {"1", "2"} and live["by_turn"]["2"]["rows"] == 12
    assert set(live["by_thinking"]) == {"on", "off"}
    table = (store / "length_report" / "report_by_turn.md").read_text()
    assert "| MT | off | 2 | total | 6 |" in table and "| MT | on | 1 | reasoning | 6 |" in table
    assert report.success

    # glaive: recorded function responses spliced in; calls without a recorded result end the conversation
    gl = store / "generations" / "GL"
    convs = pq.read_table(gl / "conversations.parquet").to_pylist()
    turns = pq.read_table(gl / "turns.parquet").to_pylist()
    ends = Counter(c["end_reason"] for c in convs)
    assert sum(c["tool_results"] for c in convs) >= 1 and ends["complete"] >= 1, ends
    assert ends["tool_result_not_recorded"] >= 1, ends  # counted with its turn in the metadata
    assert sum(n for by_reason in _metadata(results["GL"], "generations")["ends_by_turn"].data.values()
               for r, n in by_reason.items() if r == "tool_result_not_recorded") == ends["tool_result_not_recorded"]
    assert set(ends) <= {"complete", "tool_result_not_recorded", "max_turns"}, ends
    spliced = [t for t in turns if t["tool_results"]]
    # a spliced result is the prompt's last message: "...</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert spliced and all(qwen.decode(t["prompt_ids"]).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
                           for t in spliced)
    assert max(t["turn"] for t in turns) >= 3
    print("GL conversations:", len(convs), "ends:", dict(ends), "rows by turn:",
          dict(sorted(Counter(t["turn"] for t in turns).items())),
          "tool results:", sum(c["tool_results"] for c in convs))
    gl_qc = json.loads((store / "qc_shards" / "GL" / "qc_status.json").read_text())
    assert gl_qc["rows"] == len(turns) and gl_qc["kept"] == len(turns)


KILL_SCRIPT = r"""
import json, sys
from pathlib import Path
from eagle_assets.generations.rollout import RolloutSettings, run_conversations
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets.target_model import detect_profile, load_tokenizer
cfg = json.loads(sys.argv[1])
tok = load_tokenizer(cfg["tokenizer"])
prof = detect_profile(tok)
settings = RolloutSettings(tokenizer=tok, profile=prof, tools={}, enable_thinking=cfg["thinking"], vocab_size=len(tok))
print("READY", flush=True)
sys.stdin.readline()
stats = run_conversations(cfg["conversations"], Path(cfg["out"]),
                          GenerateClient([cfg["url"]], concurrency_per_server=2),
                          SamplingParams(max_new_tokens=64, stop_token_ids=list(prof.stop_ids)), settings,
                          flush_rows=1000, flush_seconds=60)
print("DONE", json.dumps(stats.summary()), flush=True)
"""


def test_sigkill_between_turns_resumes_at_the_next_turn_exactly_once(qwen, shared_data, tmp_path):
    from eagle_assets.formats import build_prompt, load_records
    from eagle_assets.generations.rollout import RolloutSettings, run_conversations
    from eagle_assets.serving.client import GenerateClient
    from eagle_assets.serving.protocol import SamplingParams
    from eagle_assets.target_model import detect_profile

    recs = [r for r in load_records(shared_data / "fastchat/mt_bench/question.jsonl", "mtbench")
            if hasattr(r, "messages")][:5]
    convs = [(f"c{i}", build_prompt(r, "all_turns")[0]) for i, r in enumerate(recs)]
    out = tmp_path / "gen"
    cfg = {"tokenizer": str(shared_data / "tokenizers" / "qwen3-0.6b"), "thinking": "both", "out": str(out),
           "conversations": convs}
    server = ScriptedQwen3Server(qwen, {})
    with serve_stub_in_thread(server) as running:
        cfg["url"] = running.url
        child = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, json.dumps(cfg)], cwd=REPO, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert child.stdout.readline().strip() == "READY", child.stderr.read()
        server.kill_on_turn = (2, child.pid)  # the first turn-2 request kills the writer: turn 1 is all stored
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == -signal.SIGKILL
        stored = {r["sample_id"] for r in _rows(out)}
        assert {rid.rsplit(":", 1)[-1] for rid in stored} == {"1"} and len(stored) == 10
        first_run = dict(server.turns_requested)
        prof = detect_profile(qwen)
        stats = run_conversations(convs, out, GenerateClient([running.url], concurrency_per_server=2),
                                  SamplingParams(max_new_tokens=64, stop_token_ids=list(prof.stop_ids)),
                                  RolloutSettings(tokenizer=qwen, profile=prof, tools={}, enable_thinking="both",
                                                  vocab_size=len(qwen)))
    assert first_run[1] == 10 and server.turns_requested[1] == 10  # no stored turn is ever sent again
    assert stats.skipped_done == 10 and stats.succeeded == 10
    rows = _rows(out)
    assert len(rows) == len({r["sample_id"] for r in rows}) == 20  # every turn exactly once
    convs_table = pq.read_table(out / "conversations.parquet").to_pylist()
    assert all(c["end_reason"] == "complete" and c["turns"] == 2 for c in convs_table)
    assert stats.summary()["rows_by_turn"] == {"1": 10, "2": 10}
