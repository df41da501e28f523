"""DecodeEngine: continuous batching gives the same ids as decoding alone and as transformers' own greedy generate.

Uses a tiny random Qwen3 written by ``eagle_assets_tests.servers.tiny_model`` (not the demo target).
"""

from __future__ import annotations

import threading

import pytest
import torch

from eagle_assets.serving.engine import DecodeEngine, EngineRequest, load_causal_lm, model_eos_ids, resolve_dtype
from eagle_assets.serving.protocol import SamplingParams
from eagle_assets_tests.servers.tiny_model import write_tiny_causal_lm

VOCAB_WORDS = 120  # ids 6..125 are words


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model", n_words=VOCAB_WORDS, seed=3)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_causal_lm(str(model_dir))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (n,), generator=g).tolist()
    return [torch.randint(6, 6 + VOCAB_WORDS, (k,), generator=g).tolist() for k in lengths]


def _run(engine: DecodeEngine, batch: list[tuple[str, list[int], SamplingParams]], waves: int = 1) -> dict:
    """Submit ``batch`` in ``waves`` parts (later parts while earlier ones decode) and wait for every result."""
    results: dict = {}
    done = threading.Event()

    def on_done(res):
        results[res.rid] = res
        if len(results) == len(batch):
            done.set()

    reqs = [EngineRequest(rid, ids, sp, on_done) for rid, ids, sp in batch]
    step = -(-len(reqs) // waves)
    for start in range(0, len(reqs), step):
        engine.submit(reqs[start:start + step])
        if start + step < len(reqs):
            # let the earlier wave start decoding so the next one joins a running batch
            while engine.running == 0 and len(results) < start + step:
                threading.Event().wait(0.002)
    assert done.wait(120), f"only {len(results)}/{len(batch)} requests finished"
    return results


def test_auto_dtype_is_float64_for_small_cpu_models(model):
    assert model.dtype == torch.float64
    assert resolve_dtype("auto", 2_000_000_000, "cpu") == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", 10, "cpu")


def test_batched_continuous_decoding_matches_single_and_transformers_generate(model):
    eos = model_eos_ids(model)
    assert eos == {2}
    prompts = _prompts(12)
    caps = [4 + (7 * i) % 29 for i in range(len(prompts))]
    batch = [(f"r{i}", p, SamplingParams(max_new_tokens=c, temperature=0.0)) for i, (p, c) in
             enumerate(zip(prompts, caps))]
    engine = DecodeEngine(model, eos, max_batch_size=5)  # fewer slots than requests: rows leave and join
    engine.start()
    try:
        together = _run(engine, batch, waves=3)
        stats = engine.stats
        assert stats.max_decode_batch == 5
        assert stats.decode_steps < sum(caps)  # shared forwards, not one per token per request
        assert stats.prefill_calls < len(batch)
        alone = {rid: _run(engine, [(rid, ids, sp)])[rid] for rid, ids, sp in batch}
    finally:
        engine.stop()
    for n, (rid, ids, sp) in enumerate(batch):
        a, b = together[rid], alone[rid]
        assert a.output_ids == b.output_ids, rid
        assert a.finish_reason == b.finish_reason
        if n % 3 == 0:  # transformers' generate is slow per call: a third of the rows is enough of a reference
            with torch.inference_mode():
                ref = model.generate(torch.tensor([ids]), max_new_tokens=sp.max_new_tokens, do_sample=False,
                                     eos_token_id=2, pad_token_id=0)[0, len(ids):].tolist()
            assert a.output_ids == ref, rid
        assert a.completion_tokens == len(a.output_ids) and a.prompt_tokens == len(ids)
        if a.finish_reason["type"] == "stop":
            assert a.output_ids[-1] == a.finish_reason["matched"] == 2
        else:
            assert a.finish_reason == {"type": "length", "length": sp.max_new_tokens}
            assert len(a.output_ids) == sp.max_new_tokens
    assert len({tuple(r.output_ids) for r in together.values()}) == len(batch)  # outputs really differ


def test_seeded_sampling_is_reproducible_in_any_batch(model):
    prompts = _prompts(6, seed=1)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    batch = [(f"s{i}", p, sp) for i, p in enumerate(prompts)]
    # a small prefill budget splits one arrival into several prefill forwards merged into one decode batch
    engine = DecodeEngine(model, model_eos_ids(model), max_batch_size=8, max_prefill_tokens=50, batch_wait_s=0.05)
    engine.start()
    try:
        together = _run(engine, batch)
        assert engine.stats.prefill_calls >= 3 and engine.stats.max_decode_batch == len(batch)
        alone = {rid: _run(engine, [(rid, ids, sp)])[rid] for rid, ids, sp in batch}
        unseeded = _run(engine, [("u", prompts[0], SamplingParams(max_new_tokens=12, temperature=5.0))])["u"]
        greedy = _run(engine, [("g", prompts[0], SamplingParams(max_new_tokens=12, temperature=0.0))])["g"]
    finally:
        engine.stop()
    for rid in together:
        assert together[rid].output_ids == alone[rid].output_ids
    assert unseeded.output_ids != greedy.output_ids  # temperature 5 on a random model is not argmax


def test_stop_ids_ignore_eos_and_length_first(model):
    engine = DecodeEngine(model, model_eos_ids(model), max_batch_size=4)
    engine.start()
    try:
        prompt = _prompts(1, seed=5)[0]
        free = _run(engine, [("f", prompt, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))])["f"]
        target = free.output_ids[5]
        first = free.output_ids.index(target)
        stop = _run(engine, [("s", prompt, SamplingParams(max_new_tokens=20, temperature=0,
                                                           stop_token_ids=[target]))])["s"]
        at_cap = _run(engine, [("c", prompt, SamplingParams(max_new_tokens=first + 1, temperature=0,
                                                             stop_token_ids=[target]))])["c"]
        ignored = _run(engine, [("i", prompt, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True,
                                                              stop_token_ids=[target]))])["i"]
    finally:
        engine.stop()
    assert stop.output_ids == free.output_ids[: first + 1]
    assert stop.finish_reason == {"type": "stop", "matched": target}
    # SGLang's Req.check_finished tests the length cap before stop ids
    assert at_cap.output_ids == stop.output_ids and at_cap.finish_reason == {"type": "length", "length": first + 1}
    assert ignored.output_ids == free.output_ids and ignored.finish_reason["type"] == "length"


def test_cancelled_requests_leave_the_batch_and_stop_aborts_the_rest(model):
    engine = DecodeEngine(model, model_eos_ids(model), max_batch_size=4)
    engine.start()
    got = []
    sp = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    reqs = [EngineRequest(f"c{i}", p, sp, got.append) for i, p in enumerate(_prompts(2, seed=9))]
    engine.submit(reqs)
    while engine.running < 2:
        threading.Event().wait(0.002)
    reqs[0].cancelled = True
    while engine.running > 1:
        threading.Event().wait(0.002)
    engine.stop()
    assert engine.stats.requests_cancelled == 1
    assert [(r.rid, r.finish_reason["type"], r.finish_reason["status_code"]) for r in got] == [("c1", "abort", 503)]


def test_sliding_window_model_runs_in_static_mode(tmp_path):
    path = write_tiny_causal_lm(tmp_path / "sliding", n_words=VOCAB_WORDS, seed=4, sliding_window=6)
    model = load_causal_lm(str(path))
    engine = DecodeEngine(model, model_eos_ids(model), max_batch_size=8)
    assert not engine.continuous
    prompts = _prompts(4, seed=2)
    batch = [(f"w{i}", p, SamplingParams(max_new_tokens=5 + 3 * i, temperature=0)) for i, p in enumerate(prompts)]
    engine.start()
    try:
        together = _run(engine, batch)
    finally:
        engine.stop()
    for rid, ids, sp in batch:
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=sp.max_new_tokens, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)[0, len(ids):].tolist()
        assert together[rid].output_ids == ref, rid
