"""Seeded synthetic conversations the embedded demo target is trained on.

Four kinds, one per demo partition (reply lengths in demo-tokenizer tokens, stop token included):

- ``tool`` (B1_glaive): a system turn with 1-2 OpenAI tool schemas (six one-argument functions) and a user request
  one of them answers; the reply is a short reasoning naming the function and its argument, then one
  ``<tool_call>`` (~55-65 tokens).
- ``code`` (B2_opencodeinstruct): "write a Python function ... that must handle K cases"; the reasoning walks the K
  cases, the answer is a fenced Python block (~130-245 tokens).
- ``math`` (B4_mixturethoughts): "N numbers: ..., which is the largest / smallest, how many are even"; the reasoning
  takes one line per number (~275-465 tokens).
- ``reasoning`` (B5_openthoughts): a seating puzzle with K clues under a system prompt; one line per clue, which
  quotes the clue by its number as the prompt lists it (``"5 to go: Clue 3: Ben sits left of Ivy, so ..."``)
  (~225-400 tokens). Copying what follows a matching ``Clue 3:`` is the easiest lookup there is for a small
  model, and the clue number makes every line differ from the one before. Version 1 wrote ``"the next clue says
  that ..."``: a model that had not yet learned which clue came next wrote the same line for every clue, and
  with identical lines the count-down lost its place and looped until ``max_new_tokens`` (issue 12).

Whether a system turn is present varies (about 15% of tool/reasoning prompts lack theirs, 10% of code prompts get
a generic one) so the target does not depend on one exact prompt prefix.

Why this shape: a tiny model trained for about a minute and a half on CPU cannot learn open-ended language, but it
can learn templated sentences and a visible counter. Every long reasoning is a count-down over items whose number
is written in the prompt ("12 numbers", "9 clues", "3 cases"): the header repeats the number, each line starts
with how many items are left ("7 to go: ..."), and :data:`DONE_LINE` ("0 to go, so I am done.") closes it.
Deciding when to write ``</think>`` is then a local pattern (a decrement, and a fixed line at zero) rather than
long-range counting, which a model of this size gets wrong. Spots where the model would have to copy from the
prompt (names, numbers) never decide the structure: a wrong copy still yields a well-formed reply. Reply lengths
therefore differ by kind and vary within a kind, as real reasoning-model traffic does.

The reply follows the Qwen3 layout that ``chat_template.jinja`` renders for assistant history turns: after the
generation prompt ``<|im_start|>assistant\n<think>`` the model writes ``\n{reasoning}\n</think>\n\n`` then the
answer text or ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, then ``<|im_end|>``
(:func:`completion_text`).

Conversations in turns (:data:`TURN_KINDS`, issue 13): a ``tool`` conversation goes on after its call
(:func:`tool_turns`), as glaive's do and as the ``all_turns`` prompt policy replays it:

- ``tool_result`` (turn 2): the history holds the turn-1 reply (reasoning kept: the template keeps the reasoning of
  assistant turns after the last user turn, as Qwen3's does) and the call's result as a ``tool`` message
  (``json.dumps`` of the function response, the text glaive's ``FUNCTION RESPONSE`` block carries); the reply
  reads the result back and answers with it (~40-55 tokens).
- ``follow_up`` (turn 3): the user asks a second question about that answer (which function was used, the raw
  result, say it again, thanks); the history's assistant turns come before the last user turn, so the template
  renders them without their reasoning, exactly as the dataset's own turns (the ``last_user`` prompt of a glaive
  record with that follow-up) render; the reply answers from the history (~35-50 tokens).

The committed B1 file records every call's result and, for about 60% of its conversations, the follow-up
(``features["follow_up_recorded"]``); training draws both later turns for every conversation.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

# Bump when the generated text changes; it is part of the demo target's recipe hash. Version 3 added the later turns
# of tool conversations (TURN_KINDS); the turn-1 prompts and replies of every kind are unchanged.
GENERATOR_VERSION = "3"
# Names the random streams. Kept when the text changes (version 2 only reworded the reasoning lines), so the same
# seed still draws the same prompts: the committed demo prompts and every figure measured on them stay comparable.
_STREAM = "1"

# One kind per demo partition (the turn-1 prompts of its source file).
KINDS: tuple[str, ...] = ("tool", "code", "math", "reasoning")
# Later turns of a tool conversation (see the module doc); served by the tool partition, so they share its cap.
TURN_KINDS: tuple[str, ...] = ("tool_result", "follow_up")
ALL_KINDS: tuple[str, ...] = KINDS + TURN_KINDS
# The partition kind each kind's prompts come from.
PARTITION_KIND: dict[str, str] = {**{k: k for k in KINDS}, **{k: "tool" for k in TURN_KINDS}}
# Share of the committed B1 conversations whose file records the follow-up turn.
FOLLOW_UP_RECORDED_SHARE = 0.6

# glaive-function-calling-v2 opens every system prompt with exactly this sentence; the glaive loader keeps it as
# the system turn and moves the embedded function schemas into ``tools``.
GLAIVE_SYSTEM = "You are a helpful assistant with access to the following functions. Use them if required -"
# Shorter than OpenThoughts' own system prompt (which is ~250 words) to keep training sequences short, same intent.
THOUGHTS_SYSTEM = (
    "Your role as an assistant involves thoroughly exploring questions through a systematic thinking process "
    "before providing the final precise and accurate solution. Check every clue in your thoughts, then give a "
    "short answer."
)
GENERIC_SYSTEM = "You are a helpful assistant."
# The last reasoning line of every count-down, whatever the kind: one shared pattern before </think> is learned
# far more reliably than one per kind, and the answer never repeats it (a repeated line invites the model to
# repeat whatever followed it, here a second </think>).
DONE_LINE = "0 to go, so I am done."

_CITIES = ["Paris", "Tokyo", "Rome", "Cairo", "Lima", "Oslo", "Delhi", "Seoul", "Madrid", "Berlin", "Dublin", "Vienna"]
_NAMES = ["Anna", "Ben", "Carl", "Dana", "Eva", "Finn", "Gina", "Hugo", "Ivy", "Jack", "Kate", "Leo"]
_CURRENCIES = ["EUR", "GBP", "JPY", "CAD", "CHF", "INR"]
_SYMBOLS = ["AAPL", "MSFT", "GOOG", "AMZN", "TSLA", "NVDA"]
_INGREDIENTS = ["rice", "chicken", "tomato", "beans", "lemon", "cheese"]
_TOPICS = ["sports", "science", "music", "travel", "health"]


def _prop(kind: str, description: str) -> dict[str, Any]:
    return {"type": kind, "description": description}


# name -> (description, {arg: (json type, description)}, user templates, goal phrase). Function schemas are in
# glaive's own layout (name, description, parameters{type, properties, required}); the glaive loader wraps them as
# OpenAI tools without reordering keys, so the rendered prompt is byte-identical to what the model was trained on.
_TOOLS: dict[str, tuple[str, dict[str, tuple[str, str]], list[str], str]] = {
    "get_weather": (
        "Get the current weather for a city",
        {"city": ("string", "The name of the city")},
        ["What is the weather like in {city} today?", "Can you tell me the weather in {city}?"],
        "the weather in {city}",
    ),
    "get_stock_price": (
        "Get the current price of a stock",
        {"symbol": ("string", "The stock symbol")},
        ["What is the current stock price of {symbol}?", "How much does one share of {symbol} cost now?"],
        "the stock price of {symbol}",
    ),
    "get_exchange_rate": (
        "Get the exchange rate of a currency in US dollars",
        {"currency": ("string", "The currency code")},
        ["What is the exchange rate of {currency} today?", "How much is one {currency} worth right now?"],
        "the exchange rate of {currency}",
    ),
    "find_flights": (
        "Find flights to a city",
        {"destination": ("string", "The destination city")},
        ["Find me a flight to {destination}.", "Are there any flights to {destination} tomorrow?"],
        "flights to {destination}",
    ),
    "search_recipes": (
        "Search for recipes that use an ingredient",
        {"ingredient": ("string", "The main ingredient")},
        ["Find me a recipe with {ingredient}.", "Do you know a good dish with {ingredient}?"],
        "a recipe with {ingredient}",
    ),
    "get_news": (
        "Get the latest news about a topic",
        {"topic": ("string", "The news topic")},
        ["What are the latest news about {topic}?", "Show me today's headlines on {topic}."],
        "the latest news about {topic}",
    ),
}
_ARG_VALUES = {"city": _CITIES, "symbol": _SYMBOLS, "currency": _CURRENCIES, "destination": _CITIES,
               "ingredient": _INGREDIENTS, "topic": _TOPICS}


def function_schema(name: str) -> dict[str, Any]:
    """The glaive-layout function schema of demo tool ``name`` (``{"name", "description", "parameters"}``)."""
    description, args, _, _ = _TOOLS[name]
    return {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {arg: _prop(t, d) for arg, (t, d) in args.items()},
            "required": list(args),
        },
    }


def _tool_arguments(name: str, rng: random.Random) -> dict[str, Any]:
    return {arg: rng.choice(_ARG_VALUES[arg]) for arg in _TOOLS[name][1]}


@dataclass(frozen=True)
class DemoSample:
    """One synthetic conversation: a prompt and the reply the demo target learns to give.

    Attributes:
        kind: one of :data:`ALL_KINDS`.
        messages: prompt messages (OpenAI style; an optional system turn, then one user turn; for
            :data:`TURN_KINDS` the conversation so far, see :func:`tool_turns`).
        tools: OpenAI tool schemas (``tool`` kind) or None.
        reasoning: the reasoning text (what goes between ``<think>`` and ``</think>``, without the newlines
            the template adds around it).
        content: the answer text after ``</think>`` ("" for tool calls).
        tool_calls: ``[{"type": "function", "function": {"name", "arguments": dict}}]`` or None.
        features: the prompt features the reply length is tied to (``n_items``: steps/clues/cases/arguments) and
            kind-specific facts used to write native dataset records (function response, op, answer...). A
            ``tool`` sample also holds its later turns' text (``follow_up``: question, reasoning, answer;
            ``follow_up_recorded``: whether the committed file records it); a :data:`TURN_KINDS` sample holds
            ``turn`` (2 or 3) and ``first`` (the turn-1 ``tool`` sample it continues).
    """

    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]] | None
    features: dict[str, Any] = field(default_factory=dict)

    def reply_message(self) -> dict[str, Any]:
        """The reply as an OpenAI assistant message (``reasoning_content``, ``content``, optional ``tool_calls``)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def tool_call_text(call: dict[str, Any]) -> str:
    """Qwen3's rendering of one tool call: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    Same bytes as ``chat_template.jinja`` (whose ``tojson`` is ``json.dumps`` with default separators and
    ``ensure_ascii=False``), so history turns and generated turns agree.
    """
    fn = call["function"]
    return ('<tool_call>\n{"name": "' + fn["name"] + '", "arguments": '
            + json.dumps(fn["arguments"], ensure_ascii=False) + "}\n</tool_call>")


def completion_text(sample: DemoSample) -> str:
    """The exact text the model writes after the generation prompt (which ends with ``<think>``), stop token included.

    Layout (Qwen3): ``"\\n" + reasoning + "\\n</think>\\n\\n" + answer + "<|im_end|>"`` where the answer is the
    content, or the tool calls joined by newlines when there is no content.
    """
    answer = sample.content
    if sample.tool_calls:
        calls = "\n".join(tool_call_text(c) for c in sample.tool_calls)
        answer = answer + ("\n" if answer else "") + calls
    return "\n" + sample.reasoning + "\n</think>\n\n" + answer + "<|im_end|>"


# ---------------------------------------------------------------------------------------------------------- tool

def _tool_sample(rng: random.Random) -> DemoSample:
    name = rng.choice(sorted(_TOOLS))
    _, _, templates, goal = _TOOLS[name]
    args = _tool_arguments(name, rng)
    others = rng.sample([t for t in sorted(_TOOLS) if t != name], rng.randint(0, 1))
    names = others + [name]
    rng.shuffle(names)
    tools = [{"type": "function", "function": function_schema(n)} for n in names]
    user = rng.choice(templates).format(**args)
    lines = [f"The user asks for {goal.format(**args)}.", f"The function {name} can do this."]
    for arg, value in args.items():
        lines.append(f"The {arg} is {value}.")
    lines.append(f"I will call {name} now.")
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.85:
        messages.append({"role": "system", "content": GLAIVE_SYSTEM})
    messages.append({"role": "user", "content": user})
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    response = _function_response(name, args, rng)
    return DemoSample(
        kind="tool", messages=messages, tools=tools, reasoning=" ".join(lines), content="", tool_calls=[call],
        features={"n_items": len(args), "function": name, "function_names": names, "function_response": response,
                  **_follow_up(name, args, goal.format(**args), response, user)},
    )


# follow-up question kind -> (user texts, reasoning line, answer); {call}: "the function NAME with the ARG VALUE",
# {result}: the function response as the tool message carries it, {final}: the turn-2 answer, {goal}: the request.
_FOLLOW_UPS: dict[str, tuple[list[str], str, str]] = {
    "which": (["Which function did you use for that?", "How did you find that out?"],
              "I called {call}.", "I used {call}."),
    "raw": (["What did the function return exactly?", "Can you show me the raw result?"],
            "The function returned {result}.", "The function returned {result}."),
    "repeat": (["Can you say that again?", "Sorry, can you repeat your answer?"],
               "My last answer was: {final}", "{final}"),
    "thanks": (["Thank you!", "Thanks, that helps."],
               "The user thanks me for the answer.", "You are welcome. I am glad I could help with {goal}."),
}


def _follow_up(name: str, args: dict[str, Any], goal: str, response: tuple[dict[str, Any], str],
               user: str) -> dict[str, Any]:
    """The follow-up turn of a tool conversation, drawn from its own stream keyed by the conversation's text (so
    adding it left every turn-1 sample of the ``tool`` stream as it was)."""
    rng = random.Random(f"eagle-assets-demo/{_STREAM}/follow-up/{user}/{name}/{json.dumps(args)}")
    result, final = json.dumps(response[0]), response[1]
    kind = rng.choice(sorted(_FOLLOW_UPS))
    questions, line, answer = _FOLLOW_UPS[kind]
    call = "the function " + name + "".join(f" with the {arg} {value}" for arg, value in args.items())
    facts = {"call": call, "result": result, "final": final, "goal": goal}
    reasoning = " ".join([f"The user has a follow-up question about {goal}.", line.format(**facts),
                          "I will answer from the earlier turns."])
    return {"follow_up": (rng.choice(questions), reasoning, answer.format(**facts)),
            "follow_up_recorded": rng.random() < FOLLOW_UP_RECORDED_SHARE}


def tool_result_message(first: DemoSample) -> dict[str, Any]:
    """The ``tool`` message answering ``first``'s call: ``json.dumps`` of the recorded function response."""
    return {"role": "tool", "content": json.dumps(first.features["function_response"][0])}


def tool_turns(first: DemoSample) -> tuple[DemoSample, DemoSample]:
    """The later turns of the ``tool`` conversation ``first``: (turn 2 ``tool_result``, turn 3 ``follow_up``).

    Turn 2's prompt is ``first``'s prompt, ``first``'s reply (:meth:`DemoSample.reply_message`, reasoning and
    call) and the call's result (:func:`tool_result_message`); its reply reads the result back, then answers with
    the sentence glaive's second ASSISTANT block holds. Turn 3's prompt adds that reply and the follow-up question.
    The messages are what a client sends back (``all_turns`` replays the model's own replies this way); the chat
    template decides what of their reasoning the prompt keeps (see the module doc).
    """
    name = first.features["function"]
    args = first.tool_calls[0]["function"]["arguments"]
    response, final = first.features["function_response"]
    result = json.dumps(response)
    _, _, _, goal = _TOOLS[name]
    reasoning = " ".join([f"The function {name} returned {result}.",
                          f"This answers the question about {goal.format(**args)}.", "I will tell the user now."])
    base = {"n_items": first.features["n_items"], "function": name, "first": first}
    second = DemoSample(kind="tool_result",
                        messages=first.messages + [first.reply_message(), tool_result_message(first)],
                        tools=first.tools, reasoning=reasoning, content=final, tool_calls=None,
                        features={**base, "turn": 2})
    question, reasoning3, answer3 = first.features["follow_up"]
    third = DemoSample(kind="follow_up", messages=second.messages + [second.reply_message(),
                                                                     {"role": "user", "content": question}],
                       tools=first.tools, reasoning=reasoning3, content=answer3, tool_calls=None,
                       features={**base, "turn": 3})
    return second, third


def _tool_result_sample(rng: random.Random) -> DemoSample:
    return tool_turns(_tool_sample(rng))[0]


def _follow_up_sample(rng: random.Random) -> DemoSample:
    return tool_turns(_tool_sample(rng))[1]


def _function_response(name: str, args: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str]:
    """A plausible function result and the assistant's final sentence (for glaive's second ASSISTANT block)."""
    if name == "get_weather":
        t = rng.randint(-5, 35)
        return ({"temperature": t, "condition": rng.choice(["sunny", "cloudy", "rainy"])},
                f"It is {t} degrees in {args['city']} right now.")
    if name == "get_stock_price":
        p = round(rng.uniform(50, 900), 2)
        return {"price": p}, f"One share of {args['symbol']} costs {p} dollars."
    if name == "get_exchange_rate":
        r = round(rng.uniform(0.005, 1.5), 3)
        return {"rate": r}, f"One {args['currency']} is worth {r} US dollars."
    if name == "find_flights":
        h = rng.randint(6, 21)
        return {"flights": [{"departure": f"{h}:00"}]}, f"There is a flight to {args['destination']} at {h}:00."
    if name == "search_recipes":
        return ({"recipes": [f"{args['ingredient']} soup", f"{args['ingredient']} salad"]},
                f"You could make a {args['ingredient']} soup or a {args['ingredient']} salad.")
    if name == "get_news":
        return ({"headlines": [f"New {args['topic']} record", f"{args['topic'].title()} update"]},
                f"Here are the latest {args['topic']} headlines.")
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------------------- code

# name -> (parameter, what it does, start value, update line). Every solution has the same shape (a loop that
# updates ``result``) so the end of the code block is as predictable as the end of the reasoning.
_CODE_TASKS: dict[str, tuple[str, str, str, str]] = {
    "sum_list": ("nums", "returns the sum of the numbers in the list", "0", "result += x"),
    "count_evens": ("nums", "returns how many numbers in the list are even", "0", "result += 1 if x % 2 == 0 else 0"),
    "max_value": ("nums", "returns the largest number in the list", "float('-inf')", "result = max(result, x)"),
    "min_value": ("nums", "returns the smallest number in the list", "float('inf')", "result = min(result, x)"),
    "product": ("nums", "returns the product of the numbers in the list", "1", "result *= x"),
    "count_vowels": ("text", "returns how many vowels the text contains", "0", "result += 1 if x in 'aeiou' else 0"),
    "reverse_list": ("items", "returns the items in reverse order", "[]", "result = [x] + result"),
    "join_words": ("words", "returns the words joined into one string", "''", "result += x"),
}
# case -> what the reasoning says about it
_CASES: dict[str, str] = {
    "an empty input": "The loop does not run, so the start value is returned",
    "a single element": "The loop runs once, so the result comes from that element",
    "negative numbers": "The checks do not assume positive values, so they still work",
    "repeated values": "Each value is handled on its own, so repeats are fine",
    "a very long input": "The function makes one pass, so it stays fast",
    "zero": "Zero takes the normal path, so no special check is needed",
    "upper and lower case": "The comparison is the same for both, so case does not matter",
    "extra spaces": "Splitting on spaces ignores the extra ones, so they do no harm",
}


def _code_sample(rng: random.Random) -> DemoSample:
    name = rng.choice(sorted(_CODE_TASKS))
    param, does, start, update = _CODE_TASKS[name]
    k = rng.randint(2, 6)
    cases = rng.sample(sorted(_CASES), k)
    listing = "\n".join(f"{i + 1}. {c}" for i, c in enumerate(cases))
    user = (f"Write a Python function `{name}({param})` that {does}. "
            f"Your function must handle {k} cases:\n{listing}")
    lines = [f"There are {k} cases, so I will check them one at a time and count down from {k}."]
    for i, c in enumerate(cases):
        lines.append(f"{k - i} to go: the next case is {c}. {_CASES[c]}.")
    lines.append(DONE_LINE)
    code = f"def {name}({param}):\n    result = {start}\n    for x in {param}:\n        {update}\n    return result"
    content = f"Here is the function:\n\n```python\n{code}\n```\n\nIt handles all {k} cases."
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.1:
        messages.append({"role": "system", "content": GENERIC_SYSTEM})
    messages.append({"role": "user", "content": user})
    return DemoSample(kind="code", messages=messages, tools=None, reasoning="\n".join(lines), content=content,
                      tool_calls=None, features={"n_items": k, "function": name, "code": code})


# ---------------------------------------------------------------------------------------------------------- math

def _math_sample(rng: random.Random) -> DemoSample:
    n = rng.randint(9, 16)
    nums = [rng.randint(1, 60) for _ in range(n)]
    op = rng.choice(["largest", "smallest", "even"])
    who = rng.choice(_NAMES)
    listed = ", ".join(str(x) for x in nums)
    question = {"largest": "Which of these numbers is the largest?",
                "smallest": "Which of these numbers is the smallest?",
                "even": "How many of these numbers are even?"}[op]
    user = f"{who} writes down {n} numbers: {listed}. {question} Return your final response within \\boxed{{}}."
    lines = [f"There are {n} numbers, so I will check them one at a time and count down from {n}."]
    acc = 0
    for i, x in enumerate(nums):
        left = n - i
        if op in ("largest", "smallest"):
            word = "bigger" if op == "largest" else "smaller"
            if i == 0:
                acc = x
                lines.append(f"{left} to go: the first number is {x}, so the {op} so far is {x}.")
            elif (x > acc) if op == "largest" else (x < acc):
                lines.append(f"{left} to go: the next number is {x}. It is {word} than {acc}, "
                             f"so the {op} so far is now {x}.")
                acc = x
            else:
                lines.append(f"{left} to go: the next number is {x}. It is not {word} than {acc}, "
                             f"so the {op} so far stays {acc}.")
        elif x % 2 == 0:
            acc += 1
            lines.append(f"{left} to go: the next number is {x}. It is even, "
                         f"so the count of even numbers is now {acc}.")
        else:
            lines.append(f"{left} to go: the next number is {x}. It is odd, so the count of even numbers stays {acc}.")
    result = {"largest": f"the largest number is {acc}", "smallest": f"the smallest number is {acc}",
              "even": f"{acc} of the numbers are even"}[op]
    lines.append(DONE_LINE)
    content = f"I checked all {n} numbers: {result}.\n\n$\\boxed{{{acc}}}$"
    return DemoSample(kind="math", messages=[{"role": "user", "content": user}], tools=None,
                      reasoning="\n".join(lines), content=content, tool_calls=None,
                      features={"n_items": n, "op": op, "answer": acc})


# ----------------------------------------------------------------------------------------------------- reasoning

def _reasoning_sample(rng: random.Random) -> DemoSample:
    m = rng.randint(4, 6)
    people = rng.sample(_NAMES, m)
    order = people[:]
    rng.shuffle(order)
    pos = {p: i for i, p in enumerate(order)}
    k = rng.randint(8, 14)
    clues: list[tuple[str, str]] = []  # (clue text, what it means)
    for _ in range(k):
        a, b = rng.sample(people, 2)
        kind = rng.choice(["left", "apart"])
        if kind == "left":
            if pos[a] > pos[b]:
                a, b = b, a
            clues.append((f"{a} sits left of {b}", f"{a} comes before {b}"))
        elif abs(pos[a] - pos[b]) == 1:
            clues.append((f"{a} sits next to {b}", f"{a} and {b} are neighbors"))
        else:
            gap = abs(pos[a] - pos[b]) - 1
            between = "is 1 person" if gap == 1 else f"are {gap} people"
            clues.append((f"there {between} between {a} and {b}", f"{a} and {b} are {gap + 1} seats apart"))
    seat = rng.randint(1, m)
    target = order[seat - 1]
    clue_text = "\n".join(f"Clue {i + 1}: {c}." for i, (c, _) in enumerate(clues))
    user = (f"{m} friends sit in a row of {m} seats: {', '.join(people)}. Here are {k} clues.\n{clue_text}\n"
            f"Who sits in seat {seat}?")
    lines = [f"There are {k} clues, so I will check them one at a time and count down from {k}."]
    for i, (c, meaning) in enumerate(clues):
        lines.append(f"{k - i} to go: Clue {i + 1}: {c}, so {meaning}.")
    lines.append(DONE_LINE)
    content = f"{target} sits in seat {seat}."
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.85:
        messages.append({"role": "system", "content": THOUGHTS_SYSTEM})
    messages.append({"role": "user", "content": user})
    return DemoSample(kind="reasoning", messages=messages, tools=None, reasoning="\n".join(lines), content=content,
                      tool_calls=None, features={"n_items": k, "answer": target, "order": order})


_MAKERS = {"tool": _tool_sample, "code": _code_sample, "math": _math_sample, "reasoning": _reasoning_sample,
           "tool_result": _tool_result_sample, "follow_up": _follow_up_sample}


def generate_samples(kind: str, n: int, seed: int) -> list[DemoSample]:
    """``n`` samples of one kind, deterministic for ``(kind, seed)``.

    Raises:
        ValueError: ``kind`` is not one of :data:`ALL_KINDS`.
    """
    if kind not in _MAKERS:
        raise ValueError(f"unknown demo kind {kind!r}; use one of {ALL_KINDS}")
    # A string seed is hashed by random.Random with sha512, stable across processes (unlike hash()).
    rng = random.Random(f"eagle-assets-demo/{_STREAM}/{kind}/{seed}")
    return [_MAKERS[kind](rng) for _ in range(n)]


def generate_mixture(counts: int | dict[str, int], seed: int) -> list[DemoSample]:
    """Samples of every kind of :data:`ALL_KINDS` (``counts`` per kind, or one count for all), interleaved in a
    seeded random order."""
    per_kind = counts if isinstance(counts, dict) else {kind: counts for kind in ALL_KINDS}
    out = [s for kind in ALL_KINDS for s in generate_samples(kind, per_kind.get(kind, 0), seed)]
    random.Random(f"eagle-assets-demo/mix/{seed}").shuffle(out)
    return out
