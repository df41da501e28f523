"""The live monitor's running figures (counters + exact length histograms) against the list-based rules of the
blocking checks, over a seeded stream of fuzzed rows (seeded earlier-run rows first, then this run's rows)."""

import heapq
import random
from statistics import median

import pytest
from test_quality_fuzz_replies import BLANK, CONTROL, VOCAB
from test_quality_qc_pass import PROFILE, _random_rows

from eagle_assets.catalog import LiveSpec, Thresholds
from eagle_assets.figures.running import LengthHistogram
from eagle_assets.qc.live import LiveQualityMonitor
from eagle_assets.qc.thresholds import evaluate_response_length, evaluate_token_structure
from eagle_assets.structure.segment import segment_row


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
    th = Thresholds(**{"short_tokens": 4, "max_share_dropped_error": 0.99, "max_share_dropped_warn": 0.1,
          "max_share_by_reason": {"empty_answer": {"warn": 0.01, "error": 0.99}}})
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


def test_array_fed_monitor_equals_the_per_row_reference_on_every_drop_reason():
    """The monitor as ``run_generation`` feeds it (int32 ``output_ids`` arrays, prompt ids as numpy views read per
    batch from a ``PromptsFile``) against the list-fed monitor at every report, and against ``segment_row`` per row,
    over test_quality_segment.py's case of every drop reason (grouped by the vocab and control ids they need)."""
    import json
    from collections import Counter

    import numpy as np
    import pyarrow as pa
    import test_quality_segment as hand

    from eagle_assets.structure.segment import DROP_REASONS
    from eagle_assets.tokenized_prompts.prompts_file import PromptsFile

    groups: dict = {}
    for n, (ids, finish, kw, reason) in enumerate(hand.test_each_drop_reason.pytestmark[0].args[1]):
        kw = dict(kw)
        key = (kw.pop("vocab_size", None), kw.pop("control_ids", None))
        for copy in range(3):  # each case three times, interleaved with the other cases of its group
            row = {"sample_id": f"c{n}_{copy}", "output_ids": list(ids), "finish_reason": finish,
                   "completion_tokens": kw.get("completion_tokens", len(ids)),
                   "matched_stop": kw.get("matched_stop", ids[-1] if finish == "stop" and ids else None),
                   "prompt_tokens": kw.get("prompt_tokens"),
                   "sampling_params": json.dumps({"max_new_tokens": kw["max_new_tokens"]})
                   if "max_new_tokens" in kw else None}
            groups.setdefault(key, []).append((copy, row, kw.get("prompt_ids", hand.PROMPT),
                                               kw.get("prompt_opens_think", True)))
    seen = Counter()
    for (vocab, control), entries in groups.items():
        entries.sort(key=lambda e: e[0])
        rows = [e[1] for e in entries]
        prompts = {r["sample_id"]: list(p) for r, (_, _, p, _) in zip(rows, entries)}
        opens = {r["sample_id"]: o for r, (*_, o) in zip(rows, entries)}
        pf = PromptsFile.from_table(pa.table({"sample_id": list(prompts),
                                              "prompt_ids": pa.array(list(prompts.values()), pa.list_(pa.int32())),
                                              "prompt_opens_think": [opens[s] for s in prompts]}))
        th = Thresholds(**{"short_tokens": 3, "max_share_dropped_warn": 0.3, "max_share_dropped_error": 0.99})
        live = LiveSpec(warmup_rows=2, report_every_rows=3, example_ids=2)
        kw = dict(blank_ids=frozenset({hand.NL}), vocab_size=vocab, control_ids=control)
        by_lists = LiveQualityMonitor(hand.PROFILE, th, live, prompt_opens_think=opens, prompt_ids=prompts, **kw)
        by_arrays = LiveQualityMonitor(hand.PROFILE, th, live, prompt_opens_think=pf.opens_map(hand.PROFILE),
                                       prompt_ids=pf.ids_map(arrays=True), **kw)
        reports = 0
        for row in rows:
            by_lists.observe(row)
            by_arrays.observe(dict(row, output_ids=np.array(row["output_ids"], dtype=np.int32)))
            assert by_lists.report_due() == by_arrays.report_due()
            if by_lists.report_due():
                reports += 1
                assert by_lists.evaluate() == by_arrays.evaluate()
                assert by_lists.snapshot() == by_arrays.snapshot()
        assert reports >= len(rows) // 3 - 1
        segs = [segment_row(r, hand.PROFILE, prompt_opens_think=opens[r["sample_id"]],
                            prompt_ids=prompts[r["sample_id"]], **kw) for r in rows]
        for monitor in (by_lists, by_arrays):
            structure, length = monitor.outcomes()
            assert structure == evaluate_token_structure([s.drop_reason for s in segs], th)
            assert length == evaluate_response_length([len(r["output_ids"]) for r in rows],
                                                      [r["finish_reason"] for r in rows], th)
        want = Counter(s.drop_reason for s in segs if s.drop_reason)
        assert by_arrays.snapshot()["drop_reasons"] == dict(want)
        seen.update(want)
    assert set(seen) == set(DROP_REASONS)
