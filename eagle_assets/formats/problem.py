"""Competition-math layouts: ``{"problem": str, "solution"?: str, "answer"?: str | number, ...}``.

Covers, with the field names of their dataset cards:
- MATH (hendrycks/competition_math; HuggingFaceH4/MATH-500): ``problem, level, type|subject, solution[, answer]``,
- AIME (AI-MO/aimo-validation-aime, HuggingFaceH4/aime_2024): ``id, problem, solution, answer (string), url``;
  Maxwell-Jia/AIME_2024 capitalises them: ``ID, Problem, Solution, Answer (a number)``,
- AMC (AI-MO/aimo-validation-amc): ``id, problem, answer (float64, e.g. 27.0), url`` -- no solution;
  MathArena (``problem_idx, problem, answer (int64)``).

The problem is the user turn. The reference reply is the worked solution when there is one, else the final answer
(numbers written as JSON numbers); a reference is kept for comparison only, so a missing, numeric or malformed
one never rejects the prompt (:func:`~eagle_assets.formats.conversation.reference_text`).
"""

from __future__ import annotations

from typing import Any

from eagle_assets.formats.conversation import (
    BAD_FIELD_TYPE,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    Conversation,
    RecordError,
    finalize,
    make_message,
    reference_text,
)

NAME = "problem"
SIGNATURE_KEYS = ("problem", "Problem")


def _field(record: dict, name: str) -> Any:
    return record[name] if name in record else record.get(name.capitalize())


def matches(record: Any) -> bool:
    """True when the record has a string ``problem`` (or ``Problem``) field."""
    return isinstance(record, dict) and isinstance(_field(record, "problem"), str)


def parse(record: Any, row: int) -> Conversation:
    """One competition problem -> Conversation; raises RecordError (see conversation.REJECT_REASONS)."""
    if not isinstance(record, dict):
        raise RecordError(NOT_AN_OBJECT, f"problem record is a {type(record).__name__}, expected a JSON object")
    problem = _field(record, "problem")
    if problem is None:
        raise RecordError(MISSING_FIELD, f"problem record has no 'problem' field (keys: {sorted(record)[:12]})")
    if not isinstance(problem, str):
        raise RecordError(BAD_FIELD_TYPE, f"problem field 'problem' is a {type(problem).__name__}, expected text")
    messages: list[dict[str, Any]] = [{"role": "user", "content": problem}]
    reference = reference_text(_field(record, "solution")) or reference_text(_field(record, "answer"))
    if reference:
        messages.append(make_message("assistant", reference, "solution"))
    return finalize(messages, None, row, record)
