"""The embedded server over real HTTP on 127.0.0.1: SGLang's /generate shapes, finish reasons, batching, API key.

The model is a tiny random Qwen3 with a word-level tokenizer written by ``eagle_assets_tests.servers.tiny_model``.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from eagle_assets.serving.client import GenerateClient
from eagle_assets.serving.protocol import GenerateReply, SamplingParams, parse_generate_reply
from eagle_assets.serving.server import serve_in_thread
from eagle_assets_tests.servers.tiny_model import write_tiny_causal_lm

VOCAB = 126  # 5 special tokens + [UNK] + 120 words
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def server(model_dir):
    with serve_in_thread(str(model_dir), max_batch_size=16, context_length=200) as running:
        yield running


def _prompt(i: int, length: int) -> list[int]:
    return [6 + (i * 37 + k * 11) % 120 for k in range(length)]


async def _post(url: str, body, *, headers=None, timeout: float = 60.0) -> tuple[int, object]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with s.post(url + "/generate", data=data, headers=headers or {}) as r:
            raw = await r.read()
            return r.status, (json.loads(raw) if raw else None)


async def _get(url: str, path: str, headers=None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path, headers=headers or {}) as r:
            return r.status, await r.read()


def test_health_and_model_info(server, model_dir):
    status, body = asyncio.run(_get(server.url, "/health"))
    assert (status, body) == (200, b"")
    status, body = asyncio.run(_get(server.url, "/get_model_info"))
    info = json.loads(body)
    assert status == 200
    assert info["model_path"] == str(model_dir) and info["tokenizer_path"] == str(model_dir)
    assert info["is_generation"] is True
    assert info["vocab_size"] == VOCAB and info["eos_token_ids"] == [EOS]
    assert info["dtype"] == "float64" and info["context_length"] == 200


def test_single_and_list_input_shapes(server):
    sp = {"max_new_tokens": 6, "temperature": 0, "skip_special_tokens": False}
    status, single = asyncio.run(_post(server.url, {"input_ids": _prompt(0, 7), "sampling_params": sp, "rid": "one"}))
    assert status == 200 and isinstance(single, dict)
    assert set(single) == {"text", "output_ids", "meta_info"}
    meta = single["meta_info"]
    assert meta["id"] == "one" and meta["prompt_tokens"] == 7 and meta["cached_tokens"] == 0
    assert meta["completion_tokens"] == len(single["output_ids"]) and meta["e2e_latency"] > 0
    reply = parse_generate_reply(single, _prompt(0, 7), VOCAB, max_new_tokens=6, rid="one")
    assert isinstance(reply, GenerateReply)

    batch = {"input_ids": [_prompt(0, 7), _prompt(1, 3), _prompt(2, 12)], "sampling_params": sp, "rid": "b"}
    status, many = asyncio.run(_post(server.url, batch))
    assert status == 200 and isinstance(many, list) and len(many) == 3
    assert [m["meta_info"]["id"] for m in many] == ["b_0", "b_1", "b_2"]
    assert [m["meta_info"]["prompt_tokens"] for m in many] == [7, 3, 12]
    assert many[0]["output_ids"] == single["output_ids"]  # the same prompt alone and inside a batch
    words = many[1]["text"].split()
    assert len(words) == len(many[1]["output_ids"])  # max_new_tokens 6, no stop: nothing trimmed from the text
    assert all(w == f"w{t - 6}" for w, t in zip(words, many[1]["output_ids"]) if t >= 6)

    per_item = {"input_ids": [_prompt(3, 4), _prompt(4, 4)], "rid": ["x", "y"],
                "sampling_params": [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}]}
    status, two = asyncio.run(_post(server.url, per_item))
    assert [m["meta_info"]["id"] for m in two] == ["x", "y"]
    assert [m["meta_info"]["completion_tokens"] for m in two] == [2, 5]

    status, texted = asyncio.run(_post(server.url, {"text": "w1 w2 w3", "sampling_params": sp}))
    assert status == 200 and texted["meta_info"]["prompt_tokens"] == 3


def test_stop_and_length_finish_reasons(server):
    prompt = _prompt(5, 9)
    base = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    status, free = asyncio.run(_post(server.url, {"input_ids": prompt, "sampling_params": base}))
    ids = free["output_ids"]
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 24} and len(ids) == 24
    before_eos = ids[: ids.index(EOS)] if EOS in ids else ids
    assert len(before_eos) >= 3, "pick another prompt: this one hits EOS at once"
    target = before_eos[min(6, len(before_eos) - 1)]
    cut = ids.index(target) + 1
    stop_sp = {"max_new_tokens": 24, "temperature": 0, "stop_token_ids": [target], "skip_special_tokens": False}
    status, stopped = asyncio.run(_post(server.url, {"input_ids": prompt, "sampling_params": stop_sp}))
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert stopped["output_ids"] == ids[:cut]  # the matched id is kept, as SGLang does
    assert stopped["meta_info"]["completion_tokens"] == cut
    if cut > 1:  # SGLang trims the matched stop token from the text only
        assert stopped["text"].split() == free["text"].split()[: cut - 1]
    reply = parse_generate_reply(stopped, prompt, VOCAB, max_new_tokens=24)
    assert reply.finish_reason.type == "stop" and reply.finish_reason.matched == target


def test_missing_max_new_tokens_means_sglang_default_and_context_caps_it(server):
    status, reply = asyncio.run(_post(server.url, {"input_ids": _prompt(6, 4),
                                                   "sampling_params": {"temperature": 0, "ignore_eos": True}}))
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 128  # SGLang's silent default
    status, reply = asyncio.run(_post(server.url, {"input_ids": _prompt(7, 150), "sampling_params": {
        "max_new_tokens": 500, "temperature": 0, "ignore_eos": True}}))
    assert status == 200 and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 50}
    status, reply = asyncio.run(_post(server.url, {"input_ids": _prompt(8, 200), "sampling_params": {
        "max_new_tokens": 5}}))
    assert status == 400 and "longer than the model's context length" in reply["error"]["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        ({"sampling_params": {"max_new_tokens": 3}}, "input_ids is required"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [5, 126]}, "input_ids[1] = 126 is not a token id in [0, 126)"),
        ({"input_ids": [[5, 6], []]}, "input_ids[1] must be a non-empty list"),
        # max_new_tokens 0 is SGLang's prefill-only request (eagle_assets_tests/test_served_features.py)
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be an int >= 1"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "frequency_penalty": 0.5}}, "not supported"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "bogus": 1}}, "unknown sampling_params"),
        ({"input_ids": [5, 6], "stream": True}, "stream=true is not supported"),
        ({"input_ids": [[5], [6]], "rid": ["a"]}, "rid has 1 entries for 2 inputs"),
    ],
)
def test_invalid_requests_get_http_400_with_a_reason(server, body, needle):
    status, reply = asyncio.run(_post(server.url, body))
    assert status == 400
    assert needle in reply["error"]["message"]


def test_concurrent_requests_share_forward_batches_and_match_single_requests(server):
    info = lambda: json.loads(asyncio.run(_get(server.url, "/get_server_info"))[1])  # noqa: E731
    before = info()["engine"]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    items = [(f"c{i}", _prompt(i, 3 + (i * 5) % 17)) for i in range(12)]
    client = GenerateClient([server.url], concurrency_per_server=12, backoff_base_s=0.01)
    together = client.generate_all(items, sp, vocab_size=VOCAB)
    after = info()["engine"]
    decode_steps = after["decode_steps"] - before["decode_steps"]
    prefills = after["prefill_calls"] - before["prefill_calls"]
    assert all(isinstance(r, GenerateReply) and r.completion_tokens == 16 for r in together)
    assert after["max_decode_batch"] >= 6
    assert prefills < len(items)
    assert decode_steps < len(items) * 15 / 2  # sequential decoding would need 12 * 15 steps
    alone = [client.generate_all([item], sp, vocab_size=VOCAB)[0] for item in items]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert len({tuple(r.output_ids) for r in together}) == len(items)


def test_event_loop_answers_while_a_batch_decodes(server):
    # Poll instead of sleeping a fixed time: on an idle machine the whole batch may decode in well under a second.
    async def scenario():
        long = [asyncio.ensure_future(_post(server.url, {"input_ids": _prompt(i, 5), "sampling_params": {
            "max_new_tokens": 150, "temperature": 0, "ignore_eos": True}})) for i in range(8)]
        seen_running, slowest, statuses = 0, 0.0, set()
        while not all(f.done() for f in long):
            t0 = time.perf_counter()
            status, info = await _get(server.url, "/get_server_info")
            slowest = max(slowest, time.perf_counter() - t0)
            statuses.add(status)
            seen_running = max(seen_running, json.loads(info)["running"])
            await asyncio.sleep(0.005)
        results = await asyncio.gather(*long)
        return statuses, slowest, seen_running, results

    statuses, slowest, running, results = asyncio.run(scenario())
    assert statuses == {200} and running > 0  # answered while sequences were decoding
    assert slowest < 1.0
    assert all(s == 200 and r["meta_info"]["completion_tokens"] == 150 for s, r in results)


def test_client_disconnect_cancels_the_request(server):
    info = lambda: json.loads(asyncio.run(_get(server.url, "/get_server_info"))[1])  # noqa: E731
    cancelled_before = info()["engine"]["requests_cancelled"]
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(_post(server.url, {"input_ids": _prompt(1, 5), "sampling_params": {
            "max_new_tokens": 190, "temperature": 0, "ignore_eos": True}}, timeout=0.03))
    deadline = time.monotonic() + 10
    while info()["engine"]["requests_cancelled"] == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert info()["engine"]["requests_cancelled"] == cancelled_before + 1
    assert info()["running"] == 0


def test_api_key_required_except_health(model_dir, monkeypatch):
    with serve_in_thread(str(model_dir), api_key="s3cret-key", max_batch_size=4) as keyed:
        body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        assert asyncio.run(_post(keyed.url, body)) == (401, {"error": "Unauthorized"})
        assert asyncio.run(_post(keyed.url, body, headers={"Authorization": "Bearer wrong"}))[0] == 401
        assert asyncio.run(_get(keyed.url, "/get_model_info"))[0] == 401
        assert asyncio.run(_get(keyed.url, "/health"))[0] == 200
        status, reply = asyncio.run(_post(keyed.url, body, headers={"Authorization": "Bearer s3cret-key"}))
        assert status == 200 and reply["meta_info"]["completion_tokens"] == 3

        sp = SamplingParams(max_new_tokens=3, temperature=0)
        no_key = GenerateClient([keyed.url], max_attempts=4, backoff_base_s=0.01).generate_all([("a", [7, 8])], sp)[0]
        assert no_key.kind == "unauthorized" and no_key.attempts == 1  # not retried

        monkeypatch.setenv("EAGLE_TEST_KEY", "wrong-key")
        wrong = GenerateClient([keyed.url], api_key_env="EAGLE_TEST_KEY").generate_all([("a", [7, 8])], sp)[0]
        assert wrong.kind == "unauthorized" and "wrong-key" not in wrong.last_error

        monkeypatch.setenv("EAGLE_TEST_KEY", "s3cret-key")
        client = GenerateClient([keyed.url], api_key_env="EAGLE_TEST_KEY")
        assert "s3cret" not in repr(client)
        ok = client.generate_all([("a", [7, 8])], sp, vocab_size=VOCAB)[0]
        assert isinstance(ok, GenerateReply) and ok.completion_tokens == 3
