"""``count_completion_tokens_in_shards`` (streaming, flat arrays) equals ``count_completion_tokens`` (per row)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_assets.drafter.data.vocab import count_completion_tokens, count_completion_tokens_in_shards
from eagle_assets.qc.qc_pass import QC_SCHEMA


def _rows(rng, n, start):
    out = []
    for i in range(n):
        lp, lo = int(rng.integers(0, 6)), int(rng.integers(0, 9))
        out.append({"sample_id": f"s{start + i}", "input_ids": rng.integers(0, 50, lp + lo).tolist(),
                    "loss_mask": [0] * lp + [1] * lo, "n_prompt_tokens": lp, "reasoning_tokens": 0,
                    "answer_tokens": lo, "tool_call_tokens": 0, "flags": []})
    return out


def test_streaming_counts_equal_the_per_row_counts(tmp_path):
    rng = np.random.default_rng(0)
    rows, paths = [], []
    for s in range(3):
        part = _rows(rng, 37, len(rows))
        rows += part
        paths.append(tmp_path / f"shard-{s:05d}.parquet")
        pq.write_table(pa.Table.from_pylist(part, schema=QC_SCHEMA), paths[-1], row_group_size=5)
    want = count_completion_tokens([(r["input_ids"], r["loss_mask"]) for r in rows], 50)
    got, n = count_completion_tokens_in_shards(paths, 50, batch_rows=4)
    assert n == len(rows) and np.array_equal(got, want) and got.sum() > 0
    odd = lambda sids: np.array([int(s[1:]) % 2 == 1 for s in sids])  # noqa: E731
    want_odd = count_completion_tokens([(r["input_ids"], r["loss_mask"]) for r in rows
                                        if int(r["sample_id"][1:]) % 2], 50)
    got_odd, n_odd = count_completion_tokens_in_shards(paths, 50, include=odd, batch_rows=7)
    assert np.array_equal(got_odd, want_odd) and n_odd == sum(int(r["sample_id"][1:]) % 2 for r in rows)
    with pytest.raises(ValueError, match="outside"):
        count_completion_tokens_in_shards(paths, 10)
