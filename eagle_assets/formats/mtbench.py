"""MT-Bench layout (FastChat ``fastchat/llm_judge/data/mt_bench/question.jsonl``):
``{"question_id": int, "category": str, "turns": [str, str], "reference"?: [str, ...]}``.

The second turn of MT-Bench is a follow-up to the model's OWN first answer, which the file does not contain. So
the conversation is ``[user turns[0]]``; when reference answers exist for every earlier turn (math, reasoning and
coding questions carry ``reference``), the later turns are interleaved with them:
``user t0, assistant ref0, user t1, ...``. Without references the later turns are the conversation's
``later_turns``: prompt policy ``all_turns`` asks them after the model's own answers; the other policies ignore
them.

Some eval files in this shape hold one prompt as a string (``{"turns": "..."}``): it is read as one user turn when
that is unambiguous (``conversation.single_prompt_text``), else the record is refused naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    Conversation,
    RecordError,
    finalize,
    is_single_prompt,
    make_message,
    reference_text,
    require,
    single_prompt_text,
)

NAME = "mtbench"
SIGNATURE_KEYS = ("turns",)


def matches(record: Any) -> bool:
    """True when the record has a ``turns`` list of strings, or one prompt string read as one turn."""
    if not isinstance(record, dict):
        return False
    turns = record.get("turns")
    return (isinstance(turns, list) and all(isinstance(t, str) for t in turns)) or is_single_prompt(turns)


def parse(record: Any, row: int) -> Conversation:
    """One MT-Bench question -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    turns = require(record, "turns", (list, str), "mtbench")
    if isinstance(turns, str):  # one prompt as a string: one user turn, or refused as a guess (the detail says why)
        return finalize([{"role": "user", "content": single_prompt_text(turns, "turns", "mtbench")}], None, row,
                        record)
    if not turns:
        raise RecordError("empty_prompt", "mtbench field 'turns' is an empty list")
    for i, t in enumerate(turns):
        if not isinstance(t, str):
            raise RecordError(BAD_FIELD_TYPE, f"mtbench turns[{i}] is a {type(t).__name__}, expected text")
    refs = record.get("reference")
    refs = [reference_text(r) for r in refs] if isinstance(refs, list) else []
    usable = len(refs) >= len(turns) - 1 and all(r is not None for r in refs[: len(turns) - 1])
    messages: list[dict[str, Any]] = [{"role": "user", "content": turns[0]}]
    later: list[list[dict[str, Any]]] = []
    if usable:
        for i in range(1, len(turns)):
            messages.append(make_message("assistant", refs[i - 1], f"reference[{i - 1}]"))
            messages.append({"role": "user", "content": turns[i]})
    else:  # the follow-ups of the model's own answers: prompt policy all_turns asks them (formats.prompt.all_turns)
        for t in turns[1:]:
            if not t.strip():
                break
            later.append([{"role": "user", "content": t}])
    return dataclasses.replace(finalize(messages, None, row, record), later_turns=tuple(later))
