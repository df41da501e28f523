"""The demo target's training rows: transcripts encoded with the demo tokenizer (prompt, reply weights, the repeated
count-down lines kept out of the loss) and the fixed step plan that packs them into two shards per step."""

from __future__ import annotations

import math
import random
import re
from typing import Any

from eagle_assets.demo.recipe import SHARDS, DemoRecipe
from eagle_assets.demo.transcripts import DemoSample, completion_text


def encode_sample(tokenizer, sample: DemoSample) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of a transcript, tokenized the way the pipeline does it.

    The prompt is the chat template with ``add_generation_prompt=True`` tokenized once (it ends with ``<think>``);
    the reply is :func:`completion_text` tokenized on its own and ends with ``<|im_end|>``. Because the prompt
    ends with a control token, the concatenation equals what greedy generation produces token by token.
    """
    text = tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = tokenizer(completion_text(sample), add_special_tokens=False)["input_ids"]
    return prompt, reply


_COUNTER_LINE = re.compile(r"^\d+ to go: ")


def encode_tool_chain(tokenizer, second: DemoSample) -> tuple[list[int], int, list[tuple[int, int, bool]]]:
    """(ids, number of turn-1 prompt ids, spans) of a whole tool chain in one training row: turn 1's prompt, its
    reply (the call), the call's result, the generation prompt, then turn 2's reply (``second``, a
    ``tool_result`` sample).

    The template keeps turn 1's reasoning in turn 2's prompt (it is after the last user turn), so turn 2's prompt
    is exactly turn 1's prompt + turn 1's reply + ``"\n"`` + the result turn + the generation prompt: one row
    teaches both replies, each exactly as generated and as ``all_turns`` renders it back. ``spans`` are
    ``(start, end, is_reply)`` over ``ids[n_prompt:]``: the two replies (True) and the result turn between them
    (False, a prompt part). Each part is tokenized on its own; the parts meet at control tokens, so the ids equal
    the tokenization of the whole text (checked).

    Raises:
        ValueError: the template does not render turn 2's prompt as that extension of turn 1's (a template
            change that breaks this, e.g. one that drops reasoning inside a tool chain).
    """
    first = second.features["first"]

    def render(sample: DemoSample) -> str:
        return tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True,
                                             tokenize=False)

    p1, c1, p2 = render(first), completion_text(first), render(second)
    if not p2.startswith(p1 + c1):
        raise ValueError("the demo chat template does not render a tool chain's turn-2 prompt as turn 1's prompt "
                         "+ turn 1's reply + the result; encode the turns as separate rows")
    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt, reply1, between, reply2 = enc(p1), enc(c1), enc(p2[len(p1 + c1):]), enc(completion_text(second))
    if prompt + reply1 + between != enc(p2):
        raise ValueError("a tool chain's parts tokenize differently from its whole turn-2 prompt")
    a, b = len(reply1), len(reply1) + len(between)
    return (prompt + reply1 + between + reply2, len(prompt),
            [(0, a, True), (a, b, False), (b, b + len(reply2), True)])


def training_row(tokenizer, sample: DemoSample, rng: random.Random, recipe: "DemoRecipe"
                 ) -> tuple[list[int], int, list[float], list[bool]]:
    """(ids, number of prompt ids, loss weight per later id, reply flag per later id) of one training transcript.

    A ``tool_result`` sample is its whole chain (:func:`encode_tool_chain`: the call at the ``tool`` reply weight,
    the result turn at ``prompt_loss_weight``, the answer at its own weight); every other sample is its prompt and
    reply (:func:`encode_training_sample`, with the masked repeated count line). Weights come from
    ``recipe.reply_weights`` (default 1.0).
    """
    weight = dict(recipe.reply_weights)
    if sample.kind == "tool_result":
        ids, n_prompt, spans = encode_tool_chain(tokenizer, sample)
        w: list[float] = []
        flags: list[bool] = []
        for (start, end, is_reply), kind in zip(spans, ("tool", None, "tool_result")):
            w += [weight.get(kind, 1.0) if is_reply else recipe.prompt_loss_weight] * (end - start)
            flags += [is_reply] * (end - start)
        return ids, n_prompt, w, flags
    ids, n_prompt, learn = encode_training_sample(tokenizer, sample, rng, recipe.counter_repeat_prob)
    kind_w = weight.get(sample.kind, 1.0)
    return ids, n_prompt, [kind_w if flag else 0.0 for flag in learn], list(learn)


def encode_training_sample(tokenizer, sample: DemoSample, rng: random.Random,
                           repeat_prob: float) -> tuple[list[int], int, list[bool]]:
    """(ids, number of prompt ids, per-reply-token "learn" flags) of one training transcript.

    With probability ``repeat_prob`` one count-down line ("7 to go: ...") of the reasoning is written twice and the
    tokens of the copy are flagged False (no loss). The line after the copy still counts down from the copied
    value, so the model learns that the next count depends on the last count it wrote, not on how many lines it
    has written: a model that repeats a count by mistake (likeliest at "1 to go") still reaches "0 to go" and
    closes its reasoning instead of looping until ``max_new_tokens``. Half of the repeats hit the last
    count-down line, where a loop costs most.
    """
    prompt, reply = encode_sample(tokenizer, sample)
    lines = sample.reasoning.split("\n")
    counters = [i for i, line in enumerate(lines) if _COUNTER_LINE.match(line)]
    if not counters or rng.random() >= repeat_prob:
        return prompt + reply, len(prompt), [True] * len(reply)
    at = counters[-1] if rng.random() < 0.5 else rng.choice(counters)
    full = completion_text(sample)
    head = "\n" + "\n".join(lines[:at + 1]) + "\n"
    copy = lines[at] + "\n"
    assert full.startswith(head)
    parts = [(head, True), (copy, False), (full[len(head):], True)]
    ids: list[int] = []
    learn: list[bool] = []
    for text, flag in parts:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        learn += [flag] * len(piece)
    return prompt + ids, len(prompt), learn


def plan_steps(rows: list[tuple[list[int], int, list[float], list[bool]]], recipe: DemoRecipe,
                rng: random.Random) -> list[dict[str, Any]]:
    """The optimizer steps: ``[{"shards": [rows of shard 0, rows of shard 1], "lr", "weighted_tokens"}]``.

    Rows are shuffled, sorted by length within windows of 64 (little padding, random order) and packed into shards
    of at most ``batch_tokens / 2`` padded tokens; two consecutive shards (of similar lengths, so two workers
    finish together) make one step, and the steps are shuffled. Everything here is fixed by the recipe and seed.
    ``weighted_tokens`` counts the step's target tokens with a non-zero loss weight (the loss divisor). The
    learning rate warms up linearly for ``warmup_steps``, then decays along a cosine to ``min_lr_ratio * lr``.
    """
    order = list(range(len(rows)))
    rng.shuffle(order)
    budget = recipe.batch_tokens // SHARDS
    pairs: list[list[list[int]]] = []
    window = 64
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(rows[i][0]))
        shards: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i in chunk:
            n = len(rows[i][0])
            if cur and max(longest, n) * (len(cur) + 1) > budget:
                shards.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            shards.append(cur)
        pairs += [(shards[j:j + SHARDS] + [[]] * SHARDS)[:SHARDS] for j in range(0, len(shards), SHARDS)]
    rng.shuffle(pairs)
    total = len(pairs)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps)
        return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def weighted(i: int) -> int:
        ids, n_prompt, reply_w = rows[i][:3]
        return max(0, n_prompt - 1) * (recipe.prompt_loss_weight > 0) + sum(w > 0 for w in reply_w)

    return [{"shards": pair, "lr": lr_at(n), "weighted_tokens": sum(weighted(i) for shard in pair for i in shard)}
            for n, pair in enumerate(pairs)]
