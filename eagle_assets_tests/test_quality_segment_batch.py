"""``segment_batch`` (vectorised) against the per-row reference ``segment_row`` / ``segment_output``, row for row.

Corpora: every hand-made case of test_quality_segment.py, every keep and drop case of test_quality_families.py on the
real Qwen3 / DeepSeek / Kimi tokenizers (all families in one batch per family, so rows sit next to each other in the
flat arrays as they do in a shard), and hypothesis batches of test_quality_fuzz_replies.py's rows (seeded:
derandomize). Equal means the same drop reason, the same flags and the same span lengths.
"""

import json

import numpy as np
import pyarrow as pa
import pytest
import test_quality_fuzz_replies as fuzz
import test_quality_segment as hand
from hypothesis import given
from hypothesis import strategies as st
from test_quality_families import FAMILY_NAMES, _drop_cases, _keep_cases, deepseek_tok, families, kimi_tok, qwen_tok  # noqa: F401  (fixtures used by name)

from eagle_assets.generations.run import GENERATION_SCHEMA
from eagle_assets.qc.segment_batch import segment_batch, segment_flat
from eagle_assets.structure.segment import DROP_REASONS, segment_output, segment_row

pytestmark = pytest.mark.slow(seconds=40)  # its share of a parallel session: scheduled early (conftest)


def _table(rows: list[dict]) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in rows] for f in GENERATION_SCHEMA}
    cols["sample_id"] = [r.get("sample_id", str(i)) for i, r in enumerate(rows)]
    return pa.table(cols, schema=GENERATION_SCHEMA)


def _assert_same(rows, profile, *, opens, prompts, **kw):
    """segment_batch over all rows == segment_row of each row."""
    table = _table(rows)
    prompt_col = None if prompts is None else pa.array(prompts, type=pa.list_(pa.int32()))
    got = segment_batch(table, profile, prompt_opens_think=np.array(opens, dtype=bool), prompt_ids=prompt_col, **kw)
    assert len(got) == len(rows)
    for i, row in enumerate(rows):
        want = segment_row(row, profile, prompt_opens_think=opens[i],
                           prompt_ids=None if prompts is None else prompts[i], **kw)
        assert got.row(i) == want, (i, row, want, got.row(i))
    return got


def test_hand_made_cases_of_every_drop_reason():
    cases = hand.test_each_drop_reason.pytestmark[0].args[1]
    seen = set()
    for ids, finish, kw, reason in cases:
        kw = dict(kw)
        row = {"output_ids": ids, "finish_reason": finish, "completion_tokens": kw.pop("completion_tokens", len(ids)),
               "matched_stop": kw.pop("matched_stop", ids[-1] if finish == "stop" and ids else None),
               "prompt_tokens": kw.pop("prompt_tokens", None)}
        if "max_new_tokens" in kw:
            row["sampling_params"] = json.dumps({"max_new_tokens": kw.pop("max_new_tokens")})
        opens = kw.pop("prompt_opens_think", True)
        prompt = kw.pop("prompt_ids", None)
        got = _assert_same([row], hand.PROFILE, opens=[opens], prompts=None if prompt is None else [prompt],
                           blank_ids=frozenset({hand.NL}), **kw)
        seen.add(got.drop_reasons()[0])
    assert seen == set(DROP_REASONS)


def test_hand_made_cases_in_one_batch_through_segment_flat():
    """All cases in one flat array: neighbours must not leak into each other's rows (per-batch settings fixed)."""
    cases = [c for c in hand.test_each_drop_reason.pytestmark[0].args[1]
             if not {"vocab_size", "control_ids", "prompt_ids"} & set(c[2])]
    extra = [([hand.TC, 1, hand.END_TC, hand.END_THINK, 3, hand.IM_END], "stop", {}),
             ([1, hand.END_THINK, 3, hand.IM_END], "length", {"max_new_tokens": 4}),
             ([hand.THINK, 1, 2, hand.END_THINK, 5, hand.IM_END], "stop", {"prompt_opens_think": False}),
             ([5, 6, hand.IM_END], "stop", {"prompt_opens_think": False}), ([], "stop", {}), ([], "length", {})]
    for policy in ("drop", "keep"):
        ids_all, finish, matched, completion, opens, caps, want = [], [], [], [], [], [], []
        for ids, fin, kw, *_ in [*cases, *extra]:
            m = kw.get("matched_stop", ids[-1] if fin == "stop" and ids else None)
            c = kw.get("completion_tokens", len(ids))
            o = kw.get("prompt_opens_think", True)
            cap = kw.get("max_new_tokens")
            ids_all.append(ids), finish.append(fin), matched.append(m), completion.append(c), opens.append(o)
            caps.append(cap)
            want.append(segment_output(ids, fin, hand.PROFILE, matched_stop=m, completion_tokens=c,
                                       prompt_opens_think=o, tool_call_in_reasoning=policy,
                                       blank_ids=frozenset({hand.NL}), max_new_tokens=cap))
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids_all])])
        values = np.array([t for x in ids_all for t in x], dtype=np.int32)
        got = segment_flat(values, offsets, finish, hand.PROFILE, matched_stop=matched, completion_tokens=completion,
                           prompt_opens_think=np.array(opens), tool_call_in_reasoning=policy,
                           blank_ids=frozenset({hand.NL}), max_new_tokens=caps)
        assert [got.row(i) for i in range(len(want))] == want


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_keep_and_drop_cases_with_real_tokenizers(request, name):
    f = request.getfixturevalue("families")[name]
    rows = [*_keep_cases(f).values(), *_drop_cases(f).values()]
    for policy in ("drop", "keep"):
        got = _assert_same(rows, f.profile, opens=[f.rendered_opens] * len(rows), prompts=[f.prompt_ids] * len(rows),
                           tool_call_in_reasoning=policy, blank_ids=f.blank, vocab_size=f.vocab,
                           control_ids=f.control)
        assert int(got.kept.sum()) >= len(_keep_cases(f))


@fuzz.FUZZ
@given(batch=st.lists(st.tuples(fuzz.rows(), st.booleans(), st.booleans()), min_size=1, max_size=12),
       tool_ends=st.booleans(), implicit=st.booleans(), policy=st.sampled_from(["drop", "keep"]),
       control=st.booleans())
def test_fuzzed_batches_match_the_reference(batch, tool_ends, implicit, policy, control):
    rows, opens, prompts = [], [], []
    for (out, finish, matched, completion, cap), o, with_prompt in batch:
        rows.append({"output_ids": out, "finish_reason": finish, "matched_stop": matched if isinstance(matched, int)
                     else None, "completion_tokens": completion, "prompt_tokens": len(fuzz.PROMPT),
                     "sampling_params": None if cap is None else json.dumps({"max_new_tokens": cap})})
        opens.append(o)
        prompts.append(fuzz.PROMPT if with_prompt else None)
    _assert_same(rows, fuzz._profile(tool_ends, implicit), opens=opens, prompts=prompts,
                 tool_call_in_reasoning=policy, blank_ids=fuzz.BLANK, vocab_size=fuzz.VOCAB,
                 control_ids=fuzz.CONTROL if control else None)


def test_rows_of_another_producer_go_through_the_reference():
    """int64 ids, string counts, no matched_stop column: the same results as segment_row, no crash."""
    rows = [{"output_ids": [1, hand.END_THINK, 3, hand.IM_END], "finish_reason": "stop", "completion_tokens": "4"},
            {"output_ids": None, "finish_reason": "length", "completion_tokens": "x"}]
    table = pa.table({"output_ids": pa.array([r["output_ids"] for r in rows], type=pa.list_(pa.int64())),
                      "finish_reason": [r["finish_reason"] for r in rows],
                      "completion_tokens": [r["completion_tokens"] for r in rows]})
    got = segment_batch(table, hand.PROFILE)
    assert [got.row(i) for i in range(2)] == [segment_row(r, hand.PROFILE) for r in rows]
    ints = pa.table({"output_ids": pa.array([[1, hand.END_THINK, 3, hand.IM_END], None], type=pa.list_(pa.int64())),
                     "finish_reason": ["stop", None]})
    got = segment_batch(ints, hand.PROFILE)
    assert got.drop_reasons() == [None, "unknown_finish_reason"]


def test_sliced_batches_and_bad_offsets():
    table = _table([{"output_ids": [9, hand.END_THINK, 3, hand.IM_END], "finish_reason": "stop",
                     "completion_tokens": 4, "matched_stop": hand.IM_END}] * 5)
    part = table.slice(2, 2)  # offsets that do not start at 0
    got = segment_batch(part, hand.PROFILE)
    assert got.drop_reasons() == [None, None] and got.reasoning_tokens.tolist() == [1, 1]
    with pytest.raises(ValueError, match="offsets"):
        segment_flat(np.zeros(3, dtype=np.int32), np.array([0, 5]), ["stop"], hand.PROFILE)
    with pytest.raises(ValueError, match="tool_call_in_reasoning"):
        segment_flat(np.zeros(0, dtype=np.int32), np.array([0]), [], hand.PROFILE, tool_call_in_reasoning="x")


def test_echo_found_by_the_replys_shape_matches_the_reference_with_flags():
    """Rows that begin with the prompt's ordinary tail ids, counted (no count, cap or control-id evidence): the
    vectorised path must call an echo exactly where the reference does, with no flags left from later rules."""
    from dataclasses import replace

    t = hand
    prompt = [t.IM_START, 40, 41]  # a generation prompt ending with two ordinary ids
    whole = [t.THINK, 1, t.END_THINK, 5, t.IM_END]
    cases = [
        (prompt[-2:] + whole, "stop", False),  # whole only without the head: an echo
        (prompt[-1:] + whole, "stop", False),
        (prompt[-1:] + [5, 6, t.IM_END], "stop", False),  # whole as it stands: kept
        # whole as it stands under implicit_think_start, malformed both ways without it
        (prompt[-2:] + [1, t.END_THINK, 5, t.IM_END], "stop", False),
        (prompt[-2:] + [t.THINK, 1, 2], "length", False),  # a cut: whole so far only without the head
        (prompt[-2:] + whole, "length", False),  # stop id at the cap: flagged in the reference if kept
        (prompt[-2:] + [9, t.END_THINK, 5, t.IM_END], "stop", True),  # opened by the prompt: whole as it stands
        (prompt[-2:] + [t.THINK, 1, 2, t.END_THINK, t.END_THINK, t.IM_END], "stop", False),  # malformed both ways
    ]
    for implicit in (False, True):
        profile = replace(t.PROFILE, implicit_think_start=implicit)
        rows = [{"output_ids": ids, "finish_reason": fin, "completion_tokens": len(ids),
                 "matched_stop": ids[-1] if fin == "stop" else None, "prompt_tokens": len(prompt),
                 "sampling_params": json.dumps({"max_new_tokens": 64})} for ids, fin, _ in cases]
        got = _assert_same(rows, profile, opens=[o for *_, o in cases], prompts=[prompt] * len(rows),
                           blank_ids=frozenset({t.NL}), control_ids=frozenset({t.IM_START, t.THINK, t.END_THINK,
                                                                               t.IM_END}))
        reasons = got.drop_reasons()
        assert reasons[0] == reasons[1] == reasons[4] == "prompt_echo" and reasons[2] is None
        assert reasons[3] == (None if implicit else "think_end_without_start") and reasons[6] is None
        assert reasons[7] not in (None, "prompt_echo")
