"""Turning a normalized conversation into a generation prompt, and the stable sample id of a raw record."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from eagle_assets.formats.conversation import Conversation

PROMPT_POLICIES = ("last_user", "first_user", "all_turns")


def sample_id(partition_key: str, source_record: Any) -> str:
    """Stable id of a raw record within a partition: first 16 hex chars of sha256(partition key + NUL + canonical
    JSON of the record (sorted keys, compact separators, UTF-8)).

    Identical records in one partition share an id on purpose: they would produce identical prompts, so the
    pipeline keeps one. Independent of file position, so reordering or appending to a source keeps ids. Text
    that is not valid Unicode (a lone surrogate) is hashed by its code points (``surrogatepass``), so such a
    record still has an id; valid text hashes exactly as plain UTF-8.
    """
    canonical = json.dumps(source_record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    digest = hashlib.sha256(partition_key.encode("utf-8", "surrogatepass") + b"\x00"
                            + canonical.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def _reply(message: dict[str, Any] | None) -> dict[str, Any] | None:
    if message is None or message.get("role") != "assistant":
        return None
    return copy.deepcopy({
        "reasoning_content": message.get("reasoning_content"),
        "content": message.get("content", ""),
        "tool_calls": message.get("tool_calls"),
    })


def all_turns(conv: Conversation) -> list[dict[str, Any]]:
    """Every message of ``conv``, then its ``later_turns`` (user turns that follow replies the file does not hold,
    MT-bench's second turn), each after an empty assistant message that marks the model's reply slot."""
    msgs = copy.deepcopy(conv.messages)
    for turn in conv.later_turns:
        msgs.append({"role": "assistant", "content": ""})
        msgs.extend(copy.deepcopy(list(turn)))
    return msgs


def build_prompt(conv: Conversation, policy: str = "last_user") -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Cut a conversation into (prompt messages, reference reply or None).

    Policies:
        ``last_user``: every message up to and including the LAST user turn (earlier assistant turns, tool calls
            and tool results stay as history); the assistant message right after it, if any, is the reference.
        ``first_user``: the leading system message (if any) plus the FIRST user turn; the assistant message right
            after that turn, if any, is the reference.
        ``all_turns``: the whole conversation (``all_turns``); every assistant turn is regenerated from it
            (``eagle_assets.generations.rollout``), the dataset's first assistant message is the reference.
    The reference is ``{"reasoning_content": str|None, "content": str, "tool_calls": list|None}``; it is the
    dataset's answer, kept for comparison only -- the training target is the target model's own generation.
    Messages after the reference are discarded.

    Raises:
        ValueError: unknown policy (the catalog validates policies, so this is a programming error).
    """
    msgs = conv.messages
    if policy == "all_turns":
        return all_turns(conv), _reply(next((m for m in msgs if m["role"] == "assistant"), None))
    user_idx = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if policy == "last_user":
        cut = user_idx[-1]
        prompt = copy.deepcopy(msgs[: cut + 1])
    elif policy == "first_user":
        cut = user_idx[0]
        prompt = copy.deepcopy(([msgs[0]] if msgs[0]["role"] == "system" and cut > 0 else []) + [msgs[cut]])
    else:
        raise ValueError(f"unknown prompt policy {policy!r}; use one of {PROMPT_POLICIES}")
    following = msgs[cut + 1] if cut + 1 < len(msgs) else None
    return prompt, _reply(following)
