"""Write the demo partitions' raw source files in their datasets' native layouts.

``python -m eagle_assets.demo.raw_samples [--out DIR]`` (default ``<repo>/catalogs/demo_data``) writes, byte for
byte deterministically, 50 well-formed records plus 2 malformed ones per file. The prompts come from the same
generator the demo target is trained on (:mod:`eagle_assets.demo.transcripts`, seed :data:`RAW_SEED`, a stream the
training set never draws from), so the demo target answers them in distribution; the assistant turns hold that
generator's reference reply converted to each dataset's own reply layout.

Files and their layouts:

- ``B1_glaive.json`` -- glaiveai/glaive-function-calling-v2 raw text: a JSON list of ``{"system": "SYSTEM: You
  are a helpful assistant with access to the following functions. Use them if required -\\n{4-space indented
  function schema}\\n\\n{...}\\n", "chat": "USER: ...\\n\\n\\nASSISTANT: <functioncall> {\\"name\\": ...,
  \\"arguments\\": '{...}'} <|endoftext|>\\n\\n\\nFUNCTION RESPONSE: {...}\\n\\n\\nASSISTANT: ...
  <|endoftext|>\\n\\n\\n"}``
  (arguments wrapped in single quotes, as glaive writes them). Every call has its recorded result; about 60% of
  the conversations go on with a follow-up ``USER:`` question and its ``ASSISTANT:`` answer (the generator's turn 3,
  :func:`eagle_assets.demo.transcripts.tool_turns`), so an ``all_turns`` partition replays two or three turns.
- ``B2_opencodeinstruct.jsonl`` -- nvidia/OpenCodeInstruct: ``id``, ``input`` (the instruction), ``output`` (the
  solution), ``domain``, ``generation_algorithm``, ``llm_judgement`` (a JSON string), ``unit_tests`` (a JSON string
  holding a list of asserts), ``tests_execution_status`` (a JSON string), ``average_test_score`` (a string), as the
  dataset stores them.
- ``B4_mixturethoughts.jsonl`` -- open-r1/Mixture-of-Thoughts: ``{"messages": [user, assistant], "num_tokens",
  "source"}`` with the assistant content ``<think>\\n...\\n</think>\\n\\nanswer``. ``num_tokens`` is an estimate
  (characters / 4): the real field counts tokens of a tokenizer this module does not have.
- ``B5_openthoughts.jsonl`` -- open-thoughts/OpenThoughts-114k: ``{"system", "conversations": [{"from": "user",
  "value"}, {"from": "assistant", "value": "<|begin_of_thought|>\\n\\n...\\n\\n<|end_of_thought|>\\n\\n
  <|begin_of_solution|>\\n\\n...\\n\\n<|end_of_solution|>"}]}``. Its system prompt is a shortened version of
  OpenThoughts' own (see ``transcripts.THOUGHTS_SYSTEM``).

Deliberately malformed records (kept early, at rows 3 and 17, so a ``limit: 48`` partition still meets them):

- B1 row 3: the chat has no ``USER:`` turn (it starts with ``ASSISTANT:``) -> rejected (unparseable / no user turn).
- B1 row 17: the ``<functioncall>`` arguments are not JSON (``'{"city": Paris}'``) -> ``invalid_tool_arguments``.
- B2 row 3: ``input`` is null -> ``missing_field``.
- B2 row 17: ``input`` is a list of strings -> ``bad_field_type``.
- B4 row 3: ``messages`` holds only an assistant turn -> ``no_user_turn``.
- B4 row 17: ``messages`` is a string -> ``bad_field_type``.
- B5 row 3: ``conversations`` is an object, not a list -> ``bad_field_type``.
- B5 row 17: the user turn's ``value`` is empty -> ``empty_prompt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from eagle_assets.demo.transcripts import (
    GLAIVE_SYSTEM,
    THOUGHTS_SYSTEM,
    DemoSample,
    function_schema,
    generate_samples,
    tool_turns,
)

RAW_SEED = 2024
N_RECORDS = 50
MALFORMED_ROWS = (3, 17)
FILES = {
    "tool": "B1_glaive.json",
    "code": "B2_opencodeinstruct.jsonl",
    "math": "B4_mixturethoughts.jsonl",
    "reasoning": "B5_openthoughts.jsonl",
}


def default_out_dir() -> Path:
    """``<repo>/catalogs/demo_data`` (the package sits at ``<repo>/eagle_assets``)."""
    return Path(__file__).resolve().parents[2] / "catalogs" / "demo_data"


def _user(sample: DemoSample) -> str:
    return next(m["content"] for m in sample.messages if m["role"] == "user")


# ----------------------------------------------------------------------------------------------------- B1 glaive

def glaive_record(sample: DemoSample) -> dict[str, str]:
    """A tool sample as a glaive-function-calling-v2 record (``system`` and ``chat`` raw text)."""
    schemas = "\n\n".join(json.dumps(function_schema(n), indent=4) for n in sample.features["function_names"])
    call = sample.tool_calls[0]["function"]
    args = json.dumps(call["arguments"])
    response, final = sample.features["function_response"]
    chat = (f"USER: {_user(sample)}\n\n\n"
            f"ASSISTANT: <functioncall> {{\"name\": \"{call['name']}\", \"arguments\": '{args}'}} <|endoftext|>\n\n\n"
            f"FUNCTION RESPONSE: {json.dumps(response)}\n\n\n"
            f"ASSISTANT: {final} <|endoftext|>\n\n\n")
    if sample.features["follow_up_recorded"]:
        question, _, answer = sample.features["follow_up"]
        chat += f"USER: {question}\n\n\nASSISTANT: {answer} <|endoftext|>\n\n\n"
    return {"system": f"SYSTEM: {GLAIVE_SYSTEM}\n{schemas}\n", "chat": chat}


def _glaive_malformed(sample: DemoSample, row: int) -> dict[str, str]:
    # Without a follow-up: its USER turn would give the row-3 record (no USER: turn first) a user turn to keep.
    rec = glaive_record(dataclasses.replace(sample, features={**sample.features, "follow_up_recorded": False}))
    if row == MALFORMED_ROWS[0]:
        rec["chat"] = rec["chat"].split("ASSISTANT: ", 1)[1]
        rec["chat"] = "ASSISTANT: " + rec["chat"]
    else:
        rec["chat"] = ("USER: What is the weather like in Paris today?\n\n\n"
                       "ASSISTANT: <functioncall> {\"name\": \"get_weather\", \"arguments\": '{\"city\": Paris}'} "
                       "<|endoftext|>\n\n\n")
    return rec


# ------------------------------------------------------------------------------------------- B2 OpenCodeInstruct

def _unit_tests(sample: DemoSample) -> list[str]:
    name = sample.features["function"]
    namespace: dict[str, Any] = {}
    exec(sample.features["code"], namespace)  # our own generated code; computing expected values keeps asserts true
    fn = namespace[name]
    param = sample.features["code"].split("(", 1)[1].split(")", 1)[0]
    inputs: list[Any] = {
        "nums": [[3, 8, 2, 7], [-4, -4, 10], [5]],
        "items": [[], [1, 2, 3], ["a", "b", "a"]],
        "text": ["", "Never odd or even", "level up now"],
        "words": [[], ["a", "b"], ["red", "fox"]],
    }[param]
    return [f"assert {name}({x!r}) == {fn(x)!r}" for x in inputs]


def opencodeinstruct_record(sample: DemoSample) -> dict[str, Any]:
    """A code sample as an OpenCodeInstruct record (judge and test fields are JSON strings, as in the dataset)."""
    tests = _unit_tests(sample)
    judgement = {
        "Requirement Conformance": {"score": 5, "justification": "The function meets every stated requirement."},
        "Logical Correctness": {"score": 5, "justification": "The logic is correct for all inputs."},
        "Edge Case Consideration": {
            "score": 5, "justification": f"All {sample.features['n_items']} listed cases are handled."},
        "Overall Assessment": {"score": 5, "justification": "A correct and clear solution."},
    }
    output = (f"```python\n{sample.features['code']}\n```")
    return {
        "id": hashlib.md5(_user(sample).encode()).hexdigest(),
        "input": _user(sample),
        "output": output,
        "domain": "generic",
        "generation_algorithm": "self-instruct",
        "llm_judgement": json.dumps(judgement),
        "unit_tests": json.dumps(tests),
        "tests_execution_status": json.dumps(["pass"] * len(tests)),
        "average_test_score": "1",
    }


def _opencodeinstruct_malformed(sample: DemoSample, row: int) -> dict[str, Any]:
    rec = opencodeinstruct_record(sample)
    rec["input"] = None if row == MALFORMED_ROWS[0] else rec["input"].split("\n")
    return rec


# ---------------------------------------------------------------------------------------- B4 Mixture-of-Thoughts

def mixturethoughts_record(sample: DemoSample) -> dict[str, Any]:
    """A math sample as a Mixture-of-Thoughts record (reasoning inline in ``<think>`` tags)."""
    reply = f"<think>\n{sample.reasoning}\n</think>\n\n{sample.content}"
    messages = [{"role": "user", "content": _user(sample)}, {"role": "assistant", "content": reply}]
    return {"messages": messages, "num_tokens": (len(_user(sample)) + len(reply)) // 4,
            "source": "open-r1/OpenR1-Math-220k"}


def _mixturethoughts_malformed(sample: DemoSample, row: int) -> dict[str, Any]:
    rec = mixturethoughts_record(sample)
    if row == MALFORMED_ROWS[0]:
        rec["messages"] = rec["messages"][1:]
    else:
        # one turn where the layout wants a list of turns (a lone string would be read as one user prompt)
        rec["messages"] = {"role": "user", "content": _user(sample)}
    return rec


# ------------------------------------------------------------------------------------------------ B5 OpenThoughts

def openthoughts_record(sample: DemoSample) -> dict[str, Any]:
    """A reasoning sample as an OpenThoughts record (``system`` + ShareGPT-style ``conversations``)."""
    value = (f"<|begin_of_thought|>\n\n{sample.reasoning}\n\n<|end_of_thought|>\n\n"
             f"<|begin_of_solution|>\n\n{sample.content}\n\n<|end_of_solution|>")
    return {"system": THOUGHTS_SYSTEM,
            "conversations": [{"from": "user", "value": _user(sample)}, {"from": "assistant", "value": value}]}


def _openthoughts_malformed(sample: DemoSample, row: int) -> dict[str, Any]:
    rec = openthoughts_record(sample)
    if row == MALFORMED_ROWS[0]:
        rec["conversations"] = {"from": "user", "value": _user(sample)}
    else:
        rec["conversations"][0]["value"] = ""
    return rec


_WRITERS = {
    "tool": (glaive_record, _glaive_malformed),
    "code": (opencodeinstruct_record, _opencodeinstruct_malformed),
    "math": (mixturethoughts_record, _mixturethoughts_malformed),
    "reasoning": (openthoughts_record, _openthoughts_malformed),
}


def raw_records(kind: str, n_records: int = N_RECORDS) -> list[Any]:
    """The records of one demo file: ``n_records`` well-formed ones with malformed ones inserted at
    :data:`MALFORMED_ROWS` (built from extra samples of the same stream). A larger ``n_records`` extends the
    same stream (experiments that need a partition with many rows); the default file is unchanged by it."""
    good, bad = _WRITERS[kind]
    samples = generate_samples(kind, n_records + len(MALFORMED_ROWS), RAW_SEED)
    records: list[Any] = [good(s) for s in samples[:n_records]]
    for row, s in zip(MALFORMED_ROWS, samples[n_records:]):
        records.insert(row, bad(s, row))
    return records


_NATIVE_SYSTEM = {"tool": GLAIVE_SYSTEM, "code": None, "math": None, "reasoning": THOUGHTS_SYSTEM}


def prompt_samples(kind: str) -> list[DemoSample]:
    """The well-formed samples behind a demo file, in file order (malformed rows left out), with their prompt
    messages as the file carries them: glaive and OpenThoughts records always have their system prompt,
    OpenCodeInstruct and Mixture-of-Thoughts records never have one (the generator varies this for training)."""
    system = _NATIVE_SYSTEM[kind]
    out = []
    for s in generate_samples(kind, N_RECORDS, RAW_SEED):
        messages = [m for m in s.messages if m["role"] != "system"]
        if system:
            messages = [{"role": "system", "content": system}] + messages
        out.append(dataclasses.replace(s, messages=messages))
    return out


def turn_samples() -> list[DemoSample]:
    """The later turns of the committed B1 conversations, in file order: turn 2 (``tool_result``: the reference
    call and its recorded result, as ``all_turns`` splices it) of every conversation, then turn 3
    (``follow_up``) of those whose record holds a follow-up question. Turn 3's prompt is also the ``last_user``
    prompt of that record (its history renders without reasoning either way)."""
    firsts = prompt_samples("tool")
    turns = [tool_turns(s) for s in firsts]
    return ([second for second, _ in turns]
            + [third for s, (_, third) in zip(firsts, turns) if s.features["follow_up_recorded"]])


def last_user_samples(kind: str) -> list[DemoSample]:
    """What a ``prompt_policy: last_user`` partition over the committed file of ``kind`` generates for, in file
    order: the turn-1 sample, or for a B1 conversation recording a follow-up its turn-3 ``follow_up`` sample."""
    out = []
    for s in prompt_samples(kind):
        out.append(tool_turns(s)[1] if kind == "tool" and s.features["follow_up_recorded"] else s)
    return out


def write_raw_samples(out_dir: Path | None = None, n_records: dict[str, int] | None = None) -> list[Path]:
    """Write the four demo source files into ``out_dir`` (default :func:`default_out_dir`); returns their paths.
    ``n_records`` maps a kind ("tool", "code", "math", "reasoning") to its number of well-formed records."""
    out_dir = Path(out_dir or default_out_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, name in FILES.items():
        records = raw_records(kind, (n_records or {}).get(kind, N_RECORDS))
        path = out_dir / name
        if name.endswith(".jsonl"):
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        else:
            text = json.dumps(records, ensure_ascii=False, indent=2) + "\n"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_assets.demo.raw_samples",
                                     description="write the demo partitions' raw files in native dataset layouts")
    parser.add_argument("--out", type=Path, default=None, help="default: <repo>/catalogs/demo_data")
    args = parser.parse_args(argv)
    for path in write_raw_samples(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
