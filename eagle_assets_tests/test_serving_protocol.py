"""SamplingParams and parse_generate_reply against SGLang's /generate shapes, including the traps DESIGN.md section 4
lists."""

from __future__ import annotations

import json

import orjson
import pytest

from eagle_assets.serving.protocol import FinishReason, ReplyError, SamplingParams, parse_generate_reply

PROMPT = [11, 12, 13, 14, 15]


def reply(output_ids=(20, 21, 2), finish=None, **meta) -> dict:
    out = list(output_ids)
    meta_info = {
        "id": "r1",
        "finish_reason": finish if finish is not None else {"type": "stop", "matched": 2},
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(out),
        "cached_tokens": 0,
        "e2e_latency": 0.25,
    }
    meta_info.update(meta)
    return {"text": "x", "output_ids": out, "meta_info": meta_info}


def test_max_new_tokens_is_required_and_explains_sglang_default():
    with pytest.raises(ValueError, match="silently caps a request without it at 128"):
        SamplingParams()
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams.from_json({"temperature": 0})


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(max_new_tokens=8, **kwargs)


def test_sampling_params_wire_format_uses_sglang_names():
    sp = SamplingParams(max_new_tokens=64, temperature=0, top_k=-1, stop_token_ids=[7, 2], seed=5)
    assert sp.stop_token_ids == (7, 2) and sp.greedy
    assert sp.to_json() == {
        "max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "skip_special_tokens": False,
        "stop_token_ids": [7, 2], "sampling_seed": 5,
    }
    assert SamplingParams.from_json(sp.to_json()) == sp
    assert SamplingParams.from_json({"max_new_tokens": 3, "seed": 9}).seed == 9
    # SGLang's own defaults for a sparse dict
    sparse = SamplingParams.from_json({"max_new_tokens": 3})
    assert (sparse.temperature, sparse.top_p, sparse.top_k, sparse.skip_special_tokens) == (1.0, 1.0, -1, True)
    assert not sparse.greedy
    assert SamplingParams.from_json({}, default_max_new_tokens=128).max_new_tokens == 128
    # keys at SGLang's defaults are accepted, other values are refused with the key named
    assert SamplingParams.from_json({"max_new_tokens": 3, "n": 1, "stop": [], "repetition_penalty": 1.0})
    with pytest.raises(ValueError, match=r"\['stop'\]"):
        SamplingParams.from_json({"max_new_tokens": 3, "stop": ["</s>"]})
    with pytest.raises(ValueError, match=r"\['no_stop_trim'\]"):
        SamplingParams.from_json({"max_new_tokens": 3, "no_stop_trim": True})
    with pytest.raises(ValueError, match="unknown sampling_params keys"):
        SamplingParams.from_json({"max_new_tokens": 3, "max_tokens": 3})


def test_parse_valid_stop_and_length_replies():
    got = parse_generate_reply(json.dumps(reply()).encode(), PROMPT, 100, max_new_tokens=8, rid="r1")
    assert got.output_ids == [20, 21, 2] and got.completion_tokens == 3 and got.prompt_tokens == 5
    assert got.finish_reason == FinishReason(type="stop", matched=2)
    assert got.e2e_latency == 0.25 and got.cached_tokens == 0 and got.rid == "r1"
    length = parse_generate_reply(reply(finish={"type": "length", "length": 3}), PROMPT, 100, max_new_tokens=3)
    assert length.finish_reason.type == "length" and length.finish_reason.length == 3
    # a stop string match (FINISH_MATCHED_STR) is a stop without a token id
    text_stop = parse_generate_reply(reply(finish={"type": "stop", "matched": "</answer>"}), PROMPT, 100)
    assert text_stop.finish_reason.matched == "</answer>"
    # one-element list form of FINISH_MATCHED_TOKEN.matched
    assert parse_generate_reply(reply(finish={"type": "stop", "matched": [2]}), PROMPT, 100).finish_reason.matched == 2


def _kind(obj, **kwargs) -> ReplyError:
    with pytest.raises(ReplyError) as info:
        parse_generate_reply(obj, kwargs.pop("prompt", PROMPT), kwargs.pop("vocab", 100), **kwargs)
    return info.value


def test_truncated_and_non_object_bodies():
    body = json.dumps(reply()).encode()
    assert _kind(body[: len(body) // 2]).kind == "bad_json"
    assert _kind(b"").kind == "bad_json"
    assert _kind([reply()]).kind == "not_object"
    err = _kind({"error": {"message": "The input (9000 tokens) is longer than the model's context length"}})
    assert err.kind == "server_error" and "context length" in err.detail


def test_missing_and_mistyped_fields():
    no_meta = reply()
    del no_meta["meta_info"]
    assert _kind(no_meta).kind == "missing_field"
    no_ids = reply()
    del no_ids["output_ids"]
    assert _kind(no_ids).kind == "missing_field"
    no_ct = reply()
    del no_ct["meta_info"]["completion_tokens"]
    assert _kind(no_ct).kind == "missing_field"
    assert _kind(reply(output_ids=[20, "21", 2])).kind == "bad_type"
    assert _kind(reply(output_ids=[20, 21.0, 2])).kind == "bad_type"
    assert _kind(reply(output_ids=[20, True, 2])).kind == "bad_type"
    assert _kind(reply(completion_tokens="3")).kind == "bad_type"


def test_ids_outside_the_vocab():
    err = _kind(reply(output_ids=[20, 100, 2]))
    assert err.kind == "id_out_of_vocab" and "output_ids[1] = 100" in err.detail
    assert _kind(reply(output_ids=[-1, 2])).kind == "id_out_of_vocab"
    # no vocab: no range check
    assert parse_generate_reply(reply(output_ids=[20, 100, 2]), PROMPT, None).output_ids[1] == 100


def test_completion_tokens_disagreement_and_prompt_echo():
    assert _kind(reply(completion_tokens=2)).kind == "length_mismatch"
    assert _kind(reply(completion_tokens=4)).kind == "length_mismatch"
    # an SGLang version returning the incremental-detokenization prompt tail before the completion
    echoed = reply(output_ids=PROMPT[-3:] + [20, 21, 2])
    echoed["meta_info"]["completion_tokens"] = 3
    err = _kind(echoed)
    assert err.kind == "prompt_echo" and "last 3 prompt ids" in err.detail
    # the same extra ids that do NOT equal the prompt tail are just a mismatch
    other = reply(output_ids=[90, 91, 92, 20, 21, 2])
    other["meta_info"]["completion_tokens"] = 3
    assert _kind(other).kind == "length_mismatch"


def test_reply_that_belongs_to_another_request():
    assert _kind(reply(prompt_tokens=6)).kind == "prompt_tokens_mismatch"
    assert _kind(reply(), rid="r2").kind == "rid_mismatch"
    assert _kind(reply(output_ids=[20, 21, 22, 2]), max_new_tokens=3).kind == "too_long"


def test_finish_reason_checks():
    assert _kind(reply(finish={"type": "eos"})).kind == "unknown_finish_reason"
    none = reply()
    none["meta_info"]["finish_reason"] = None
    assert _kind(none).kind == "unknown_finish_reason"
    err = _kind(reply(finish={"type": "stop", "matched": 7}))
    assert err.kind == "stop_mismatch" and "last output id is 2" in err.detail
    assert _kind(reply(finish={"type": "stop", "matched": "NaN happened"})).kind == "nan_output"


def test_abort_is_retryable_unless_the_server_refused_the_request():
    aborted = _kind(reply(output_ids=[], finish={"type": "abort", "message": "Abort before prefill"}))
    assert aborted.kind == "abort" and aborted.retryable and "Abort before prefill" in aborted.detail
    refused = _kind(reply(output_ids=[], finish={"type": "abort", "message": "too long", "status_code": 400,
                                                  "err_type": "BadRequestError"}))
    assert refused.kind == "abort" and not refused.retryable
    assert _kind(reply(completion_tokens=9)).retryable  # validation failures may succeed on another attempt


# A chat prompt: ordinary ids, then a generation prompt whose first id is a control id (like <|im_start|>).
IM_START = 90
CHAT_PROMPT = [11, 12, 13, IM_START, 14, 15]
CONTROL = frozenset({2, IM_START})


def _counted_echo(k: int, finish=None) -> dict:
    out = CHAT_PROMPT[-k:] + [20, 21, 2]
    return reply(output_ids=out, finish=finish, prompt_tokens=len(CHAT_PROMPT))  # completion_tokens counts the echo


def test_prompt_echo_counted_in_completion_tokens_is_found_by_the_control_id():
    for k in (3, 4, 5, 6):  # every echo that reaches the generation prompt's control id
        err = _kind(_counted_echo(k), prompt=CHAT_PROMPT, control_ids=CONTROL)
        assert err.kind == "prompt_echo" and f"last {k} prompt ids" in err.detail and "counted in" in err.detail
        assert err.retryable
    # a caller that does not know the target's tokens: 3 or more ids repeating the prompt's end are the evidence
    assert _kind(_counted_echo(3), prompt=CHAT_PROMPT).kind == "prompt_echo"
    assert parse_generate_reply(_counted_echo(2), CHAT_PROMPT, 100).output_ids[:2] == CHAT_PROMPT[-2:]
    # a caller that knows the target has no control id among them: no structural evidence at all
    plain_prompt = [11, 12, 13, 91, 14, 15]
    head = reply(output_ids=[91, 14, 15, 20, 21, 2], prompt_tokens=len(plain_prompt))
    assert parse_generate_reply(head, plain_prompt, 100, control_ids=CONTROL).output_ids[:3] == [91, 14, 15]


def test_reply_beginning_with_ordinary_prompt_tail_ids_is_kept():
    for k in (1, 2):  # [15] and [14, 15]: ordinary ids, no evidence of an echo
        got = parse_generate_reply(_counted_echo(k), CHAT_PROMPT, 100, max_new_tokens=8, control_ids=CONTROL)
        assert got.output_ids[:k] == CHAT_PROMPT[-k:]


def test_prompt_echo_found_by_the_cap():
    # finish length: SGLang stopped at max_new_tokens=3 ids, the reply holds 3 + the echoed 2, all counted
    body = reply(output_ids=CHAT_PROMPT[-2:] + [20, 21, 22], finish={"type": "length", "length": 3},
                 prompt_tokens=len(CHAT_PROMPT))
    err = _kind(body, prompt=CHAT_PROMPT, max_new_tokens=3)
    assert err.kind == "prompt_echo" and "last 2 prompt ids" in err.detail
    # the same overrun without the prompt's ids at the head is just too long
    over = reply(output_ids=[20, 21, 22, 23, 24], finish={"type": "length", "length": 3}, prompt_tokens=6)
    assert _kind(over, prompt=CHAT_PROMPT, max_new_tokens=3).kind == "too_long"


def test_shared_rules_are_the_ones_parse_reply_applies():
    from eagle_assets.serving.protocol import prompt_echo_length, reply_defect, stop_mismatch

    assert prompt_echo_length([*CHAT_PROMPT[-4:], 1, 2], CHAT_PROMPT, completion_tokens=6, control_ids=CONTROL) == 4
    assert prompt_echo_length([*CHAT_PROMPT[-2:], 1, 2], CHAT_PROMPT, completion_tokens=2) == 2  # uncounted
    assert prompt_echo_length([15, 1, 2], CHAT_PROMPT, completion_tokens=3, control_ids=CONTROL) == 0
    assert prompt_echo_length([15, 1, 2], None, completion_tokens=2) == 0
    assert reply_defect([1, 200, 2], completion_tokens=3, vocab_size=100).kind == "id_out_of_vocab"
    assert reply_defect([1, 2], completion_tokens=3).kind == "length_mismatch"
    assert reply_defect([1, 2, 3], completion_tokens=3, max_new_tokens=2).kind == "too_long"
    assert reply_defect([1, 2], completion_tokens=2, max_new_tokens=2) is None
    assert stop_mismatch([1, 2], 7) and not stop_mismatch([1, 2], 2) and not stop_mismatch([1, 2], "</s>")
    assert not stop_mismatch([1, 2], None) and stop_mismatch([], 2)


# The shape rule (prompt_echo_length rule 4): a toy family whose reply must open its reasoning block with THINK at
# the first output id and close it with END before the stop id 2 (the prompt CHAT_PROMPT opens no block).
THINK, END = 30, 31


def _toy_well_formed(calls: list | None = None):
    def check(prompt_ids, output_ids, finish_type, rid) -> bool:
        if calls is not None:
            calls.append((tuple(prompt_ids), tuple(output_ids), finish_type, rid))
        ids = list(output_ids)
        if finish_type != "stop" or not ids or ids[-1] != 2 or 2 in ids[:-1]:
            return False
        if THINK in ids or END in ids:
            return ids[0] == THINK and ids.count(THINK) == 1 and ids.count(END) == 1 and ids.index(END) < len(ids) - 2
        return len(ids) > 1
    return check


def test_prompt_echo_found_by_the_replys_shape_when_the_counts_agree():
    good = [THINK, 20, END, 21, 2]
    for k in (1, 2):  # [15] and [14, 15]: ordinary ids, counted: only the shape betrays them
        calls: list = []
        body = reply(output_ids=CHAT_PROMPT[-k:] + good, prompt_tokens=len(CHAT_PROMPT))
        err = _kind(body, prompt=CHAT_PROMPT, control_ids=CONTROL, well_formed=_toy_well_formed(calls))
        assert err.kind == "prompt_echo" and f"last {k} prompt ids" in err.detail and err.retryable
        assert "well-formed for its family only without them" in err.detail and "counted in" in err.detail
        assert calls[0] == (tuple(CHAT_PROMPT), tuple(CHAT_PROMPT[-k:] + good), "stop", None)  # the request's facts
        # without the check the same reply passes (the rules of before are unchanged)
        assert parse_generate_reply(body, CHAT_PROMPT, 100, control_ids=CONTROL).output_ids == CHAT_PROMPT[-k:] + good
    # prompt_echo_length takes the same check bound to the reply: the k it returns is the echoed head
    from eagle_assets.serving.protocol import prompt_echo_length

    def shape(ids):
        return _toy_well_formed()(CHAT_PROMPT, ids, "stop", None)

    assert prompt_echo_length(CHAT_PROMPT[-2:] + good, CHAT_PROMPT, completion_tokens=7, control_ids=CONTROL,
                              well_formed=shape) == 2
    # a cut at the cap is judged by the caller's check too (the rid reaches it)
    calls = []
    cut = reply(output_ids=CHAT_PROMPT[-2:] + [THINK, 20, 21], finish={"type": "length", "length": 8},
                prompt_tokens=len(CHAT_PROMPT))
    parse_generate_reply(cut, CHAT_PROMPT, 100, max_new_tokens=8, rid="r1", control_ids=CONTROL,
                well_formed=_toy_well_formed(calls))
    assert calls and all(c[2] == "length" and c[3] == "r1" for c in calls)


def test_reply_beginning_like_the_prompt_tail_and_well_formed_as_it_stands_is_kept():
    calls: list = []
    check = _toy_well_formed(calls)
    for k in (1, 2):
        for tail in ([20, 21, 2], [THINK, 20, END, 21, 2][1:]):  # whole without reasoning; malformed both ways
            body = reply(output_ids=CHAT_PROMPT[-k:] + tail, prompt_tokens=len(CHAT_PROMPT))
            got = parse_generate_reply(body, CHAT_PROMPT, 100, control_ids=CONTROL, well_formed=check)
            assert got.output_ids == CHAT_PROMPT[-k:] + tail
    # a well-formed reply that does not begin like the prompt's tail never reaches the check
    calls.clear()
    parse_generate_reply(reply(output_ids=[THINK, 20, END, 21, 2], prompt_tokens=len(CHAT_PROMPT)), CHAT_PROMPT, 100,
                control_ids=CONTROL, well_formed=check)
    assert calls == []
    # the other evidence still decides first, with the check given or not
    err = _kind(_counted_echo(4), prompt=CHAT_PROMPT, control_ids=CONTROL, well_formed=check)
    assert err.kind == "prompt_echo" and "last 4 prompt ids" in err.detail
    uncounted = reply(output_ids=CHAT_PROMPT[-1:] + [20, 21, 2], completion_tokens=3, prompt_tokens=6)
    assert _kind(uncounted, prompt=CHAT_PROMPT, well_formed=check).kind == "prompt_echo"


def test_typed_request_and_reply_round_trip_through_the_embedded_servers_parser():
    """One ``GenerateRequest`` is the body the client sends and the server reads back field for field; one
    ``GenerateReply`` is what the server writes and ``parse_generate_reply`` reads back."""
    from eagle_assets.serving.generate_io import GenerateIO
    from eagle_assets.serving.protocol import FinishReason, GenerateReply, GenerateRequest

    sp = SamplingParams(max_new_tokens=7, temperature=0.0, stop_token_ids=(3,), seed=11)
    request = GenerateRequest(input_ids=[5, 6, 7], sampling_params=sp, rid="r-1", return_hidden_states="last",
                              return_logprob=True, logprob_start_len=1, top_logprobs_num=2)
    body = request.to_bytes()
    assert body == request.to_bytes(orjson.dumps(sp.to_json()))  # the client's pre-encoded sampling params
    io = GenerateIO(None, vocab_size=10, context_length=None, return_hidden_states_mode="full",
                    recording_error=lambda: None)
    (item,), single = io.parse(orjson.loads(body))
    assert single and item.request == request and (item.hidden, item.logprob_start, item.top_logprobs) == ("last", 1, 2)
    assert GenerateRequest.from_json(orjson.loads(body)) == request
    with pytest.raises(ValueError, match="input_ids must be a non-empty list of ints"):
        GenerateRequest.from_json({"input_ids": [1, "2"], "sampling_params": sp.to_json()})

    reply = GenerateReply(output_ids=[8, 3], finish_reason=FinishReason("stop", matched=3), prompt_tokens=3,
                          completion_tokens=2, e2e_latency=0.5, cached_tokens=0, rid="r-1", text="x")
    wire = reply.to_json(hidden_states=[[0.5]])
    assert wire["meta_info"]["hidden_states"] == [[0.5]] and wire["meta_info"]["finish_reason"] == {
        "type": "stop", "matched": 3}
    assert parse_generate_reply(orjson.dumps(wire), [5, 6, 7], 10, max_new_tokens=7, rid="r-1") == reply
