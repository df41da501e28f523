"""One small hand-made output per drop reason, plus kept rows, segmented against a Qwen-style profile."""

import pytest

from eagle_assets.quality.segment import DROP_REASONS, segment_output
from eagle_assets.target_model.profile import FamilyProfile

THINK, END_THINK, TC, END_TC, IM_END, EOS = 900, 901, 902, 903, 904, 905
PROFILE = FamilyProfile(
    name="custom", think_start_id=THINK, think_end_id=END_THINK, tool_call_start_ids=(TC,),
    tool_call_end_ids=(END_TC,), end_of_turn_id=IM_END, stop_ids=(IM_END, EOS),
)
NL = 10  # a whitespace-only token in these tests


def seg(ids, reason="stop", **kw):
    kw.setdefault("matched_stop", ids[-1] if reason == "stop" and ids else None)
    kw.setdefault("completion_tokens", len(ids))
    return segment_output(ids, reason, PROFILE, blank_ids=frozenset({NL}), **kw)


def test_kept_answer_counts_spans():
    s = seg([1, 2, 3, END_THINK, 4, 5, IM_END])
    assert s.kept and (s.reasoning_tokens, s.answer_tokens, s.tool_call_tokens) == (3, 2, 0)


def test_kept_tool_call_counts_span_with_markers():
    s = seg([1, END_THINK, TC, 7, 8, END_TC, IM_END])
    assert s.kept and s.tool_call_tokens == 4 and s.n_tool_calls == 1 and s.answer_tokens == 4


@pytest.mark.parametrize(
    "ids,finish,kw,reason",
    [
        ([1, 2, END_THINK, 3, IM_END], "abort", {}, "abort"),
        ([1, END_THINK, 3, IM_END], "stop", {"completion_tokens": 7}, "length_mismatch"),
        ([1, 2, 3, 4], "length", {}, "truncated_in_reasoning"),
        ([1, END_THINK, 3, 4], "length", {}, "truncated_in_answer"),
        ([1, END_THINK, 3, 4], "stop", {"matched_stop": IM_END}, "no_stop_token"),
        ([1, END_THINK, 3, IM_END], "stop", {"matched_stop": EOS}, "stop_mismatch"),
        ([1, 2, 3, IM_END], "stop", {}, "missing_think_end"),
        ([1, END_THINK, 2, END_THINK, 3, IM_END], "stop", {}, "multiple_think_end"),
        ([1, END_THINK, TC, 5, IM_END], "stop", {}, "unbalanced_tool_call"),
        ([1, END_THINK, 5, END_TC, IM_END], "stop", {}, "unbalanced_tool_call"),
        ([TC, 1, END_TC, END_THINK, 3, IM_END], "stop", {}, "tool_call_in_reasoning"),
        ([1, 2, END_THINK, IM_END], "stop", {}, "empty_answer"),
        ([1, 2, END_THINK, NL, NL, IM_END], "stop", {}, "empty_answer"),
    ],
)
def test_each_drop_reason(ids, finish, kw, reason):
    s = seg(ids, finish, **kw)
    assert s.drop_reason == reason
    assert reason in DROP_REASONS


def test_every_drop_reason_is_tested():
    reasons = {case[3] for case in test_each_drop_reason.pytestmark[0].args[1]}
    assert reasons == set(DROP_REASONS), set(DROP_REASONS) - reasons


def test_tool_call_in_reasoning_keep_policy_flags_and_keeps():
    s = seg([TC, 1, END_TC, END_THINK, 3, IM_END], tool_call_in_reasoning="keep")
    assert s.kept and s.flags == ("tool_call_in_reasoning",)


def test_prompt_without_think_accepts_plain_answer_and_leading_think_block():
    plain = seg([5, 6, IM_END], prompt_opens_think=False)
    assert plain.kept and plain.reasoning_tokens == 0 and plain.answer_tokens == 2
    think = seg([THINK, 1, 2, END_THINK, 5, IM_END], prompt_opens_think=False)
    assert think.kept and think.reasoning_tokens == 2 and think.answer_tokens == 1
