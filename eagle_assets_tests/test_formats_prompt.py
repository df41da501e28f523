"""Prompt policies and stable sample ids."""

from __future__ import annotations

import json

import pytest

from eagle_assets.formats import Conversation, build_prompt, sample_id

MSGS = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "u2"},
    {"role": "assistant", "content": "", "reasoning_content": "r2",
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
    {"role": "tool", "content": "out"},
    {"role": "assistant", "content": "final"},
]


def _conv(messages):
    return Conversation(messages=messages, tools=None, source_row=0, source_record={"m": messages})


def test_last_user_keeps_history_and_returns_next_reply():
    prompt, ref = build_prompt(_conv(MSGS), "last_user")
    assert prompt == MSGS[:4]
    assert ref == {"reasoning_content": "r2", "content": "", "tool_calls": MSGS[4]["tool_calls"]}
    prompt[0]["content"] = "mutated"
    ref["tool_calls"][0]["function"]["arguments"]["x"] = 99
    assert MSGS[0]["content"] == "sys" and MSGS[4]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def test_first_user_keeps_system_and_first_turn():
    prompt, ref = build_prompt(_conv(MSGS), "first_user")
    assert prompt == MSGS[:2]
    assert ref == {"reasoning_content": "r1", "content": "a1", "tool_calls": None}
    prompt, ref = build_prompt(_conv(MSGS[1:2]), "first_user")
    assert prompt == [MSGS[1]] and ref is None


def test_trailing_user_has_no_reference_and_unknown_policy_raises():
    prompt, ref = build_prompt(_conv(MSGS[:4]), "last_user")
    assert prompt == MSGS[:4] and ref is None
    with pytest.raises(ValueError, match="unknown prompt policy"):
        build_prompt(_conv(MSGS), "random_user")


def test_sample_id_is_stable_and_canonical():
    rec = {"b": [1, 2], "a": "ü"}
    sid = sample_id("B1_glaive", rec)
    assert len(sid) == 16 and int(sid, 16) >= 0
    assert sid == sample_id("B1_glaive", json.loads(json.dumps({"a": "ü", "b": [1, 2]})))  # key order irrelevant
    assert sid != sample_id("B2_opencodeinstruct", rec)
    assert sid != sample_id("B1_glaive", {"b": [2, 1], "a": "ü"})
    # pinned value: a change here silently breaks resuming generation shards by sample_id
    assert sample_id("P", {"x": 1}) == __import__("hashlib").sha256(b'P\x00{"x":1}').hexdigest()[:16]
