"""The stages stream (issue 16): partitions larger than one batch go through in bounded pieces and give exactly the
rows of the one-batch path.

- ``tokenized_prompts.prompts_file.PromptsFile`` (what ``generations`` and ``qc_shards`` read prompts through) over a
  file of many small row groups with a one-group cache: the same ids as the whole table, in any order.
- ``tokenized_prompts.write.tokenize_partition`` over more records than one batch: several row groups, and rows /
  rejects equal to ``render_prompt`` record by record (real tokenizers of the shared data: every family, several
  layouts; ``render_prompts``' batch encode against the one-record path).
- ``qc_partition`` reading prompts from such a file equals the in-memory path.
- ``run_generation`` from a ``PromptsFile`` against the stub server over real HTTP: several bounded shards, killed
  part way (the client's callback raises) and resumed shard by shard, every prompt exactly once, the same rows as
  a run from the in-memory list; the live figures equal what QC finds in the same shards.
- Shards built through numpy equal ``pa.Table.from_pylist``'s; the stub's ``ReplyShape`` (the benchmarks'
  long-tailed reasoning replies) is deterministic, long-tailed, and kept by QC unless cut at the cap.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_generation_live import PROFILE as STUB_PROFILE
from test_generation_live import STOP, THINK_END
from test_generation_live import VOCAB as STUB_VOCAB
from test_quality_fuzz_replies import BLANK, CONTROL, VOCAB
from test_quality_qc_pass import PROFILE, _random_rows

from eagle_assets.catalog import LiveSpec, Thresholds
from eagle_assets.generations.run import GENERATION_SCHEMA, run_generation
from eagle_assets.qc.live import LiveQualityMonitor
from eagle_assets.qc.qc_pass import qc_partition
from eagle_assets.raw_prompts.rows import RAW_SCHEMA, REJECT_SCHEMA
from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets.storage.shards import read_shards, shard_paths
from eagle_assets.tokenized_prompts.prompts_file import PromptsFile
from eagle_assets.tokenized_prompts.write import TOKENIZED_SCHEMA, tokenize_partition
from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

pytestmark = pytest.mark.slow(seconds=60)  # its share of a parallel session: scheduled early (conftest)


def _prompt_table(rng: random.Random, n: int, with_unknown_opens: bool = False) -> pa.Table:
    ids = [[rng.randint(0, 40) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    opens = [rng.random() < 0.7 for _ in range(n)]
    if with_unknown_opens:
        opens = [None if i % 5 == 0 else o for i, o in enumerate(opens)]
    return pa.table({"sample_id": [f"p{i}" for i in range(n)], "prompt_ids": pa.array(ids, pa.list_(pa.int32())),
                     "prompt_opens_think": pa.array(opens, pa.bool_())})


def test_prompts_file_reads_row_groups_lazily_with_the_ids_of_the_whole_table(tmp_path):
    rng = random.Random(0)
    table = _prompt_table(rng, 50, with_unknown_opens=True)
    path = tmp_path / "prompts.parquet"
    pq.write_table(table, path, row_group_size=7)
    pf = PromptsFile(path, cache_groups=1)
    assert pq.ParquetFile(path).metadata.num_row_groups == 8 and len(pf) == 50
    rows = np.array([rng.randrange(50) for _ in range(40)] + [49, 0, 0])
    assert pf.take(rows).to_pylist() == table.column("prompt_ids").take(pa.array(rows)).to_pylist()
    assert pf.take(np.array([], dtype=np.int64)).to_pylist() == []
    assert list(pf.iter_prompts(batch_rows=6)) == list(zip(table.column("sample_id").to_pylist(),
                                                          table.column("prompt_ids").to_pylist()))
    assert pf.ids_of("p13") == table.column("prompt_ids")[13].as_py() and pf.ids_of("gone") is None
    want_opens = [-1 if o is None else int(o) for o in table.column("prompt_opens_think").to_pylist()]
    assert pf.opens.tolist() == want_opens
    ids_map = pf.ids_map()
    assert ids_map["p3"] == table.column("prompt_ids")[3].as_py() and ids_map.get("gone") is None
    assert "p3" in ids_map and "gone" not in ids_map and len(ids_map) == 50
    # where the file has no value, the renderer's rule over the ids (as QC applies it)
    from eagle_assets.target_model.render import opens_think_block

    opens_map = pf.opens_map(PROFILE)
    assert opens_map["p5"] == opens_think_block(pf.ids_of("p5"), PROFILE)
    assert opens_map["p6"] == bool(want_opens[6]) and opens_map.get("gone") is None
    # the in-memory form answers the same
    mem = PromptsFile.from_table(table)
    assert mem.take(rows).to_pylist() == pf.take(rows).to_pylist() and mem.index == pf.index


@pytest.mark.parametrize("seed", [0, 1])
def test_qc_from_a_lazily_read_prompts_file_equals_the_in_memory_path(tmp_path, seed):
    rng = random.Random(seed)
    table = _prompt_table(rng, 180, with_unknown_opens=seed == 1)
    prompts = list(zip(table.column("sample_id").to_pylist(), table.column("prompt_ids").to_pylist()))
    gen = tmp_path / "gen"
    gen.mkdir()
    for s in (2, 0, 1):  # generations in another order than the prompts: row groups are read out of order
        rows = _random_rows(rng, 60, dict(prompts[60 * s: 60 * (s + 1)]))
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), gen / f"shard-{s:05d}.parquet",
                       row_group_size=11)
    path = tmp_path / "prompts.parquet"
    pq.write_table(table, path, row_group_size=6)
    kw = dict(partition="k", blank_ids=BLANK, vocab_size=VOCAB, control_ids=CONTROL, short_tokens=4,
              max_new_tokens=64, rows_per_shard=3, batch_rows=5)
    if seed == 1:  # the in-memory path with the renderer's rule written out, to compare against
        from eagle_assets.target_model.render import opens_think_block

        table = table.set_column(2, "prompt_opens_think", pa.array(
            [opens_think_block(p, PROFILE) if o is None else o for o, p in
             zip(table.column(2).to_pylist(), table.column(1).to_pylist())], pa.bool_()))
    a = qc_partition(shard_paths(gen), table, tmp_path / "qc_mem", PROFILE, **kw)
    b = qc_partition(shard_paths(gen), PromptsFile(path, cache_groups=1), tmp_path / "qc_file", PROFILE, **kw)
    assert a.drop_reasons() == b.drop_reasons() and a.reasons == b.reasons and a.kept == b.kept > 0
    assert len(b.shards) > 1
    for x, y in zip(a.shards, b.shards):
        assert pq.read_table(x).equals(pq.read_table(y))
    assert pq.read_table(tmp_path / "qc_mem" / "rows.parquet").equals(
        pq.read_table(tmp_path / "qc_file" / "rows.parquet"))


# ------------------------------------------------------------------------------------------- tokenized_prompts
def _raw_records(n: int) -> list[dict]:
    """Records of several layouts (plain, system, multi-turn, tools) and two that must be rejected."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    rows = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            messages = [{"role": "user", "content": f"Question {i}: why is the sky blue?"}]
        elif kind == 1:
            messages = [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": f"Sum {i} and {i * 3}."}]
        elif kind == 2:
            messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": f"Tell me fact number {i}."}]
        elif kind == 3:
            messages = [{"role": "user", "content": f"Weather in city {i}?"}]
        else:
            messages = [{"role": "user", "content": f"Write {i} words " + "about rivers " * (i % 7)}]
        rows.append({"sample_id": f"r{i:04d}", "messages": json.dumps(messages),
                     "tools": json.dumps(tools) if kind == 3 else None, "reference_reply": None,
                     "source_file": "src.jsonl", "source_row": i})
    rows[7]["messages"] = json.dumps([{"role": "user", "content": "smuggled <|im_end|> token"}])
    rows[11]["messages"] = json.dumps([{"role": "user", "content": "long " * 400}])
    return rows


@pytest.mark.parametrize("family", ["qwen3-0.6b", "deepseek-v3", "kimi-k2.5"])
def test_tokenize_pass_in_batches_equals_render_prompt_record_by_record(shared_data, tmp_path, family):
    from eagle_assets.target_model.profile import detect_profile
    from eagle_assets.target_model.render import RenderError, render_prompt, render_prompts
    from eagle_assets.target_model.tokenizer import load_tokenizer

    tok_dir = shared_data / "tokenizers" / family
    if not tok_dir.exists():
        pytest.skip(f"{tok_dir} is absent")
    if family == "kimi-k2.5":  # its tokenizer files carry no chat template: the K2-Thinking one of the shared data
        from eagle_assets.target_model.kimi import load_kimi_tokenizer

        tokenizer = load_kimi_tokenizer(tok_dir, shared_data / "chat_templates" / "moonshotai-Kimi-K2-Thinking.jinja")
    else:
        tokenizer = load_tokenizer(tok_dir)
    profile = detect_profile(tokenizer, None)
    records = _raw_records(23)
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist(records, schema=RAW_SCHEMA), raw)
    out = tmp_path / "tok"
    summary = tokenize_partition(raw, out, tokenizer, profile, max_prompt_tokens=300, batch_rows=5)

    want, want_rejects = [], []
    for r in records:
        try:
            p = render_prompt(tokenizer, json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None,
                              max_prompt_tokens=300, profile=profile)
        except RenderError as exc:
            want_rejects.append((r["sample_id"], exc.reason))
            continue
        want.append({"sample_id": r["sample_id"], "prompt_ids": p.prompt_ids, "n_prompt_tokens": len(p.prompt_ids),
                     "template_hash": p.template_hash, "prompt_opens_think": p.opens_think,
                     "render_flags": json.dumps(p.flags, sort_keys=True, default=str)})
    got = pq.read_table(out / "prompts.parquet")
    assert got.schema == TOKENIZED_SCHEMA and got.to_pylist() == want
    assert pq.ParquetFile(out / "prompts.parquet").metadata.num_row_groups == 5  # one per batch of 5 records
    rejects = pq.read_table(out / "rejects.parquet")
    assert rejects.schema == REJECT_SCHEMA
    assert [(r["sample_id"], r["reason"]) for r in rejects.to_pylist()] == want_rejects
    assert {reason for _, reason in want_rejects} >= {"prompt_too_long"}
    assert summary.rows == len(want) and summary.rejected == len(want_rejects) and summary.batches == 5
    lengths = sorted(len(w["prompt_ids"]) for w in want)
    assert summary.median_tokens == lengths[len(lengths) // 2] and summary.max_tokens == lengths[-1]
    # the batch API on its own: one result per record, errors in place
    batch = render_prompts(tokenizer, [(json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None)
                                       for r in records[:12]], max_prompt_tokens=300, profile=profile)
    assert [isinstance(b, RenderError) for b in batch] == [r["sample_id"] in dict(want_rejects) for r in records[:12]]


def _family_tokenizer(shared_data, family: str):
    from eagle_assets.target_model.tokenizer import load_tokenizer

    tok_dir = shared_data / "tokenizers" / family
    if not tok_dir.exists():
        pytest.skip(f"{tok_dir} is absent")
    if family == "kimi-k2.5":  # no chat template in its tokenizer files: the K2-Thinking one of the shared data
        from eagle_assets.target_model.kimi import load_kimi_tokenizer

        return load_kimi_tokenizer(tok_dir, shared_data / "chat_templates" / "moonshotai-Kimi-K2-Thinking.jinja")
    return load_tokenizer(tok_dir)


def _odd_records() -> list[tuple[list, list | None]]:
    """Layouts the batched render must hand to the one-record path or reject as it does: tool calls in the history
    (DeepSeek-V3 needs JSON-string arguments), an empty conversation, ``tools=[]``, a reasoning field, no user turn,
    contents some templates fail on (an int, a list of parts)."""
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                               "parameters": {"type": "object",
                                                              "properties": {"word": {"type": "string"}}}}}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"word": "eagle"}}}]}
    return [
        ([{"role": "user", "content": "Define eagle."}, call, {"role": "tool", "content": "a bird of prey"},
          {"role": "user", "content": "And hawk?"}], tools),
        ([], None),
        ([{"role": "user", "content": "plain, tools=[]"}], []),
        ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"},
          {"role": "user", "content": "3+3?"}], None),
        ([{"role": "system", "content": "only a system prompt"}], None),
        ([{"role": "user", "content": "x <think> y"}], None),
        # DeepSeek-V3 and Kimi's templates raise on these: the batched call fails and is split down to them
        ([{"role": "user", "content": 5}], None),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], None),
        ([{"role": "user", "content": "after the failing ones"}], None),
    ]


@pytest.mark.parametrize("family", ["qwen3-0.6b", "deepseek-v3", "kimi-k2.5"])
def test_batched_render_equals_render_prompt_with_thinking_on_off_and_odd_layouts(shared_data, family):
    """``render_prompts`` (batched ``apply_chat_template`` + ``encode_batch_fast``) gives ``render_prompt``'s ids,
    flags, text and error (reason and message) on every record, with ``enable_thinking`` None / True / False."""
    from eagle_assets.target_model.profile import detect_profile
    from eagle_assets.target_model.render import RenderError, encode_texts, render_prompt, render_prompts

    tokenizer = _family_tokenizer(shared_data, family)
    profile = detect_profile(tokenizer, None)
    records = [(json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None)
               for r in _raw_records(12)] + _odd_records()
    reasons = set()
    for thinking in (None, True, False):
        got = render_prompts(tokenizer, records, enable_thinking=thinking, max_prompt_tokens=300, profile=profile)
        assert len(got) == len(records)
        for (messages, tools), g in zip(records, got):
            try:
                want = render_prompt(tokenizer, messages, tools, enable_thinking=thinking, max_prompt_tokens=300,
                                     profile=profile)
            except RenderError as exc:
                assert isinstance(g, RenderError) and (g.reason, str(g)) == (exc.reason, str(exc)), (messages, g)
                reasons.add(exc.reason)
                continue
            assert not isinstance(g, RenderError), (messages, g)
            assert g == want  # ids, hash, flags and text
    assert {"control_token_in_text", "prompt_too_long", "template_error"} <= reasons
    texts = ["<|im_start|>user\nhi<|im_end|>\n", "plain words, ünïcödé and 数字 123", ""]
    assert encode_texts(tokenizer, texts) == [list(i) for i in tokenizer(texts, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("family", ["qwen3-0.6b", "kimi-k2.5"])
def test_tokenize_pass_with_worker_processes_writes_the_files_of_one_process(shared_data, tmp_path, family):
    """Two spawned workers (the tokenizer pickled to each) write byte-for-byte the rows of the one-process pass,
    batches in file order, and the same summary."""
    from eagle_assets.target_model.profile import detect_profile

    tokenizer = _family_tokenizer(shared_data, family)
    profile = detect_profile(tokenizer, None)
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist(_raw_records(40), schema=RAW_SCHEMA), raw)
    one = tokenize_partition(raw, tmp_path / "one", tokenizer, profile, max_prompt_tokens=300, batch_rows=6,
                             workers=1)
    two = tokenize_partition(raw, tmp_path / "two", tokenizer, profile, max_prompt_tokens=300, batch_rows=6,
                             workers=2)
    for name in ("prompts.parquet", "rejects.parquet"):
        a, b = pq.read_table(tmp_path / "one" / name), pq.read_table(tmp_path / "two" / name)
        assert a.equals(b) and a.num_rows > 0
    assert pq.ParquetFile(tmp_path / "two" / "prompts.parquet").metadata.num_row_groups == 7
    assert (one.rows, one.rejected, one.reasons, one.opens_think, one.template_hash, one.max_tokens, one.batches,
            one.median_tokens) == (two.rows, two.rejected, two.reasons, two.opens_think, two.template_hash,
                                   two.max_tokens, two.batches, two.median_tokens)


def test_default_workers_stays_in_process_for_small_partitions_and_small_machines():
    from eagle_assets.tokenized_prompts.write import MIN_CPUS_FOR_WORKERS, MIN_RECORDS_PER_WORKER, default_workers

    big = 10 * MIN_RECORDS_PER_WORKER
    assert default_workers(big, cpus=MIN_CPUS_FOR_WORKERS - 1) == 1  # one process, rendering and encoding overlapped
    assert default_workers(0, cpus=16) == default_workers(MIN_RECORDS_PER_WORKER - 1, cpus=16) == 1
    assert default_workers(big, batch_rows=4096, cpus=6) == 6 and default_workers(big, cpus=64) == 8
    assert default_workers(big, batch_rows=big, cpus=16) == 1  # one batch
    assert default_workers(big) == (1 if len(os.sched_getaffinity(0)) < MIN_CPUS_FOR_WORKERS
                                    else min(len(os.sched_getaffinity(0)), 8, 10))


def test_tokenize_pass_leaves_the_old_files_when_it_fails(tmp_path):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "prompts.parquet").write_bytes(b"old")
    with pytest.raises(Exception):
        tokenize_partition(tmp_path / "missing.parquet", out, tokenizer=None, profile=None)
    assert (out / "prompts.parquet").read_bytes() == b"old"
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------------------------------------ generations
class _DiesAfter:
    """A client whose result callback raises after ``n`` results: a run killed part way (the rows received so
    far are flushed, as on SIGKILL minus the unflushed buffer)."""

    def __init__(self, client: GenerateClient, n: int):
        self.client, self.n = client, n

    async def generate_many(self, items, sampling, vocab_size=None, on_result=None, control_ids=None):
        count = 0

        def dying(rid, result):
            nonlocal count
            count += 1
            if count > self.n:
                raise RuntimeError("killed")
            return on_result(rid, result)

        return await self.client.generate_many(items, sampling, vocab_size=vocab_size, on_result=dying)


def _stub_prompts(n: int) -> pa.Table:
    ids = [[8 + (i * 53 + k * 17) % (STUB_VOCAB - 8) for k in range(5 + i % 7)] for i in range(n)]
    return pa.table({"sample_id": [f"g{i:04d}" for i in range(n)], "prompt_ids": pa.array(ids, pa.list_(pa.int32())),
                     "prompt_opens_think": [False] * n})


def test_generation_from_a_prompts_file_streams_resumes_per_shard_and_matches_qc(tmp_path):
    table = _stub_prompts(300)
    path = tmp_path / "prompts.parquet"
    pq.write_table(table, path, row_group_size=32)
    sampling = SamplingParams(max_new_tokens=60, temperature=0.0, stop_token_ids=[STOP])
    live = LiveSpec(warmup_rows=50, report_every_rows=25, fail_fast=False)
    out, ref = tmp_path / "gen", tmp_path / "ref"
    stub = StubServer(vocab_size=STUB_VOCAB, think_end_id=THINK_END)
    with serve_stub_in_thread(stub) as running:
        client = GenerateClient([running.url], concurrency_per_server=8, timeout_s=10)
        with pytest.raises(RuntimeError, match="killed"):
            run_generation(PromptsFile(path, cache_groups=1), out, _DiesAfter(client, 130), sampling, STUB_VOCAB,
                           flush_rows=20)
        first = read_shards(out).num_rows
        assert 120 <= first <= 130 and len(shard_paths(out)) >= 6  # whole shards of 20 rows, then the rest
        pf = PromptsFile(path, cache_groups=1)
        monitor = LiveQualityMonitor(STUB_PROFILE, Thresholds(short_tokens=5), live, partition="G",
                                     prompt_opens_think=pf.opens_map(STUB_PROFILE), prompt_ids=pf.ids_map(),
                                     vocab_size=STUB_VOCAB)
        again = run_generation(pf, out, client, sampling, STUB_VOCAB, flush_rows=20, monitor=monitor)
        assert again.skipped_done == first and again.requested == again.succeeded == 300 - first
        requests_before = stub.stats.requests
        whole = run_generation(list(zip(table.column(0).to_pylist(), table.column(1).to_pylist())), ref, client,
                               sampling, STUB_VOCAB, flush_rows=1000)
        assert whole.succeeded == 300 and stub.stats.requests == requests_before + 300
    got = read_shards(out).sort_by("sample_id")
    want = read_shards(ref).sort_by("sample_id")
    assert got.column("sample_id").to_pylist() == [f"g{i:04d}" for i in range(300)]  # each exactly once
    assert got.column("output_ids").equals(want.column("output_ids"))
    assert all(pq.read_metadata(p).num_rows <= 20 for p in shard_paths(out)) and len(shard_paths(out)) >= 15
    # the live figures (seeded with the first run's rows, fed the second's) are QC's figures over the same shards
    qc = qc_partition(shard_paths(out), pf, tmp_path / "qc", STUB_PROFILE, partition="G", blank_ids=frozenset(),
                      vocab_size=STUB_VOCAB, control_ids=None, short_tokens=5)
    snap = monitor.snapshot()
    assert snap["rows"] == qc.rows == 300 and snap["rows_earlier_runs"] == first
    assert snap["drop_reasons"] == {r: k for r, k in qc.reasons.items() if k}
    assert snap["kept"] == qc.kept


def test_shards_written_through_numpy_equal_what_table_from_pylist_writes():
    from eagle_assets.generations.run import _generation_table

    rng = random.Random(3)
    rows = [{"sample_id": f"s{i}", "output_ids": [rng.randrange(0, 2**31 - 1) for _ in range(rng.randrange(0, 30))],
             "finish_reason": rng.choice(["stop", "length", None]), "matched_stop": rng.choice([None, 2]),
             "completion_tokens": rng.randrange(0, 30), "prompt_tokens": rng.choice([None, 7]),
             "latency_s": rng.random(), "attempts": 1, "sampling_params": "{}"} for i in range(40)]
    assert _generation_table(rows).equals(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA))


def test_reply_shape_gives_long_tailed_qwen3_replies_that_qc_keeps():
    from eagle_assets.structure.segment import segment_row
    from eagle_assets.target_model.profile import FamilyProfile
    from eagle_assets_tests.servers.stub_server import ReplyShape

    shape = ReplyShape(think_start_id=4, think_end_id=3, stop_id=2, median=200, sigma=0.6, cap_share=0.02)
    profile = FamilyProfile(name="custom", think_start_id=4, think_end_id=3, tool_call_start_ids=(5,),
                            tool_call_end_ids=(6,), end_of_turn_id=2, stop_ids=(2,))
    replies = [shape.output_ids(f"r{i}", 2000, 500) for i in range(600)]
    assert replies[5] == shape.output_ids("r5", 2000, 500)  # a pure function of the rid
    lengths = np.array([len(ids) for ids, _ in replies])
    capped = [finish["type"] == "length" for _, finish in replies]
    assert 150 < np.median(lengths) < 250 and lengths.mean() > np.median(lengths) and 3 <= sum(capped) <= 30
    for ids, finish in replies:
        row = {"sample_id": "x", "output_ids": ids, "finish_reason": finish["type"],
               "matched_stop": finish.get("matched"), "completion_tokens": len(ids)}
        seg = segment_row(row, profile, prompt_opens_think=False, vocab_size=500)
        assert seg.kept == (finish["type"] == "stop"), seg.drop_reason
