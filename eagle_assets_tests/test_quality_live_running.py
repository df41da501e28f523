"""The live monitor's running figures (counters + exact length histograms) against the list-based rules of the
blocking checks, over a seeded stream of fuzzed rows (seeded earlier-run rows first, then this run's rows)."""

import heapq
import random
from statistics import median

import pytest

from eagle_assets.catalog import LiveSpec
from eagle_assets.quality.live import LiveQualityMonitor
from eagle_assets.quality.running import LengthHistogram
from eagle_assets.quality.segment import segment_row
from eagle_assets.quality.thresholds import evaluate_response_length, evaluate_token_structure
from test_quality_qc_pass import PROFILE, _random_rows
from test_quality_fuzz_replies import BLANK, CONTROL, VOCAB


@pytest.mark.parametrize("seed", [0, 1])
def test_length_histogram_is_exact(seed):
    rng = random.Random(seed)
    for n in (1, 2, 7, 100, 1001):
        values = [rng.choice([0, 1, 5, 300, rng.randint(0, 5000)]) for _ in range(n)]
        h = LengthHistogram(size=4)
        for v in values[: n // 2]:
            h.add(v)
        h.add_many(values[n // 2:])
        ordered = sorted(values)
        assert h.median() == median(ordered)
        assert h.index_quantile(0.1) == ordered[int(0.1 * (n - 1))]
        assert h.index_quantile(0.9) == ordered[int(0.9 * (n - 1))]
        assert h.below(300) == sum(1 for v in values if v < 300)
    assert LengthHistogram().median() == 0.0
    with pytest.raises(IndexError):
        LengthHistogram().at(0)


def test_running_figures_equal_the_checks_rules():
    rng = random.Random(3)
    prompts = {f"p{i}": [rng.randint(0, 40) for _ in range(rng.randint(1, 9))] for i in range(500)}
    rows = [dict(r, sample_id=f"p{i % 500}") for i, r in enumerate(_random_rows(rng, 500, prompts))]
    opens = {sid: rng.random() < 0.7 for sid in prompts}
    th = {"short_tokens": 4, "max_share_dropped_error": 0.99, "max_share_dropped_warn": 0.1,
          "max_share_by_reason": {"empty_answer": {"warn": 0.01, "error": 0.99}}}
    monitor = LiveQualityMonitor(PROFILE, th, LiveSpec(warmup_rows=50, report_every_rows=25, example_ids=3),
                                 blank_ids=BLANK, prompt_opens_think=opens, prompt_ids=prompts, vocab_size=VOCAB,
                                 control_ids=CONTROL)
    assert monitor.seed(rows[:200]) == 200
    for row in rows[200:]:
        monitor.observe(row)
    segs = [segment_row(r, PROFILE, prompt_opens_think=opens[r["sample_id"]], prompt_ids=prompts[r["sample_id"]],
                        blank_ids=BLANK, vocab_size=VOCAB, control_ids=CONTROL) for r in rows]
    tokens = [len(r["output_ids"]) for r in rows]
    finish = [r["finish_reason"] for r in rows]
    for this_run, start in ((False, 0), (True, 200)):
        structure, length = monitor.outcomes(this_run_only=this_run)
        assert structure == evaluate_token_structure([s.drop_reason for s in segs[start:]], th)
        assert length == evaluate_response_length(tokens[start:], finish[start:], th)
    snap = monitor.snapshot()
    kept = [s for s in segs if s.kept]
    ordered = sorted(s.reasoning_tokens for s in kept)
    assert snap["reasoning_tokens"]["median"] == median(ordered)
    assert snap["rows"] == 500 and snap["kept"] == len(kept)
    shortest = heapq.nsmallest(3, range(500), key=tokens.__getitem__)
    assert monitor._examples("median_tokens") == tuple(rows[i]["sample_id"] for i in shortest)
    assert monitor.evaluate() is not None
