"""Every drop reason and every keep case, per model family, on rows built from the REAL tokenizers.

For each family the prompt is rendered by ``render_prompt`` with a real chat template, and the reply ids are the
real tokenizer's ids of text pieces (special tokens written as their text, matched atomically as SGLang's
detokenizer would print them). Families and templates:

- Qwen3 (``tokenizers/qwen3-0.6b``, its own template): the model writes ``<think>``; ``enable_thinking=False``
  renders a closed empty block in the prompt.
- DeepSeek-R1: DeepSeek-V3's tokenizer (R1 shares it) with R1's template, which is V3's with the generation prompt
  ``<｜Assistant｜><think>\\n`` (deepseek-ai/DeepSeek-R1 tokenizer_config.json); DeepSeek-V3's own template
  (``<｜Assistant｜>``, the first R1 template too), under which R1 reasons without writing ``<think>``.
- Kimi: ``tokenizers/kimi-k2.5`` with ``chat_templates/moonshotai-Kimi-K2-Thinking.jinja`` (the model writes
  ``<think>``) and the K2.5 generation prompt ``<|im_assistant|>assistant<|im_middle|><think>`` (the template opens
  the block), made from it by replacing the generation-prompt line.

Each row goes through ``segment_row`` exactly as ``qc_shards`` calls it (vocab size from ``target_vocab_size``,
control ids from ``control_token_ids``, blank ids from ``blank_token_ids``), through the live monitor, and, as a
``/generate`` reply body, through ``parse_generate_reply``: the three must agree (one implementation of every rule).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eagle_assets.catalog import LiveSpec, Thresholds
from eagle_assets.qc.live import LiveQualityMonitor
from eagle_assets.qc.segment_batch import segment_rows
from eagle_assets.serving.protocol import ReplyError, parse_generate_reply
from eagle_assets.structure.segment import DROP_REASONS, Segmentation, StructureCheck, reply_well_formed, segment_row
from eagle_assets.target_model import detect_profile, load_kimi_tokenizer, load_tokenizer, render_prompt
from eagle_assets.target_model.profile import target_vocab_size
from eagle_assets.target_model.render import control_token_ids
from eagle_assets.target_model.setup import blank_token_ids

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TOK = SHARED / "tokenizers"
KIMI_THINKING_TEMPLATE = SHARED / "chat_templates" / "moonshotai-Kimi-K2-Thinking.jinja"
MESSAGES = [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "What is 2+2? Check the weather in Rome too."}]
WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MAX_NEW = 512
# rules the client applies too: a reply breaking one is refused by parse_generate_reply with the same kind
CLIENT_KINDS = {"abort", "id_out_of_vocab", "length_mismatch", "prompt_echo", "too_long", "prompt_tokens_mismatch",
                "stop_mismatch", "unknown_finish_reason"}


@dataclass
class Family:
    """One family + template: the real tokenizer, its profile, a real rendered prompt and the QC inputs."""

    name: str
    tok: object
    model_dir: Path
    profile: object
    prompt_ids: list[int]
    opens: bool  # the family's fact (docs/token-structure.md): cases are built from it
    rendered_opens: bool  # what render_prompt decided: tokenized_prompts.prompt_opens_think, what QC reads
    open_text: str  # what the model writes to open its reasoning ("" when the prompt opened it)
    close_text: str  # think-end and the separator the family writes after it
    stop_text: str
    tool_text: str  # one complete tool call in the family's format
    fake_turn_text: str  # a next user turn the model must never write
    vocab: int = 0
    control: frozenset = field(default_factory=frozenset)
    blank: frozenset = field(default_factory=frozenset)

    def enc(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def row(self, ids: list[int], finish: str = "stop", **over) -> dict:
        """A generations row as ``run_generation`` writes it (matched stop = last id for a stop)."""
        row = {"sample_id": f"{self.name}-row", "output_ids": list(ids), "finish_reason": finish,
               "matched_stop": ids[-1] if finish == "stop" and ids else None, "completion_tokens": len(ids),
               "prompt_tokens": len(self.prompt_ids),
               "sampling_params": json.dumps({"max_new_tokens": MAX_NEW, "temperature": 0.0})}
        row.update(over)
        return row

    def segment(self, row: dict, profile=None, policy: str = "drop") -> Segmentation:
        return segment_row(row, profile or self.profile, prompt_opens_think=self.rendered_opens,
                           prompt_ids=self.prompt_ids,
                           tool_call_in_reasoning=policy, blank_ids=self.blank, vocab_size=self.vocab,
                           control_ids=self.control)

    def check(self) -> StructureCheck:
        """The client's structure check as the generation stage builds it (``assets.generation``)."""
        return StructureCheck(self.profile, prompt_opens_think={f"{self.name}-row": self.rendered_opens},
                              blank_ids=self.blank)

    def reply(self, reasoning: str, answer: str) -> list[int]:
        return self.enc(self.open_text + reasoning + self.close_text + answer + self.stop_text)


def _render(tok, profile, messages=MESSAGES, tools=None, **kw):
    return render_prompt(tok, messages, tools, profile=profile, max_prompt_tokens=4096, **kw)


def _family(name, tok, model_dir, opens, opens_text, close_text, stop_text, tool_text, fake_turn_text, tools=None,
            **render_kw) -> Family:
    profile = detect_profile(tok)
    rendered = _render(tok, profile, tools=tools, **render_kw)
    fam = Family(name, tok, model_dir, profile, rendered.prompt_ids, opens, rendered.opens_think, opens_text,
                 close_text, stop_text, tool_text, fake_turn_text)
    fam.vocab = target_vocab_size(model_dir, tok)
    fam.control = control_token_ids(tok)
    fam.blank = blank_token_ids(tok)
    return fam


def _need(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"../shared/data is absent: {path} not found")


QWEN_TOOL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
DS_TOOL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
KIMI_TOOL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')


@pytest.fixture(scope="module")
def qwen_tok():
    _need(TOK / "qwen3-0.6b")
    return load_tokenizer(TOK / "qwen3-0.6b")


@pytest.fixture(scope="module")
def deepseek_tok():
    _need(TOK / "deepseek-v3")
    return load_tokenizer(TOK / "deepseek-v3")


@pytest.fixture(scope="module")
def kimi_tok():
    _need(TOK / "kimi-k2.5")
    _need(KIMI_THINKING_TEMPLATE)
    return load_kimi_tokenizer(TOK / "kimi-k2.5", KIMI_THINKING_TEMPLATE)


def _r1_template(v3_template: str) -> str:
    r1 = v3_template.replace("{{'<｜Assistant｜>'}}{% endif %}", "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    assert r1 != v3_template and r1.endswith("{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    return r1


def _k25_template(k2_thinking: str) -> str:
    k25 = k2_thinking.replace("<|im_assistant|>assistant<|im_middle|>\n{%- endif -%}",
                              "<|im_assistant|>assistant<|im_middle|><think>\n{%- endif -%}")
    assert k25 != k2_thinking
    return k25


@pytest.fixture(scope="module")
def families(qwen_tok, deepseek_tok, kimi_tok) -> dict[str, Family]:
    fams = {
        "qwen3": _family("qwen3", qwen_tok, TOK / "qwen3-0.6b", False, "<think>\n", "\n</think>\n\n", "<|im_end|>",
                         QWEN_TOOL, "\n<|im_start|>user\nAnd 3+3?<|im_end|>", tools=WEATHER_TOOL),
        "qwen3-no-thinking": _family("qwen3-no-thinking", qwen_tok, TOK / "qwen3-0.6b", False, "", "", "<|im_end|>",
                                     QWEN_TOOL, "\n<|im_start|>user\nAnd 3+3?<|im_end|>", enable_thinking=False),
        "deepseek-v3-template": _family("deepseek-v3-template", deepseek_tok, TOK / "deepseek-v3", False, "<think>\n",
                                        "\n</think>\n\n", "<｜end▁of▁sentence｜>", DS_TOOL,
                                        "<｜User｜>And 3+3?<｜Assistant｜>6<｜end▁of▁sentence｜>"),
    }
    saved = deepseek_tok.chat_template
    deepseek_tok.chat_template = _r1_template(saved)
    try:
        fams["deepseek-r1"] = _family("deepseek-r1", deepseek_tok, TOK / "deepseek-v3", True, "",
                                      "\n</think>\n\n", "<｜end▁of▁sentence｜>", DS_TOOL,
                                      "<｜User｜>And 3+3?<｜Assistant｜>6<｜end▁of▁sentence｜>")
    finally:
        deepseek_tok.chat_template = saved
    fams["kimi-k2-thinking"] = _family("kimi-k2-thinking", kimi_tok, TOK / "kimi-k2.5", False, "<think>", "</think>",
                                       "<|im_end|>", KIMI_TOOL, "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>",
                                       tools=WEATHER_TOOL)
    saved = kimi_tok.chat_template
    kimi_tok.chat_template = _k25_template(saved)
    try:
        fams["kimi-k2.5"] = _family("kimi-k2.5", kimi_tok, TOK / "kimi-k2.5", True, "", "</think>", "<|im_end|>",
                                    KIMI_TOOL, "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>", tools=WEATHER_TOOL)
    finally:
        kimi_tok.chat_template = saved
    return fams


# --------------------------------------------------------------------------------------- the prompt side (item 1)
def test_prompt_tails_and_who_opens_the_block(families):
    f = families
    assert {n: fam.rendered_opens for n, fam in f.items()} == {n: fam.opens for n, fam in f.items()}
    tails = {name: fam.tok.decode(fam.prompt_ids[-3:]) for name, fam in f.items()}
    assert tails["qwen3"] == "<|im_start|>assistant\n" and not f["qwen3"].opens
    assert f["qwen3-no-thinking"].tok.decode(f["qwen3-no-thinking"].prompt_ids[-4:]) == "<think>\n\n</think>\n\n"
    assert not f["qwen3-no-thinking"].opens  # the block is closed in the prompt
    # R1: the think-start is NOT the last prompt id (a newline follows it), and the prompt still opens the block
    r1 = f["deepseek-r1"]
    assert tails["deepseek-r1"] == "<｜Assistant｜><think>\n" and r1.prompt_ids[-1] != r1.profile.think_start_id
    assert r1.opens
    assert tails["deepseek-v3-template"].endswith("<｜Assistant｜>") and not f["deepseek-v3-template"].opens
    assert tails["kimi-k2-thinking"] == "<|im_assistant|>assistant<|im_middle|>" and not f["kimi-k2-thinking"].opens
    assert f["kimi-k2.5"].prompt_ids[-1] == f["kimi-k2.5"].profile.think_start_id and f["kimi-k2.5"].opens


def test_text_after_the_think_start_still_opens_the_block(qwen_tok, deepseek_tok):
    prof = detect_profile(qwen_tok)
    saved = qwen_tok.chat_template
    try:
        qwen_tok.chat_template = saved.replace("{{- '<|im_start|>assistant\\n' }}",
                                               "{{- '<|im_start|>assistant\\n<think>\\nOkay, let me see.' }}")
        assert qwen_tok.chat_template != saved
        prefilled = _render(qwen_tok, prof)
    finally:
        qwen_tok.chat_template = saved
    assert prefilled.opens_think and prefilled.flags["ids_after_think_start"] == qwen_tok(
        "\nOkay, let me see.", add_special_tokens=False)["input_ids"]
    saved = deepseek_tok.chat_template
    try:
        deepseek_tok.chat_template = _r1_template(saved)
        r1 = _render(deepseek_tok, detect_profile(deepseek_tok))
    finally:
        deepseek_tok.chat_template = saved
    assert r1.flags["ids_after_think_start"] == [201] and r1.flags["generation_prompt_tokens"] == 3


def test_tokenized_prompts_uses_the_renderers_rule(deepseek_tok, tmp_path):
    # The column QC and the live monitor read is the renderer's decision, also where a newline follows the R1
    # think-start (the case a second "last id is think-start" rule got wrong).
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_assets.raw_prompts.rows import RAW_SCHEMA
    from eagle_assets.target_model.render import opens_think_block, render_prompt
    from eagle_assets.tokenized_prompts.write import tokenize_partition

    saved = deepseek_tok.chat_template
    deepseek_tok.chat_template = _r1_template(saved)
    try:
        prof = detect_profile(deepseek_tok)
        messages = [{"role": "user", "content": "What is 2+2?"}]
        raw = tmp_path / "raw.parquet"
        pq.write_table(pa.Table.from_pylist([{"sample_id": "s0", "messages": json.dumps(messages), "tools": None,
                                              "reference_reply": None, "source_file": "x.jsonl", "source_row": 0}],
                                            schema=RAW_SCHEMA), raw)
        tokenize_partition(raw, tmp_path / "tok", deepseek_tok, prof)
        row = pq.read_table(tmp_path / "tok" / "prompts.parquet").to_pylist()[0]
        rendered = render_prompt(deepseek_tok, messages, None, profile=prof)
    finally:
        deepseek_tok.chat_template = saved
    assert row["prompt_ids"][-1] != prof.think_start_id  # "\n" follows the think-start
    assert row["prompt_opens_think"] is True and rendered.opens_think
    assert opens_think_block(row["prompt_ids"], prof)


# ------------------------------------------------------------------------------------------- rows per family
def _keep_cases(f: Family) -> dict[str, dict]:
    """name -> generations row that must be kept (well formed, short ones included)."""
    stop = f.enc(f.stop_text)
    cases = {
        "reasoning_and_answer": f.row(f.reply("Okay, 2 and 2 make 4.", "2 + 2 = 4.")),
        "one_token_answer": f.row(f.reply("Sum.", "4")),
        # Qwen3's "<think>\n\n</think>\n\nOK", Kimi's "<think></think>OK", R1's "</think>\n\nOK"
        "empty_reasoning": f.row(f.enc(f.open_text + ("\n" if f.open_text.endswith("\n") else "")
                                       + f.close_text.lstrip("\n") + "OK" + f.stop_text)),
        "tool_call_answer": f.row(f.reply("I should look the weather up.", f.tool_text)),
        "stop_at_the_cap": f.row(f.reply("Sum.", "4"), finish="length",
                                 sampling_params=json.dumps({"max_new_tokens": len(f.reply("Sum.", "4"))})),
    }
    if not f.opens and not f.open_text:  # the prompt closed the block: a plain answer is the whole reply
        cases = {"plain_answer": f.row(f.enc("2 + 2 = 4." + f.stop_text)),
                 "one_token_answer": f.row(f.enc("4" + f.stop_text)),
                 "tool_call_answer": f.row(f.enc(f.tool_text + f.stop_text))}
    if f.prompt_ids[-1] not in f.control:
        # the reply begins with the prompt's last id (an ordinary one): no evidence of an echo, kept
        head = [f.prompt_ids[-1]]
        body = f.enc("Okay." + f.close_text + "4" + f.stop_text) if f.opens else f.enc("4" + f.stop_text)
        cases["begins_like_the_prompt_tail"] = f.row(head + body)
    if f.profile.tool_call_ends_reasoning:  # Kimi: the section closes the reasoning without </think>
        cases["tool_section_ends_reasoning"] = f.row(f.enc(f.open_text + "I will call the tool." + f.tool_text
                                                           + f.stop_text))
        cases["tool_section_only"] = f.row(f.enc(f.open_text + f.tool_text) + stop)
    if f.profile.implicit_think_start and not f.opens:  # R1 under the V3 / first R1 template: no <think> written
        cases["reasoning_without_think_start"] = f.row(f.enc("Okay, 2 and 2.\n</think>\n\n4" + f.stop_text))
    return cases


def _drop_cases(f: Family) -> dict[str, dict]:
    """drop reason -> a row that breaks exactly that rule."""
    good = f.reply("Okay, 2 and 2 make 4.", "2 + 2 = 4.")
    stop = f.enc(f.stop_text)
    think_end = f.profile.think_end_id
    other_stop = next((s for s in f.profile.stop_ids if s != good[-1]), think_end)
    cases: dict[str, dict] = {
        "abort": f.row([], finish="abort", matched_stop=None),
        "unknown_finish_reason": f.row(good, finish="eos"),
        "id_out_of_vocab": f.row(good[:2] + [f.vocab] + good[3:]),
        "length_mismatch": f.row(good, completion_tokens=len(good) + 1),
        # SGLang's detokenization window: the prompt's last 5 ids in front, counted in completion_tokens
        "prompt_echo": f.row(f.prompt_ids[-5:] + good),
        "too_long": f.row(good, sampling_params=json.dumps({"max_new_tokens": len(good) - 1})),
        "prompt_tokens_mismatch": f.row(good, prompt_tokens=len(f.prompt_ids) + 2),
        "no_stop_token": f.row(good[:-1] + f.enc(" Done"), matched_stop=None),  # a stop string matched
        "stop_mismatch": f.row(good, matched_stop=other_stop),
        "stop_token_mid_output": f.row(good + f.enc(f.fake_turn_text)),
        "truncated_in_answer": f.row(good[:-3], finish="length"),
    }
    if f.opens or f.open_text:
        reasoning_only = f.enc(f.open_text + "Okay, 2 and 2 make")
        cases.update({
            "truncated_in_reasoning": f.row(reasoning_only, finish="length"),
            "missing_think_end": f.row(reasoning_only + f.enc(" 4.") + stop),
            "multiple_think_end": f.row(f.reply("Okay.", "4" + f.close_text + "4")),
            "misplaced_think_start": f.row(f.reply("Okay.", "4 <think> again")),
            "unbalanced_tool_call": f.row(f.reply("Call it.", f.tool_text[: f.tool_text.rindex("<")])),
            "tool_call_in_reasoning": f.row(f.enc(f.open_text + "Let me call." + f.tool_text + " Now the sum."
                                                  + f.close_text + "4" + f.stop_text)),
            "empty_answer": f.row(f.enc(f.open_text + "Okay." + f.close_text + f.stop_text)),
        })
        if not f.profile.tool_call_ends_reasoning:  # without the rule a tool call does not close the reasoning
            cases["missing_think_end"] = f.row(f.enc(f.open_text + "Let me call." + f.tool_text + f.stop_text))
    if not f.opens and not f.profile.implicit_think_start:
        cases["think_end_without_start"] = f.row(f.enc("Okay, 2 and 2.</think>4" + f.stop_text))
    if not f.opens:  # a think-start that is not the first output id
        cases["misplaced_think_start"] = f.row(f.enc("Well <think> Okay, 4." + f.stop_text))
    return cases


FAMILY_NAMES = ["qwen3", "qwen3-no-thinking", "deepseek-r1", "deepseek-v3-template", "kimi-k2-thinking",
                "kimi-k2.5"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_keep_cases(families, name):
    f = families[name]
    for case, row in _keep_cases(f).items():
        seg = f.segment(row)
        assert seg.kept, (name, case, seg, f.tok.decode(row["output_ids"]))
        n_out = len(row["output_ids"])
        structural = n_out - seg.reasoning_tokens - seg.answer_tokens
        assert 1 <= structural <= 3, (name, case, seg)  # stop id, plus the think markers the row holds
        assert seg.answer_tokens > 0


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_drop_cases(families, name):
    f = families[name]
    cases = _drop_cases(f)
    for reason, row in cases.items():
        seg = f.segment(row)
        assert seg.drop_reason == reason, (name, reason, seg, f.tok.decode([i for i in row["output_ids"]
                                                                             if 0 <= i < len(f.tok)]))


def test_every_drop_reason_is_built_from_real_tokenizers(families):
    built = {r for f in families.values() for r in _drop_cases(f)}
    assert built == set(DROP_REASONS), set(DROP_REASONS) - built


# -------------------------------------------------------------------------------- family rules (items 1 and 4)
def test_r1_segments_reasoning_and_names_cuts_in_the_reasoning(families):
    r1 = families["deepseek-r1"]
    seg = r1.segment(r1.row(r1.reply("Okay, 2 and 2 make 4.", "2 + 2 = 4.")))
    assert seg.kept and seg.reasoning_tokens == len(r1.enc("Okay, 2 and 2 make 4.\n"))
    cut = r1.segment(r1.row(r1.enc("Okay, 2 and 2 make"), finish="length"))
    assert cut.drop_reason == "truncated_in_reasoning" and cut.reasoning_tokens == len(r1.enc("Okay, 2 and 2 make"))


def test_kimi_tool_section_closes_the_reasoning_and_counts_as_answer(families):
    for name in ("kimi-k2.5", "kimi-k2-thinking"):
        k = families[name]
        tool = k.enc(k.tool_text)
        seg = k.segment(k.row(k.enc(k.open_text + "I will call the tool.") + tool + k.enc(k.stop_text)))
        assert seg.kept and seg.flags == ("tool_call_ended_reasoning",), (name, seg)
        assert seg.reasoning_tokens == len(k.enc("I will call the tool."))
        assert seg.answer_tokens == seg.tool_call_tokens == len(tool) and seg.n_tool_calls == 1
        # the same section followed by more reasoning and a later </think> is a tool call inside the reasoning
        later = k.row(k.enc(k.open_text + "Call." + k.tool_text + " More." + k.close_text + "Done" + k.stop_text))
        assert k.segment(later).drop_reason == "tool_call_in_reasoning"
        kept = k.segment(later, policy="keep")
        assert kept.kept and kept.flags == ("tool_call_in_reasoning",)
        # off through the catalog's profile override: the unclosed block is missing its think-end
        off = detect_profile(k.tok, {"tool_call_ends_reasoning": False})
        assert k.segment(k.row(k.enc(k.open_text + "Call." + k.tool_text + k.stop_text)), off).drop_reason \
            == "missing_think_end"


def test_tool_call_ends_reasoning_is_available_to_other_families(families):
    q = families["qwen3"]
    row = q.row(q.enc("<think>\nLet me call." + q.tool_text + q.stop_text))
    assert q.segment(row).drop_reason == "missing_think_end"  # Qwen3's default
    on = detect_profile(q.tok, {"tool_call_ends_reasoning": True})
    seg = q.segment(row, on)
    assert seg.kept and seg.flags == ("tool_call_ended_reasoning",) and seg.n_tool_calls == 1


def test_family_profiles_carry_the_reasoning_rules(families):
    assert families["kimi-k2.5"].profile.tool_call_ends_reasoning
    assert not families["qwen3"].profile.tool_call_ends_reasoning
    assert not families["deepseek-r1"].profile.tool_call_ends_reasoning
    assert families["deepseek-r1"].profile.implicit_think_start
    assert not families["qwen3"].profile.implicit_think_start and not families["kimi-k2.5"].profile.implicit_think_start
    # vocab sizes: config.json (Qwen3 pads to 151936; Kimi's is under text_config), else len(tokenizer)
    assert families["qwen3"].vocab == 151936 and families["kimi-k2.5"].vocab == 163840
    assert families["deepseek-r1"].vocab == len(families["deepseek-r1"].tok) == 128815


# ------------------------------------------------------------- one implementation: QC, live monitor, client
def _reply_body(row: dict) -> dict:
    finish = row["finish_reason"]
    fr = ({"type": "stop", "matched": row["matched_stop"]} if finish == "stop" else
          {"type": "length", "length": MAX_NEW} if finish == "length" else
          {"type": "abort", "message": "aborted", "status_code": 503} if finish == "abort" else {"type": finish})
    return {"text": "", "output_ids": row["output_ids"], "meta_info": {
        "id": row["sample_id"], "finish_reason": fr, "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"], "cached_tokens": 0, "e2e_latency": 0.1}}


@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1", "kimi-k2.5"])
def test_client_qc_and_live_monitor_agree(families, name):
    f = families[name]
    rows = {**{f"keep:{k}": r for k, r in _keep_cases(f).items()}, **_drop_cases(f)}
    monitor = LiveQualityMonitor(f.profile, Thresholds(), LiveSpec(warmup_rows=1000), blank_ids=f.blank,
                                 prompt_opens_think={}, prompt_ids={}, vocab_size=f.vocab, control_ids=f.control)
    for i, (case, row) in enumerate(rows.items()):
        row = dict(row, sample_id=f"s{i}")
        monitor.prompt_opens_think[row["sample_id"]] = f.opens
        monitor.prompt_ids[row["sample_id"]] = f.prompt_ids
        qc = f.segment(row)
        monitor.observe(row)
        assert monitor.flush() == [qc], case  # the monitor's batch segmentation, row by row
        max_new = json.loads(row["sampling_params"])["max_new_tokens"]
        try:
            parse_generate_reply(_reply_body(row), f.prompt_ids, f.vocab, max_new_tokens=max_new, rid=row["sample_id"],
                        control_ids=f.control, well_formed=f.check())
        except ReplyError as exc:
            assert exc.kind == qc.drop_reason and qc.drop_reason in CLIENT_KINDS, (case, exc.kind, qc)
        else:
            assert qc.drop_reason not in CLIENT_KINDS, (case, qc)
    snap = monitor.snapshot()
    assert sum(snap["drop_reasons"].values()) == len(_drop_cases(f))


# ------------------------------------------------- a prompt echo that only the reply's shape betrays (issue 27)
def _echo_rows(f: Family) -> dict[tuple[str, int], dict]:
    """(keep case, k) -> that well-formed reply behind the prompt's last k ids, counted in completion_tokens (as a
    server echoing SGLang's detokenization window answers: the counts agree), plus a cut at the cap."""
    good = {case: row for case, row in _keep_cases(f).items() if case != "begins_like_the_prompt_tail"}
    if f.opens or f.open_text:
        good["cut_in_reasoning"] = f.row(f.enc(f.open_text + "Okay, 2 and 2 make"), finish="length")
    rows = {}
    for case, row in good.items():
        for k in range(1, 7):
            ids = f.prompt_ids[-k:] + row["output_ids"]
            rows[(case, k)] = f.row(ids, finish=row["finish_reason"])
    return rows


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_echo_named_prompt_echo_by_qc_client_and_monitor_and_no_well_formed_reply_refused(families, name):
    f = families[name]
    check = f.check()
    rows = _echo_rows(f)
    qc = {key: f.segment(row).drop_reason for key, row in rows.items()}
    # the vectorised path (qc_shards, the live monitor) names the same rows
    batch = segment_rows(list(rows.values()), f.profile, prompt_opens_think=f.rendered_opens,
                         prompt_ids=[f.prompt_ids] * len(rows), blank_ids=f.blank, vocab_size=f.vocab,
                         control_ids=f.control)
    assert dict(zip(rows, batch.drop_reasons())) == qc
    by_shape = as_is = 0
    for (case, k), row in rows.items():
        head, ids = f.prompt_ids[-k:], row["output_ids"]
        ordinary = not any(t in f.control for t in head)
        whole_as_is = reply_well_formed(ids, row["finish_reason"], f.profile, prompt_opens_think=f.rendered_opens,
                                        blank_ids=f.blank)
        body = _reply_body(row)
        if row["finish_reason"] == "length":
            body["meta_info"]["finish_reason"] = {"type": "length", "length": len(ids)}
        try:
            parse_generate_reply(body, f.prompt_ids, f.vocab, max_new_tokens=MAX_NEW, rid=row["sample_id"],
                        control_ids=f.control, well_formed=check)
        except ReplyError as exc:
            client = exc.kind
        else:
            client = None
        if ordinary and whole_as_is:  # begins like the prompt's tail and is whole as it stands: kept
            as_is += 1
            assert client is None and qc[(case, k)] in (None, "truncated_in_reasoning", "truncated_in_answer"), \
                (case, k, qc[(case, k)], f.tok.decode(ids))
        else:  # a control id in the head, or whole only without it: an echo, wherever it is met
            by_shape += ordinary
            assert client == qc[(case, k)] == "prompt_echo", (case, k, client, qc[(case, k)], f.tok.decode(ids))
    # what each family's generation prompt allows (test_prompt_tails_and_who_opens_the_block): Qwen3 thinking ends
    # "assistant\n" (two ordinary ids before a reply that opens <think>), Qwen3 without thinking "</think>\n\n" and
    # R1 "<think>\n" (one ordinary id a whole reply may begin with), DeepSeek-V3 and Kimi end with a control id
    expected = {"qwen3": (True, False), "qwen3-no-thinking": (False, True), "deepseek-r1": (False, True),
                "deepseek-v3-template": (False, False), "kimi-k2-thinking": (False, False),
                "kimi-k2.5": (False, False)}[name]
    assert (by_shape > 0, as_is > 0) == expected, (by_shape, as_is)
    # the well-formed replies themselves are kept by QC and the client alike
    for case, row in _keep_cases(f).items():
        assert f.segment(row).kept, case
        max_new = json.loads(row["sampling_params"])["max_new_tokens"]
        parse_generate_reply(_reply_body(row), f.prompt_ids, f.vocab, max_new_tokens=max_new, rid=row["sample_id"],
                    control_ids=f.control, well_formed=check)


def test_structure_check_reads_the_prompts_fact_and_falls_back_to_the_renderers_rule(families):
    q = families["qwen3"]
    reply = q.reply("Okay.", "4")  # opens <think> itself: whole for a prompt that opened no block
    assert StructureCheck(q.profile)(q.prompt_ids, reply, "stop")  # no mapping: opens_think_block of the prompt
    assert not StructureCheck(q.profile, prompt_opens_think={"r": True})(q.prompt_ids, reply, "stop", "r")
    assert StructureCheck(q.profile, prompt_opens_think={"r": True})(q.prompt_ids, reply, "stop", "other")
    r1 = families["deepseek-r1"]
    assert StructureCheck(r1.profile)(r1.prompt_ids, r1.reply("Okay.", "4"), "stop")  # R1 opens: <think>\n
    # a cut at the cap is whole as far as it goes unless something before the cut breaks a rule
    assert StructureCheck(r1.profile)(r1.prompt_ids, r1.enc("Okay, 2 and"), "length")
    assert StructureCheck(r1.profile)(r1.prompt_ids, r1.enc("Okay.\n</think>\n\n4 is"), "length")
    assert not StructureCheck(r1.profile)(r1.prompt_ids, r1.enc("Okay.</think>4</think>4 is"), "length")
    assert not StructureCheck(r1.profile)(r1.prompt_ids, r1.reply("Okay.", "4"), "abort")
