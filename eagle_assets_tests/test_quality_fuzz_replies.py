"""Fuzz over replies: ``parse_generate_reply`` and the segmentation never crash, and never keep a malformed row.

"Malformed" is decided by an oracle written independently of ``segment_output``: the output ids are spelled as a
string of token classes and a kept row must match a regular grammar of whole turns, per family rule (prompt opens
the block or not, ``tool_call_ends_reasoning``, ``implicit_think_start``, the tool-call policy), plus the protocol
facts checked directly (counts, vocab, cap, matched stop id, no prompt echo with evidence). Hypothesis runs
derandomized (a fixed seed), so a failure reproduces.
"""

from __future__ import annotations

import json
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_assets.serving.protocol import GenerateReply, ReplyError, parse_generate_reply
from eagle_assets.structure.segment import DROP_REASONS, segment_output, segment_row
from eagle_assets.target_model.profile import FamilyProfile

VOCAB = 64
THINK, END_THINK, TOOL, END_TOOL, EOT, EOS, IM_START = 50, 51, 52, 53, 54, 55, 56
BLANK = frozenset({10, 11})
ORDINARY = list(range(12, 20))
CONTROL = frozenset({THINK, END_THINK, TOOL, END_TOOL, EOT, EOS, IM_START})
PROMPT = [20, 21, 22, IM_START, 23, 10]  # ends with a generation prompt: control id, ordinary, blank
CLASS = {THINK: "S", END_THINK: "E", TOOL: "T", END_TOOL: "U", EOT: "P", EOS: "P", **{b: "b" for b in BLANK}}
FUZZ = settings(max_examples=400, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _profile(tool_ends: bool, implicit: bool) -> FamilyProfile:
    return FamilyProfile("custom", THINK, END_THINK, (TOOL,), (END_TOOL,), EOT, (EOT, EOS),
                         tool_call_ends_reasoning=tool_ends, implicit_think_start=implicit)


def _spell(ids: list[int]) -> str:
    return "".join(CLASS.get(t, "o") for t in ids)


def _echo_evidence(out: list[int], completion: int | None, cap: int | None) -> bool:
    """Independent of protocol.prompt_echo_length: any head of out equal to a prompt tail, with evidence."""
    for k in range(1, min(len(out), len(PROMPT)) + 1):
        if out[:k] != PROMPT[len(PROMPT) - k:]:
            continue
        if set(out[:k]) & CONTROL or (completion is not None and len(out) - completion == k) or \
                (cap is not None and len(out) - cap == k):
            return True
    return False


def well_formed(out, finish, matched, completion, opens, tool_ends, implicit, policy, cap) -> bool:
    """The oracle: is this reply a whole, exact training row?"""
    if finish not in ("stop", "length") or not out:
        return False
    if any(not 0 <= t < VOCAB for t in out) or (completion is not None and completion != len(out)):
        return False
    if (cap is not None and len(out) > cap) or _echo_evidence(out, completion, cap):
        return False
    if out[-1] not in (EOT, EOS) or (finish == "stop" and isinstance(matched, int) and matched != out[-1]):
        return False
    body = _spell(out[:-1])
    reasoning = "[obTU]*" if policy == "keep" else "[ob]*"
    answer = r"(?=[obTU]*[oTU])(?:[ob]|T[ob]*U)*"  # balanced single-kind pairs, not blank only
    forms = []
    if opens:
        forms.append(f"{reasoning}E{answer}")
        if tool_ends:
            forms.append(f"[ob]*(?=T){answer}")  # no think-end: the section starts the answer
    else:
        forms += [f"S{reasoning}E{answer}", f"(?!.*[SE]){answer}"]
        if tool_ends:
            forms.append(f"S[ob]*(?=T){answer}")
        if implicit:
            forms.append(f"{reasoning}E{answer}")
    return any(re.fullmatch(f, body) and body.count("E") <= 1 and "S" not in body[1:] for f in forms)


ids_strategy = st.lists(st.one_of(st.sampled_from([THINK, END_THINK, TOOL, END_TOOL, EOT, EOS, IM_START]),
                                  st.sampled_from(ORDINARY + sorted(BLANK)), st.integers(-3, VOCAB + 3)),
                        max_size=24)


@st.composite
def rows(draw):
    out = draw(ids_strategy)
    if draw(st.booleans()):  # a structurally plausible reply often: reasoning, think-end, answer, stop
        out = draw(st.lists(st.sampled_from(ORDINARY + sorted(BLANK)), max_size=4)) + [END_THINK] + \
            draw(st.lists(st.sampled_from(ORDINARY + [TOOL, END_TOOL]), max_size=5)) + [EOT]
        if draw(st.booleans()):
            out = [THINK] + out
    if draw(st.booleans()):
        out = PROMPT[-draw(st.integers(1, len(PROMPT))):] + out  # a head equal to the prompt's tail
    finish = draw(st.sampled_from(["stop", "stop", "length", "abort", "eos", None]))
    matched = draw(st.sampled_from([None, "last", EOT, EOS, 7]))
    matched = (out[-1] if out else None) if matched == "last" else matched
    delta = draw(st.sampled_from([0, 0, 0, -1, 1, 2, None]))
    completion = None if delta is None else max(0, len(out) - delta)
    cap = draw(st.sampled_from([None, 64, len(out), max(1, len(out) - 1)]))
    return out, finish, matched, completion, cap


@FUZZ
@given(row=rows(), opens=st.booleans(), tool_ends=st.booleans(), implicit=st.booleans(),
       policy=st.sampled_from(["drop", "keep"]))
def test_segmentation_never_crashes_and_never_keeps_a_malformed_row(row, opens, tool_ends, implicit, policy):
    out, finish, matched, completion, cap = row
    seg = segment_output(out, finish, _profile(tool_ends, implicit), matched_stop=matched if isinstance(matched, int)
                         else None, completion_tokens=completion, prompt_opens_think=opens,
                         tool_call_in_reasoning=policy, blank_ids=BLANK, prompt_ids=PROMPT, vocab_size=VOCAB,
                         control_ids=CONTROL, max_new_tokens=cap)
    assert seg.drop_reason is None or seg.drop_reason in DROP_REASONS
    if seg.kept:
        m = matched if isinstance(matched, int) else None
        assert well_formed(out, finish, m, completion, opens, tool_ends, implicit, policy, cap), (_spell(out), seg)
        assert seg.reasoning_tokens + seg.answer_tokens < len(out)
        assert 0 <= seg.tool_call_tokens <= seg.answer_tokens


@FUZZ
@given(row=rows(), opens=st.booleans(), tool_ends=st.booleans(), implicit=st.booleans())
def test_reply_through_client_and_qc_is_kept_only_when_well_formed(row, opens, tool_ends, implicit):
    out, finish, matched, completion, cap = row
    fr = {"type": finish, "matched": matched} if finish == "stop" else \
        {"type": "length", "length": cap} if finish == "length" else {"type": finish}
    body = {"text": "", "output_ids": out, "meta_info": {"id": "r", "finish_reason": fr, "prompt_tokens": len(PROMPT),
                                                         "completion_tokens": completion}}
    try:
        reply = parse_generate_reply(json.dumps(body), PROMPT, VOCAB, max_new_tokens=cap, rid="r", control_ids=CONTROL)
    except ReplyError:
        return
    assert isinstance(reply, GenerateReply) and len(reply.output_ids) == reply.completion_tokens
    assert all(0 <= t < VOCAB for t in reply.output_ids) and (cap is None or len(reply.output_ids) <= cap)
    assert not _echo_evidence(reply.output_ids, reply.completion_tokens, cap)
    stored = {"sample_id": "r", "output_ids": reply.output_ids, "finish_reason": reply.finish_reason.type,
              "matched_stop": reply.finish_reason.matched if isinstance(reply.finish_reason.matched, int) else None,
              "completion_tokens": reply.completion_tokens, "prompt_tokens": reply.prompt_tokens,
              "sampling_params": json.dumps({"max_new_tokens": cap}) if cap else None}
    seg = segment_row(stored, _profile(tool_ends, implicit), prompt_opens_think=opens, prompt_ids=PROMPT,
                      blank_ids=BLANK, vocab_size=VOCAB, control_ids=CONTROL)
    if seg.kept:
        assert well_formed(reply.output_ids, stored["finish_reason"], stored["matched_stop"],
                           reply.completion_tokens, opens, tool_ends, implicit, "drop", cap), _spell(out)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True) |
                           st.text(max_size=8), lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


@FUZZ
@given(
    output_ids=st.one_of(json_values, ids_strategy),
    finish=st.one_of(json_values, st.fixed_dictionaries({"type": st.sampled_from(["stop", "length", "abort"])},
                                                        optional={"matched": json_values, "length": json_values,
                                                                  "status_code": json_values})),
    meta_extra=st.dictionaries(st.sampled_from(["completion_tokens", "prompt_tokens", "id", "e2e_latency",
                                                "cached_tokens"]), json_values, max_size=5),
    top=st.dictionaries(st.sampled_from(["error", "text", "junk"]), json_values, max_size=2),
    raw=st.one_of(st.none(), st.binary(max_size=40)),
)
def test_parse_reply_never_raises_anything_but_reply_error(output_ids, finish, meta_extra, top, raw):
    body = raw if raw is not None else {**top, "output_ids": output_ids, "meta_info": {"finish_reason": finish,
                                                                                          **meta_extra}}
    try:
        sent = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True)
        reply = parse_generate_reply(sent, PROMPT, VOCAB, max_new_tokens=32, control_ids=CONTROL)
    except ReplyError as exc:
        assert exc.kind and exc.detail
        return
    assert len(reply.output_ids) == reply.completion_tokens and reply.finish_reason.type in ("stop", "length")
    assert all(type(t) is int and 0 <= t < VOCAB for t in reply.output_ids)
    if isinstance(reply.finish_reason.matched, int):
        assert reply.output_ids and reply.output_ids[-1] == reply.finish_reason.matched


@FUZZ
@given(row=st.dictionaries(st.sampled_from(["output_ids", "finish_reason", "matched_stop", "completion_tokens",
                                            "prompt_tokens", "sampling_params"]),
                           st.one_of(st.none(), ids_strategy, st.sampled_from(["stop", "length", "abort", "x"]),
                                     st.integers(-2, 40), st.sampled_from(['{"max_new_tokens": 8}', "{", "[]", ""]))))
def test_stored_rows_of_any_producer_never_crash_qc(row):
    row = {"sample_id": "x", **row}
    if not isinstance(row.get("output_ids"), (list, type(None))):
        row["output_ids"] = None
    if not isinstance(row.get("completion_tokens"), (int, type(None))):
        row["completion_tokens"] = None
    if not isinstance(row.get("prompt_tokens"), (int, type(None))):
        row["prompt_tokens"] = None
    if not isinstance(row.get("finish_reason"), (str, type(None))):
        row["finish_reason"] = None
    seg = segment_row(row, _profile(True, False), prompt_opens_think=True, prompt_ids=PROMPT, blank_ids=BLANK,
                      vocab_size=VOCAB, control_ids=CONTROL)
    assert seg.kept or seg.drop_reason in DROP_REASONS
