"""``qc_partition`` (the streaming body of ``qc_shards``) against the per-row reference, on fuzzed rows.

The reference is what ``qc_shards`` did row by row before: ``segment_row`` per generations row, stale and duplicate
rows skipped, ``input_ids = prompt_ids + output_ids``. Shards here are tiny (a few rows) so the row cap, the byte
cap, batch edges and the clean-up of an earlier pass's extra shards are all crossed.
"""

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_quality_fuzz_replies import BLANK, CONTROL, END_THINK, END_TOOL, EOT, ORDINARY, THINK, TOOL, VOCAB, _profile

from eagle_assets.catalog import Thresholds
from eagle_assets.generations.run import GENERATION_SCHEMA
from eagle_assets.qc.qc_pass import QC_SCHEMA, ROWS_SCHEMA, ShardWriter, qc_partition
from eagle_assets.qc.thresholds import evaluate_response_length
from eagle_assets.storage.shards import shard_paths
from eagle_assets.structure.segment import segment_row

PROFILE = _profile(False, False)


def _random_rows(rng: random.Random, n: int, prompts: dict[str, list[int]]) -> list[dict]:
    ids = list(prompts)
    rows = []
    for i in range(n):
        sid = rng.choice(ids + ["gone"]) if rng.random() < 0.2 else ids[i % len(ids)]
        out = [rng.choice(ORDINARY + sorted(BLANK)) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.8:
            out += [END_THINK] + [rng.choice(ORDINARY + [TOOL, END_TOOL, THINK, 70]) for _ in range(rng.randint(0, 5))]
        out += [rng.choice([EOT, EOT, 3])] if rng.random() < 0.9 else []
        finish = rng.choice(["stop", "stop", "stop", "length", "abort"])
        rows.append({"sample_id": sid, "output_ids": out, "finish_reason": finish,
                     "matched_stop": out[-1] if finish == "stop" and out else None,
                     "completion_tokens": len(out) + rng.choice([0, 0, 0, 0, 1]),
                     "prompt_tokens": len(prompts.get(sid, [])),
                     "sampling_params": json.dumps({"max_new_tokens": rng.choice([64, 8])})})
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_qc_equals_the_per_row_reference(tmp_path, seed):
    rng = random.Random(seed)
    prompts = {f"p{i}": [rng.randint(0, 40) for _ in range(rng.randint(1, 9))] for i in range(40)}
    opens = {sid: rng.random() < 0.7 for sid in prompts}
    gen = tmp_path / "gen"
    gen.mkdir()
    all_rows = []
    for s in range(3):
        rows = _random_rows(rng, 60, prompts)
        all_rows += rows
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), gen / f"shard-{s:05d}.parquet",
                       row_group_size=7)
    prompt_table = pa.table({"sample_id": list(prompts), "prompt_ids": list(prompts.values()),
                             "prompt_opens_think": [opens[s] for s in prompts]})
    out = tmp_path / "qc"
    out.mkdir()
    (out / "shard-00099.parquet").write_bytes(b"")  # an earlier pass's extra shard: must go
    summary = qc_partition(shard_paths(gen), prompt_table, out, PROFILE, partition="k", blank_ids=BLANK,
                           vocab_size=VOCAB, control_ids=CONTROL, short_tokens=4, max_new_tokens=64,
                           rows_per_shard=9, batch_rows=5)

    seen, want_rows, want_kept, skipped = set(), [], [], {"stale_prompt": 0, "duplicate_row": 0}
    for g in all_rows:
        if g["sample_id"] not in prompts:
            skipped["stale_prompt"] += 1
            continue
        if g["sample_id"] in seen:
            skipped["duplicate_row"] += 1
            continue
        seen.add(g["sample_id"])
        p = prompts[g["sample_id"]]
        seg = segment_row(g, PROFILE, prompt_opens_think=opens[g["sample_id"]], prompt_ids=p, blank_ids=BLANK,
                          vocab_size=VOCAB, control_ids=CONTROL)
        want_rows.append((g["sample_id"], len(g["output_ids"]), seg.reasoning_tokens, seg.answer_tokens,
                          seg.drop_reason, seg.kept and len(g["output_ids"]) < 4))
        if seg.kept:
            want_kept.append({"sample_id": g["sample_id"], "input_ids": p + g["output_ids"],
                              "loss_mask": [0] * len(p) + [1] * len(g["output_ids"]), "n_prompt_tokens": len(p),
                              "reasoning_tokens": seg.reasoning_tokens, "answer_tokens": seg.answer_tokens,
                              "tool_call_tokens": seg.tool_call_tokens, "flags": list(seg.flags)})
    got_rows = pq.read_table(out / "rows.parquet")
    assert got_rows.schema == ROWS_SCHEMA
    assert [(r["sample_id"], r["completion_tokens"], r["reasoning_tokens"], r["answer_tokens"], r["drop_reason"],
             r["short"]) for r in got_rows.to_pylist()] == want_rows
    paths = shard_paths(out)
    assert paths == summary.shards and len(paths) == max(1, -(-len(want_kept) // 9))
    got_kept = pa.concat_tables([pq.read_table(p) for p in paths])
    assert got_kept.schema == QC_SCHEMA and got_kept.to_pylist() == want_kept
    assert all(pq.read_metadata(p).num_rows <= 9 for p in paths)
    assert summary.kept == len(want_kept) and summary.rows == len(want_rows)
    assert {k: summary.reasons[k] for k in skipped} == skipped
    assert summary.drop_reasons() == [r[4] for r in want_rows]
    assert len({r[4] for r in want_rows}) >= 5  # the corpus reaches several rules
    # response_length from the summary's counts = the per-row evaluation over lists of every row
    firsts, ordered = set(), []
    for g in all_rows:
        if g["sample_id"] in prompts and g["sample_id"] not in firsts:
            firsts.add(g["sample_id"])
            ordered.append(g["finish_reason"])
    for th in (Thresholds(short_tokens=4, max_share_truncated_warn=0.05, min_median_tokens=3),
               Thresholds(short_tokens=2)):
        want = evaluate_response_length([r[1] for r in want_rows], ordered, th)
        assert summary.response_length(th) == want


def test_shard_writer_caps_bytes_and_always_leaves_shard_zero(tmp_path):
    w = ShardWriter(tmp_path, QC_SCHEMA, rows_per_shard=1000, bytes_per_shard=4000)
    ids = np.arange(200, dtype=np.int32)
    rows = [{"sample_id": str(i), "input_ids": ids.tolist(), "loss_mask": [1] * 200, "n_prompt_tokens": 0,
             "reasoning_tokens": 0, "answer_tokens": 0, "tool_call_tokens": 0, "flags": []} for i in range(20)]
    w.add(pa.Table.from_pylist(rows, schema=QC_SCHEMA))
    paths = w.close()
    assert len(paths) > 1 and sum(pq.read_metadata(p).num_rows for p in paths) == 20
    empty = ShardWriter(tmp_path / "e", QC_SCHEMA).close()
    assert [p.name for p in empty] == ["shard-00000.parquet"] and pq.read_table(empty[0]).num_rows == 0
    with pytest.raises(ValueError, match="rows_per_shard"):
        ShardWriter(tmp_path, QC_SCHEMA, rows_per_shard=0)
