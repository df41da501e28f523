"""Length report (DuckDB over real Parquet) and threshold evaluation."""

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.catalog import Thresholds
from eagle_assets.qc.lengths import format_table, length_report
from eagle_assets.qc.thresholds import evaluate_response_length, evaluate_token_structure


def _rows(tmp_path, name, completion, reasoning, finish, cap=100):
    n = len(completion)
    t = pa.table({
        "partition": [name] * n, "sample_id": [f"{name}{i}" for i in range(n)],
        "completion_tokens": completion, "reasoning_tokens": reasoning,
        "answer_tokens": [c - r for c, r in zip(completion, reasoning)], "tool_call_tokens": [0] * n,
        "finish_reason": finish, "max_new_tokens": [cap] * n, "kept": [f == "stop" for f in finish],
        "short": [False] * n, "drop_reason": [None if f == "stop" else "truncated_in_answer" for f in finish],
    })
    path = tmp_path / f"{name}.parquet"
    pq.write_table(t, path)
    return path


def test_length_report_figures(tmp_path):
    a = _rows(tmp_path, "A", [10, 20, 30, 40, 100], [5, 10, 15, 20, 50], ["stop"] * 4 + ["length"])
    b = _rows(tmp_path, "B", [500, 1500], [400, 1000], ["stop", "stop"], cap=2000)
    rows = {(r.partition, r.span): r for r in length_report([a, b], short_tokens=25, long_tokens=1000)}
    ta = rows[("A", "total")]
    assert ta.count == 5 and ta.mean == 40.0 and ta.median == 30.0
    assert ta.share_under_short == 0.4 and ta.at_cap == 1 and ta.share_truncated == 0.2
    assert abs(ta.p10 - 14.0) < 1e-9  # linear interpolation between 10 and 20
    assert rows[("A", "reasoning")].median == 15.0 and rows[("A", "answer")].median == 15.0
    tb = rows[("B", "total")]
    assert tb.share_over_long == 0.5 and tb.at_cap == 0
    md = format_table(list(rows.values()))
    assert "| A | total | 5 | 40.0 | 30.0 |" in md


def test_each_partition_is_short_by_its_own_line(tmp_path):
    a = _rows(tmp_path, "A", [10, 20, 30, 40, 100], [5, 10, 15, 20, 50], ["stop"] * 5)
    b = _rows(tmp_path, "B", [500, 1500], [400, 1000], ["stop", "stop"], cap=2000)
    rows = {(r.partition, r.span): r for r in length_report([a, b], short_tokens={"A": 35, "B": 1000})}
    assert rows[("A", "total")].share_under_short == 0.6 and rows[("B", "total")].share_under_short == 0.5
    # a partition the mapping does not name uses the catalog default, 300
    rows = {(r.partition, r.span): r for r in length_report([a, b], short_tokens={"A": 35})}
    assert rows[("B", "total")].share_under_short == 0.0 and rows[("A", "total")].share_under_short == 0.6


def test_length_report_empty():
    assert length_report([]) == []


def test_response_length_levels():
    th = Thresholds(**{"short_tokens": 50, "min_median_tokens": 20, "max_share_short_warn": 0.3,
                       "max_share_short_error": 0.8, "max_share_truncated_warn": 0.01,
                       "max_share_truncated_error": 0.1})
    ok = evaluate_response_length([100] * 10, ["stop"] * 10, th)
    assert ok.passed and ok.level == "OK"
    warn = evaluate_response_length([10] * 4 + [100] * 6, ["stop"] * 10, th)
    assert warn.passed and warn.level == "WARN" and warn.findings[0].figure == "share_under_short"
    cut = evaluate_response_length([100] * 10, ["length"] * 5 + ["stop"] * 5, th)
    assert not cut.passed and cut.level == "ERROR"
    assert any(f.figure == "share_truncated" and f.value == 0.5 and f.threshold == 0.1 for f in cut.findings)
    assert not evaluate_response_length([], [], th).passed


def test_token_structure_levels():
    th = Thresholds(**{"max_share_dropped_warn": 0.05, "max_share_dropped_error": 0.2})
    assert evaluate_token_structure([None] * 20, th).level == "OK"
    bad = evaluate_token_structure([None] * 7 + ["missing_think_end"] * 3, th)
    assert not bad.passed and bad.figures["share_missing_think_end"] == 0.3


def test_token_structure_levels_per_reason():
    """A single reason can WARN or fail the check under its own level while the total stays within its levels."""
    th = Thresholds(**{"max_share_dropped_warn": 0.5, "max_share_dropped_error": 0.9,
          "max_share_by_reason": {"missing_think_end": {"warn": 0.05, "error": 0.15}, "empty_answer": {"warn": 0.01}}})
    rows = [None] * 90 + ["missing_think_end"] * 10
    warn = evaluate_token_structure(rows, th)
    assert warn.passed and warn.level == "WARN"
    assert [(f.figure, f.threshold, f.level) for f in warn.findings] == [("share_missing_think_end", 0.05, "WARN")]
    assert warn.figures["share_empty_answer"] == 0.0  # a reason with a level is shown even at zero
    err = evaluate_token_structure([None] * 80 + ["missing_think_end"] * 20, th)
    assert not err.passed and err.level == "ERROR"
    assert ("share_missing_think_end", 0.2, 0.15, "ERROR") in [(f.figure, f.value, f.threshold, f.level)
                                                                for f in err.findings]
    assert evaluate_token_structure([None] * 99 + ["empty_answer"], th).level == "OK"  # 0.01 is not above 0.01
    assert evaluate_token_structure([None] * 98 + ["empty_answer"] * 2, th).level == "WARN"
