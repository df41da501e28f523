"""One small hand-made output per drop reason, plus kept rows, segmented against a Qwen-style profile."""

import pytest

from eagle_assets.structure.segment import DROP_REASONS, segment_output
from eagle_assets.target_model.profile import FamilyProfile

THINK, END_THINK, TC, END_TC, IM_END, EOS = 900, 901, 902, 903, 904, 905
PROFILE = FamilyProfile(
    name="custom", think_start_id=THINK, think_end_id=END_THINK, tool_call_start_ids=(TC,),
    tool_call_end_ids=(END_TC,), end_of_turn_id=IM_END, stop_ids=(IM_END, EOS),
)
NL = 10  # a whitespace-only token in these tests
IM_START = 906  # a control id of the chat template: the prompt's generation header starts with it
PROMPT = [40, 41, IM_END, NL, IM_START, 42, NL]
CONTROL = frozenset({THINK, END_THINK, TC, END_TC, IM_END, EOS, IM_START})


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
        ([1, END_THINK, 3, IM_END], "eos", {}, "unknown_finish_reason"),
        ([1, END_THINK, 3, IM_END], None, {}, "unknown_finish_reason"),
        ([1, END_THINK, 3000, IM_END], "stop", {"vocab_size": 2000}, "id_out_of_vocab"),
        ([1, END_THINK, -3, IM_END], "stop", {"vocab_size": 2000}, "id_out_of_vocab"),
        # the prompt's last 3 ids in front, counted: the evidence is the control id IM_START among them
        ([*PROMPT[-3:], 1, END_THINK, 3, IM_END], "stop", {"prompt_ids": PROMPT, "control_ids": CONTROL},
         "prompt_echo"),
        ([1, END_THINK, 3, 4, 5], "length", {"max_new_tokens": 4}, "too_long"),
        ([1, END_THINK, 3, IM_END], "stop", {"prompt_ids": PROMPT, "prompt_tokens": len(PROMPT) + 1},
         "prompt_tokens_mismatch"),
        ([1, END_THINK, 3, IM_END, 7, 8, IM_END], "stop", {}, "stop_token_mid_output"),
        ([1, END_THINK, 3, EOS, 7, 8], "length", {}, "stop_token_mid_output"),
        ([5, END_THINK, 6, IM_END], "stop", {"prompt_opens_think": False}, "think_end_without_start"),
        ([1, THINK, 2, END_THINK, 3, IM_END], "stop", {}, "misplaced_think_start"),
        ([5, THINK, 2, END_THINK, 3, IM_END], "stop", {"prompt_opens_think": False}, "think_end_without_start"),
        ([THINK, 5, THINK, 2, END_THINK, 3, IM_END], "stop", {"prompt_opens_think": False}, "misplaced_think_start"),
        ([1, END_THINK, 3, THINK, IM_END], "stop", {}, "misplaced_think_start"),
        ([1, END_THINK, END_TC, TC, IM_END], "stop", {}, "unbalanced_tool_call"),
        ([1, END_THINK, TC, TC, 5, END_TC, END_TC, IM_END], "stop", {}, "unbalanced_tool_call"),
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


def test_stop_id_exactly_at_the_cap_is_a_whole_turn():
    s = seg([1, END_THINK, 3, IM_END], "length", max_new_tokens=4)
    assert s.kept and s.flags == ("stop_at_length_cap",) and (s.reasoning_tokens, s.answer_tokens) == (1, 1)


def test_reply_beginning_like_the_prompt_tail_is_kept_without_evidence():
    # the reply starts with the prompt's last 2 ids [42, NL]: ordinary ids, counts agree, under the cap
    s = seg([42, NL, 1, END_THINK, 3, IM_END], prompt_ids=PROMPT, control_ids=CONTROL, max_new_tokens=16)
    assert s.kept and s.reasoning_tokens == 3
    # the same ids, uncounted (completion_tokens 2 short), are an echo by the counts
    assert seg([42, NL, 1, END_THINK, 3, IM_END], prompt_ids=PROMPT, completion_tokens=4).drop_reason == "prompt_echo"
    # ... and over the cap by exactly those ids, an echo by the cap
    assert seg([42, NL, 1, END_THINK, 3, IM_END], prompt_ids=PROMPT, max_new_tokens=4).drop_reason == "prompt_echo"


def test_nested_tool_pairs_pair_up_by_kind():
    sec, call, end_call, end_sec = 950, 951, 952, 953
    prof = FamilyProfile("custom", THINK, END_THINK, (sec, call), (end_sec, end_call), IM_END, (IM_END,))
    ok = segment_output([1, END_THINK, sec, call, 5, end_call, call, 6, end_call, end_sec, IM_END], "stop", prof)
    assert ok.kept and ok.n_tool_calls == 2 and ok.tool_call_tokens == 8
    crossed = segment_output([1, END_THINK, sec, call, 5, end_sec, end_call, IM_END], "stop", prof)
    assert crossed.drop_reason == "unbalanced_tool_call"


def test_prompt_without_think_accepts_plain_answer_and_leading_think_block():
    plain = seg([5, 6, IM_END], prompt_opens_think=False)
    assert plain.kept and plain.reasoning_tokens == 0 and plain.answer_tokens == 2
    think = seg([THINK, 1, 2, END_THINK, 5, IM_END], prompt_opens_think=False)
    assert think.kept and think.reasoning_tokens == 2 and think.answer_tokens == 1
