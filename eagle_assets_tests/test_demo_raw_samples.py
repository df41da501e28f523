"""The committed demo source files: native layouts, up to date with the generator, malformed rows rejected."""

from __future__ import annotations

import dataclasses
import json

import pytest

from eagle_assets.demo.raw_samples import (
    FILES,
    MALFORMED_ROWS,
    N_RECORDS,
    default_out_dir,
    last_user_samples,
    prompt_samples,
    turn_samples,
    write_raw_samples,
)
from eagle_assets.demo.transcripts import completion_text, generate_mixture
from eagle_assets.formats import Rejected, build_prompt, load_records

FORMATS = {"tool": "glaive", "code": "opencodeinstruct", "math": "messages", "reasoning": "sharegpt"}
EXPECTED_REJECTS = {
    "tool": {"no_user_turn", "unparseable_text", "invalid_tool_arguments"},
    "code": {"missing_field", "bad_field_type"},
    "math": {"no_user_turn", "bad_field_type"},
    "reasoning": {"bad_field_type", "empty_prompt"},
}


def _records(path):
    text = path.read_text(encoding="utf-8")
    return json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()]


def test_committed_files_match_the_generator(tmp_path):
    written = write_raw_samples(tmp_path)
    for path in written:
        committed = default_out_dir() / path.name
        assert committed.exists(), f"{committed} is missing: run python -m eagle_assets.demo.raw_samples"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run python -m eagle_assets.demo.raw_samples and commit the result")


@pytest.mark.parametrize("kind", sorted(FILES))
def test_native_layout(kind):
    records = _records(default_out_dir() / FILES[kind])
    assert len(records) == N_RECORDS + len(MALFORMED_ROWS) >= 48 + 2
    good = [r for i, r in enumerate(records) if i not in MALFORMED_ROWS]
    if kind == "tool":
        for r in good:
            assert set(r) == {"system", "chat"} and r["system"].startswith("SYSTEM: You are a helpful assistant")
            assert r["chat"].startswith("USER: ") and "ASSISTANT: <functioncall> {\"name\": " in r["chat"]
            assert "\"arguments\": '{" in r["chat"] and "FUNCTION RESPONSE: " in r["chat"]
        # A multi-turn partition: some conversations go on with a follow-up question and its answer.
        follow_ups = sum(r["chat"].count("USER: ") == 2 for r in good)
        assert 0.3 * len(good) <= follow_ups <= 0.8 * len(good), follow_ups
        assert all(r["chat"].count("USER: ") == r["chat"].count("ASSISTANT: ") - 1 for r in good)
    elif kind == "code":
        keys = {"id", "input", "output", "domain", "generation_algorithm", "llm_judgement", "unit_tests",
                "tests_execution_status", "average_test_score"}
        for r in good:
            assert set(r) == keys and isinstance(json.loads(r["unit_tests"]), list)
            assert r["output"].startswith("```python\ndef ")
    elif kind == "math":
        for r in good:
            assert set(r) == {"messages", "num_tokens", "source"}
            assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
            answer = r["messages"][1]["content"]
            assert answer.startswith("<think>\n") and "\n</think>\n\n" in answer
    else:
        for r in good:
            assert set(r) == {"system", "conversations"}
            assert [t["from"] for t in r["conversations"]] == ["user", "assistant"]
            value = r["conversations"][1]["value"]
            assert value.startswith("<|begin_of_thought|>") and value.endswith("<|end_of_solution|>")


@pytest.mark.parametrize("kind", sorted(FILES))
def test_loaders_reject_malformed_rows_and_keep_prompts_in_distribution(kind):
    loaded = list(load_records(default_out_dir() / FILES[kind], FORMATS[kind]))
    rejected = [r for r in loaded if isinstance(r, Rejected)]
    assert [r.source_row for r in rejected] == list(MALFORMED_ROWS)
    assert {r.reason for r in rejected} <= EXPECTED_REJECTS[kind]
    convs = [r for r in loaded if not isinstance(r, Rejected)]
    # The pipeline's prompts are exactly the generator's prompts the demo target was trained on: the first user
    # turn, or (B1 conversations with a follow-up) the follow-up after the recorded turns, whose assistant turns
    # the template renders without reasoning, as the generator's turn-3 prompt does.
    template = _template_tokenizer()
    for conv, sample in zip(convs, last_user_samples(kind), strict=True):
        prompt, reference = build_prompt(conv, "last_user")
        if sample.kind == "follow_up":
            assert _render(template, prompt, conv.tools) == _render(template, sample.messages, sample.tools)
            assert reference["content"] == sample.content
        else:
            assert prompt == sample.messages
            assert reference is not None
        assert conv.tools == sample.tools


def _template_tokenizer():
    """A demo tokenizer trained on a few transcripts (seconds): the demo chat template with the demo tokens."""
    from eagle_assets.demo.tokenizer import train_demo_tokenizer

    bootstrap = train_demo_tokenizer(["bootstrap text"], vocab_size=512)
    texts = [bootstrap.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
             + completion_text(s) for s in generate_mixture(20, seed=1)]
    return train_demo_tokenizer(texts, vocab_size=2048)


def _render(tokenizer, messages, tools):
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def test_all_turns_replay_of_b1_gives_the_gate_prompts_id_for_id():
    """Replaying the committed B1 conversations with the ``all_turns`` machinery (``tokenized_prompts.walk`` +
    ``reply.client_message`` + ``render_prompt``), the model answering each turn with the generator's reference reply:
    every call finds its recorded result, every turn's prompt ids equal the gate's prompt for that turn, and each
    conversation is complete after 2 turns, or 3 when the record holds a follow-up.

    One difference is by design: the history carries each reply as SGLang 0.5.23 returns it
    (``generations.reply``), so the follow-up turn's prompt holds the earlier answer after the blank line the model
    wrote (``"\\n\\n" + answer``), where the generator, like a dataset, wrote the answer stripped. The demo
    target was trained on the generator's prompts (changing them changes its weights, whose gate is recorded per
    kind of CPU); the replay's follow-up prompt is the gate's with that history instead."""
    from eagle_assets.demo.rows import encode_sample
    from eagle_assets.generations.reply import client_message
    from eagle_assets.structure.segment import segment_output
    from eagle_assets.target_model.profile import detect_profile
    from eagle_assets.target_model.render import render_prompt
    from eagle_assets.tokenized_prompts.walk import COMPLETE, ConversationWalk

    tok = _template_tokenizer()
    profile = detect_profile(tok)
    convs = [r for r in load_records(default_out_dir() / FILES["tool"], "glaive") if not isinstance(r, Rejected)]
    firsts = prompt_samples("tool")
    later = turn_samples()
    seconds, thirds = later[:len(firsts)], iter(later[len(firsts):])
    for conv, first, second in zip(convs, firsts, seconds, strict=True):
        expected = [first, second] + ([next(thirds)] if first.features["follow_up_recorded"] else [])
        walk = ConversationWalk.start("s", "default", build_prompt(conv, "all_turns")[0])
        for sample in expected:
            rendered = render_prompt(tok, walk.history, conv.tools, profile=profile)
            prompt_ids, output_ids = encode_sample(tok, sample)
            if sample.kind == "follow_up":
                served = [{**m, "content": "\n\n" + m["content"]} if m["role"] == "assistant" and not
                          m.get("tool_calls") else m for m in sample.messages]
                gate_ids = prompt_ids
                prompt_ids, _ = encode_sample(tok, dataclasses.replace(sample, messages=served))
                assert prompt_ids != gate_ids
            assert list(rendered.prompt_ids) == prompt_ids, sample.kind
            seg = segment_output(output_ids, "stop", profile, prompt_opens_think=rendered.opens_think,
                                 prompt_ids=rendered.prompt_ids)
            assert seg.kept, (sample.kind, seg.drop_reason)
            parsed = client_message(output_ids, seg, tok, profile, prompt_opens_think=rendered.opens_think)
            assert parsed.problem is None, parsed.detail
            walk.accept(parsed.message, max_turns=8)
        assert (walk.ended, walk.end_turn, walk.tool_results) == (COMPLETE, len(expected), 1)
    assert next(thirds, None) is None
