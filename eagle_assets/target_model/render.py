"""Rendering a prompt exactly once into the token ids sent to SGLang's ``/generate`` (``input_ids``).

The training row is later ``prompt_ids + output_ids``; nothing is ever re-rendered or re-tokenized, because
re-rendering changes or drops reasoning in many chat templates (Qwen3 strips ``<think>`` of earlier turns,
DeepSeek-V3 cuts content before ``</think>``). Rendering follows transformers' chat-template contract:
``apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=False)`` then
``tokenizer(text, add_special_tokens=False)`` -- the template already writes BOS where the model wants it, and
letting the tokenizer add another one is the classic double-BOS bug.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from eagle_assets.target_model.generation_suffix import ConstantSuffix, constant_suffix
from eagle_assets.target_model.profile import FamilyProfile
from eagle_assets.target_model.template_sandbox import tune_sandbox

# Render failure reasons (stable strings; the tokenized_prompts asset counts them like rejects).
TOOLS_IGNORED = "tools_ignored"
DOUBLE_BOS = "double_bos"
CONTROL_TOKEN_IN_TEXT = "control_token_in_text"
PROMPT_TOO_LONG = "prompt_too_long"
TEMPLATE_ERROR = "template_error"
MISSING_GENERATION_PROMPT = "missing_generation_prompt"
RENDER_REASONS: tuple[str, ...] = (
    TOOLS_IGNORED,
    DOUBLE_BOS,
    CONTROL_TOKEN_IN_TEXT,
    PROMPT_TOO_LONG,
    TEMPLATE_ERROR,
    MISSING_GENERATION_PROMPT,
)


class RenderError(Exception):
    """A prompt that must not be sent: ``reason`` in RENDER_REASONS, ``detail`` says what was found."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt.

    Attributes:
        prompt_ids: token ids (Python ints; store as int32) ending with the template's generation prompt.
        n_prompt_tokens: len(prompt_ids).
        template_hash: first 16 hex chars of sha256 of the chat template source (lineage: a template change
            changes every prompt).
        flags: ``bos`` (prompt starts with the BOS id), ``has_tools``, ``enable_thinking`` (as passed),
            ``ends_with_think_start`` (the generation prompt opens a reasoning block, so the output must close
            it; decided by ``opens_think_block``, also when a newline or text follows the think-start),
            ``ids_after_think_start`` (the prompt ids after that think-start, e.g. DeepSeek-R1's ``\n``; None
            when no block is open), ``tool_arguments_as_string`` (the template needed JSON-string arguments),
            ``generation_prompt`` (the text the generation prompt added; "" for a prompt that ends with tool
            results under ``answers_after_tool_outputs``), ``generation_prompt_tokens`` (how many ids it added, 0
            there; None when its ids cannot be delimited, and the whole prompt is judged instead).
        text: the rendered prompt text.
    """

    prompt_ids: list[int]
    n_prompt_tokens: int
    template_hash: str
    flags: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    @property
    def opens_think(self) -> bool:
        """The output must close a reasoning block the prompt opened (``tokenized_prompts.prompt_opens_think``)."""
        return bool(self.flags.get("ends_with_think_start"))


def template_hash(tokenizer: Any) -> str:
    """First 16 hex chars of sha256 of the tokenizer's chat template (a dict of named templates is hashed as
    canonical JSON); raises RenderError(template_error) when there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise RenderError(TEMPLATE_ERROR, "the tokenizer has no chat_template; use a model dir whose "
                          "tokenizer_config.json (or chat_template.jinja) defines one")
    source = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def special_token_strings(tokenizer: Any) -> list[str]:
    """Every added/special token text the tokenizer matches atomically inside plain text, longest first."""
    tokens = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    tokens.update(str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values())
    return sorted((t for t in tokens if len(t) > 1), key=len, reverse=True)


def _check_control_tokens(tokenizer: Any, messages: list[dict[str, Any]], specials: list[str] | None = None) -> None:
    if specials is None:
        specials = special_token_strings(tokenizer)
    for i, msg in enumerate(messages):
        if msg.get("role") not in ("user", "tool", "system"):
            continue
        text = msg.get("content")
        if not isinstance(text, str):
            continue
        found = [(text.find(tok), -len(tok), tok) for tok in specials if tok in text]
        if found:
            pos, _, tok = min(found)
            raise RenderError(
                CONTROL_TOKEN_IN_TEXT,
                f"message {i} ({msg['role']}) contains the control token {tok!r} at char {pos}; it would be "
                f"tokenized as the control id and corrupt the turn structure (drop or escape the record)",
            )


def _stringify_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for msg in out:
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {})
            if not isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
    return out


def _apply(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, gen: bool, kwargs: dict[str, Any]) -> str:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs)
    if not isinstance(text, str):
        raise RenderError(TEMPLATE_ERROR, f"apply_chat_template returned {type(text).__name__}, expected text")
    return text


def opens_think_block(ids: Sequence[int], profile: FamilyProfile | None) -> bool:
    """THE rule for "this prompt opens a reasoning block that the output must close" (one source of truth).

    True when ``ids`` hold the profile's think-start and no think-end after its last occurrence. ``ids`` is the
    generation prompt's ids (what ``add_generation_prompt=True`` appended; ``render_prompt`` passes exactly those)
    or, lacking that, the whole prompt. Whatever follows the think-start does not matter: Qwen3-style
    ``<|im_start|>assistant\n<think>``, Kimi-K2.5 ``<|im_middle|><think>``, DeepSeek-R1 ``<｜Assistant｜><think>\n``
    and a template that pre-fills text after ``<think>`` all open the block; Qwen3 ``enable_thinking=False``
    (``<think>\n\n</think>\n\n``) and Kimi-K2.5 thinking off (``<think></think>``) close it again, and a
    template without think tokens (Qwen3 default, DeepSeek-V3, Kimi-K2-Thinking) opens none.

    Args: ``ids`` (ints); ``profile`` (None or no think markers = never open).
    """
    if profile is None or profile.think_start_id is None:
        return False
    start, end = profile.think_start_id, profile.think_end_id
    for tid in reversed(ids):
        if tid == end:
            return False
        if tid == start:
            return True
    return False


# The assistant answer rendered after the tool results to check where the template puts it (any text the template
# writes verbatim would do; this one cannot be mistaken for template text).
_PROBE_ANSWER = "eagle-assets probe answer 7f3c"


def answers_after_tool_outputs(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, text: str,
                               kwargs: dict[str, Any], profile: FamilyProfile | None) -> bool:
    """THE rule for "a prompt without a generation prompt is still what the server sends" (one source of truth).

    True only when all hold: the profile's ``answer_after_tool_outputs`` is on (DeepSeek-V3/R1, see
    ``FamilyProfile``); the conversation ends with a ``tool`` message; and the template, given an assistant answer
    after those tool results, renders exactly ``text`` followed by the answer (``...<｜tool▁outputs▁end｜>`` +
    answer for DeepSeek). The prompt then ends where the template's own next assistant message begins, which is the
    text SGLang serves for ``add_generation_prompt=True`` (``serving_chat._apply_jinja_template`` renders and
    encodes the template's text, adding nothing), so the model answers right after the tool results.

    Args: ``text`` the render with ``add_generation_prompt=True`` (equal to the one without); ``kwargs`` the
    template kwargs of that render (``enable_thinking``). A template that fails on the probe answer: False.
    """
    if profile is None or not profile.answer_after_tool_outputs:
        return False
    if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "tool":
        return False
    try:
        probe = _apply(tokenizer, [*messages, {"role": "assistant", "content": _PROBE_ANSWER}], tools, False, kwargs)
    except Exception:  # the template cannot render an answer there: no evidence, the prompt stays refused
        return False
    return probe.startswith(text + _PROBE_ANSWER)


def control_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's special and added tokens (chat-template structure: ``<|im_start|>``,
    ``<｜Assistant｜>``, ``<|im_middle|>``, think and tool-call markers, stop ids), as matched atomically in text.

    These are the ids a completion can never legitimately begin by repeating from the prompt's tail, which is the
    evidence ``serving.protocol.prompt_echo_length`` needs to call an echo an echo when the counts agree.
    """
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if isinstance(i, int)}
    ids.update(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
    return frozenset(ids)


def _generation_prompt_ids(tokenizer: Any, ids: list[int], generation_prompt: str,
                           cache: dict[str, list[int]] | None = None) -> list[int] | None:
    """The prompt's last ids that the generation prompt wrote, or None when they cannot be told apart (special
    tokens are atomic, so the ids of the generation-prompt text alone end the prompt the same way)."""
    if not generation_prompt:
        return None
    tail = None if cache is None else cache.get(generation_prompt)
    if tail is None:
        tail = list(tokenizer(generation_prompt, add_special_tokens=False)["input_ids"])
        if cache is not None:
            cache[generation_prompt] = tail
    return tail if tail and ids[-len(tail):] == tail else None


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    max_prompt_tokens: int | None = None,
    profile: FamilyProfile | None = None,
) -> RenderedPrompt:
    """Render prompt messages (ending with a user turn) to the prompt ids of one generation request.

    Args:
        tokenizer: the target's transformers tokenizer (with a chat template).
        messages: OpenAI-style messages (eagle_assets.formats conventions); tool-call arguments as dicts.
        tools: OpenAI tool schemas or None.
        enable_thinking: passed to the template only when not None (Qwen3's switch; other templates ignore it).
        max_prompt_tokens: reject longer prompts (None = no limit).
        profile: the family profile, for the ``ends_with_think_start`` flag (``opens_think_block``).
    Returns:
        RenderedPrompt.
    Raises:
        RenderError: ``template_error`` (no template, or it raised), ``missing_generation_prompt`` (the template
        adds nothing for add_generation_prompt=True, unless ``answers_after_tool_outputs``: then the prompt is
        accepted with an empty generation prompt), ``tools_ignored`` (rendering with tools equals rendering
        without: the model would never see them), ``control_token_in_text`` (a special-token string inside
        user/tool/system content), ``double_bos``, ``prompt_too_long``.
    """
    t_hash = template_hash(tokenizer)
    tune_sandbox(tokenizer)
    texts = _render_texts(tokenizer, messages, tools, enable_thinking, profile=profile)
    ids = list(tokenizer(texts[0], add_special_tokens=False)["input_ids"])
    return _finish(tokenizer, ids, texts, enable_thinking, max_prompt_tokens, profile, t_hash, {})


def render_prompts(
    tokenizer: Any,
    records: Sequence[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]],
    enable_thinking: bool | None = None,
    max_prompt_tokens: int | None = None,
    profile: FamilyProfile | None = None,
) -> list[RenderedPrompt | RenderError]:
    """``render_prompt`` over a batch of ``(messages, tools)``: one result per record, in order, each a
    ``RenderedPrompt`` or the ``RenderError`` that record raised (a bad record costs only itself).

    The same checks and flags as ``render_prompt`` (``_finish`` for every record), with the per-call costs paid
    once per batch: records are rendered by ``render_texts_batch`` (transformers' batched
    ``apply_chat_template``: one call per distinct tools list and ``add_generation_prompt`` value, each record
    rendered by the same compiled template as one call would), the prompt texts are tokenized in one call (the fast
    tokenizer's batch encode, parallel in Rust) and the ids of each distinct generation-prompt text are computed
    once. The ids, flags and errors equal ``render_prompt``'s exactly (tests compare them on every family and
    layout). ``render_prompts = finish_rendered(render_texts_batch(...))``; a pipeline calls the halves apart.
    """
    return finish_rendered(tokenizer, render_texts_batch(tokenizer, records, enable_thinking, profile), enable_thinking,
                           max_prompt_tokens, profile)


def finish_rendered(tokenizer: Any, rendered: list[Any], enable_thinking: bool | None = None,
                    max_prompt_tokens: int | None = None, profile: FamilyProfile | None = None
                    ) -> list[RenderedPrompt | RenderError]:
    """The second half of ``render_prompts``: ``rendered`` (``render_texts_batch``'s list) tokenized in one batch
    encode (``encode_texts``, which releases the GIL while it runs, so a pipeline can render the next batch
    meanwhile) and checked by ``_finish``; returns one ``RenderedPrompt`` or ``RenderError`` per record."""
    try:
        t_hash = template_hash(tokenizer)
    except RenderError as exc:  # no chat template: every record fails the same way
        return [exc] * len(rendered)
    out = list(rendered)
    pending = [i for i, r in enumerate(out) if not isinstance(r, RenderError)]
    if pending:
        encoded = encode_texts(tokenizer, [out[i][0] for i in pending])
        cache: dict[str, list[int]] = {}
        for i, ids in zip(pending, encoded):
            try:
                out[i] = _finish(tokenizer, ids, out[i], enable_thinking, max_prompt_tokens, profile, t_hash, cache)
            except RenderError as exc:
                out[i] = exc
    return out


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=False)["input_ids"]`` (lists of Python ints), through the Rust
    tokenizer's ``encode_batch_fast`` (the same ids, without the character offsets and the ``BatchEncoding``
    conversion, ~25% of the encode's time) when the tokenizer is a fast one whose backend neither truncates nor pads
    (transformers' call turns both off for these arguments; with them set, the transformers call is used)."""
    core = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    fast = getattr(core, "encode_batch_fast", None)
    if fast is None or core.truncation is not None or core.padding is not None:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [enc.ids for enc in fast(texts, add_special_tokens=False)]


def _batchable(messages: Any) -> bool:
    """A record the batched call renders exactly as a single call would: a non-empty list of dicts without tool
    calls (those may need ``_render_texts``' JSON-string retry; an empty or malformed list fails differently when
    batched)."""
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and not m.get("tool_calls") for m in messages))


def render_texts_batch(tokenizer: Any, records: Sequence[tuple[list[dict[str, Any]], Any]],
                       enable_thinking: bool | None = None, profile: FamilyProfile | None = None
                       ) -> list[tuple[str, str, Any, bool] | RenderError]:
    """``_render_texts`` of every record (its result or its RenderError, in order), rendering plain records through
    batched ``apply_chat_template`` calls (a list of conversations renders each with the same compiled template,
    special-token variables and kwargs as one call; ``transformers.utils.chat_template_utils.render_jinja_template``).

    Records ``_batchable`` rejects go through ``_render_texts`` one by one (the tool-argument retry); a group whose
    batched call raised is split in halves down to the failing records (``_render_group``), so each keeps its own
    error message. ``profile``: for ``answers_after_tool_outputs`` (None: a prompt without a generation prompt is
    refused).
    """
    if not getattr(tokenizer, "chat_template", None):  # finish_rendered reports it for every record
        return [()] * len(records)
    tune_sandbox(tokenizer)
    out: list[Any] = [None] * len(records)
    specials = special_token_strings(tokenizer)
    kwargs: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    suffix = constant_suffix(tokenizer, kwargs)  # None: this template needs the second render
    groups: dict[str, list[int]] = {}  # batchable records by their tools list
    singles: list[int] = []  # records rendered one by one
    for i, (messages, tools) in enumerate(records):
        try:
            _check_control_tokens(tokenizer, messages, specials)
        except RenderError as exc:
            out[i] = exc
            continue
        except Exception:  # malformed messages: the one-record path reports them as it always has
            singles.append(i)
            continue
        try:
            key = json.dumps(tools or None, sort_keys=True) if _batchable(messages) else None
        except (TypeError, ValueError):
            key = None
        if key is None:
            singles.append(i)
        else:
            groups.setdefault(key, []).append(i)
    for i in singles:
        out[i] = _render_one(tokenizer, records[i], enable_thinking, specials, suffix, profile)
    for idx in groups.values():
        _render_group(tokenizer, records, idx, records[idx[0]][1] or None, kwargs, enable_thinking, specials, out,
                      suffix, profile)
    return out


def _render_one(tokenizer: Any, record: tuple, enable_thinking: bool | None, specials: list[str],
                suffix: ConstantSuffix | None, profile: FamilyProfile | None = None) -> Any:
    try:
        return _render_texts(tokenizer, *record, enable_thinking, specials, suffix, profile)
    except RenderError as exc:
        return exc


def _render_group(tokenizer: Any, records: Sequence[tuple], idx: list[int], tools: Any, kwargs: dict[str, Any],
                  enable_thinking: bool | None, specials: list[str], out: list[Any],
                  suffix: ConstantSuffix | None, profile: FamilyProfile | None = None) -> None:
    """Render the records ``idx`` (same tools) in batched calls into ``out``; when a call raises (some record's
    template error), each half is retried on its own, down to ``_render_texts`` of the one record, so k bad records
    cost O(k log n) extra renders and each keeps its own error message. ``suffix``: the template's proven
    ``ConstantSuffix`` (the texts without the generation prompt are derived, not rendered), or None."""
    if len(idx) == 1:
        out[idx[0]] = _render_one(tokenizer, records[idx[0]], enable_thinking, specials, suffix, profile)
        return
    convs = [records[i][0] for i in idx]
    try:
        texts = _apply_many(tokenizer, convs, tools, True, kwargs)
        without_gen = [None] * len(idx) if suffix is None else [suffix.derive_plain(t) for t in texts]
        missing = [k for k, plain in enumerate(without_gen) if plain is None]
        if missing:  # every record without a proven suffix; none otherwise
            for k, plain in zip(missing, _apply_many(tokenizer, [convs[k] for k in missing], tools, False, kwargs)):
                without_gen[k] = plain
        without_tools = _apply_many(tokenizer, convs, None, True, kwargs) if tools else [None] * len(idx)
    except Exception:
        half = len(idx) // 2
        _render_group(tokenizer, records, idx[:half], tools, kwargs, enable_thinking, specials, out, suffix, profile)
        _render_group(tokenizer, records, idx[half:], tools, kwargs, enable_thinking, specials, out, suffix, profile)
        return
    for i, text, plain, bare in zip(idx, texts, without_gen, without_tools):
        try:
            after_tools = text == plain and answers_after_tool_outputs(tokenizer, records[i][0], tools, text, kwargs,
                                                                       profile)
            out[i] = _checked_texts(text, plain, bare, tools, False, after_tools)
        except RenderError as exc:
            out[i] = exc


def _apply_many(tokenizer: Any, conversations: list, tools: Any, gen: bool, kwargs: dict[str, Any]) -> list[str]:
    texts = tokenizer.apply_chat_template(conversations, tools=tools, add_generation_prompt=gen, tokenize=False,
                                          **kwargs)
    if not isinstance(texts, list) or len(texts) != len(conversations) or not all(isinstance(t, str) for t in texts):
        raise TypeError("batched apply_chat_template did not return one text per conversation")
    return texts


_UNKNOWN: Any = object()


def _render_texts(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, enable_thinking: bool | None,
                  specials: list[str] | None = None, suffix: ConstantSuffix | None = _UNKNOWN,
                  profile: FamilyProfile | None = None) -> tuple[str, str, Any, bool]:
    """(prompt text, text without the generation prompt, tools, tool arguments as strings) of one record, after
    the text-level checks; raises RenderError. ``specials``: ``special_token_strings(tokenizer)`` when known;
    ``suffix``: ``generation_suffix.constant_suffix`` for these kwargs when known (None: render the text without
    the generation prompt; a ``ConstantSuffix``: derive it from the prompt text, exactly, see that module);
    ``profile``: for ``answers_after_tool_outputs``."""
    _check_control_tokens(tokenizer, messages, specials)
    kwargs: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if suffix is _UNKNOWN:
        suffix = constant_suffix(tokenizer, kwargs)
    tools = tools or None
    args_as_string = False
    try:
        try:
            text = _apply(tokenizer, messages, tools, True, kwargs)
        except (TypeError, ValueError) as first:
            # Some templates (DeepSeek-V3) concatenate arguments as text; retry with JSON-string arguments.
            if not any(m.get("tool_calls") for m in messages):
                raise first
            messages = _stringify_arguments(messages)
            args_as_string = True
            text = _apply(tokenizer, messages, tools, True, kwargs)
        without_gen = None if suffix is None else suffix.derive_plain(text)
        if without_gen is None:
            without_gen = _apply(tokenizer, messages, tools, False, kwargs)
        without_tools = _apply(tokenizer, messages, None, True, kwargs) if tools else None
    except RenderError:
        raise
    except Exception as e:  # jinja2 TemplateError, TypeError, KeyError from template code: all template problems
        raise RenderError(TEMPLATE_ERROR, f"chat template failed: {type(e).__name__}: {e}") from None
    after_tools = text == without_gen and answers_after_tool_outputs(tokenizer, messages, tools, text, kwargs, profile)
    return _checked_texts(text, without_gen, without_tools, tools, args_as_string, after_tools)


def _checked_texts(text: str, without_gen: str, without_tools: str | None, tools: Any, args_as_string: bool,
                   after_tool_outputs: bool = False) -> tuple[str, str, Any, bool]:
    """The text-level verdicts on one record's three renders (``_render_texts``' result); raises RenderError.
    ``after_tool_outputs``: ``answers_after_tool_outputs`` held, so an empty generation prompt is the served one."""
    if text == without_gen and not after_tool_outputs:
        raise RenderError(MISSING_GENERATION_PROMPT, "add_generation_prompt=True does not append an assistant header; "
                          "the model would continue the user turn")
    if tools and without_tools == text:
        names = [t.get("function", {}).get("name") for t in tools]
        raise RenderError(TOOLS_IGNORED, "the chat template renders the same text with and without tools "
                          f"{names[:5]}; the target would never see the tool definitions")

    return text, without_gen, tools, args_as_string


def _finish(tokenizer: Any, ids: list[int], texts: tuple[str, str, Any, bool], enable_thinking: bool | None,
            max_prompt_tokens: int | None, profile: FamilyProfile | None, t_hash: str,
            gen_cache: dict[str, list[int]]) -> RenderedPrompt:
    """The id-level checks and flags of one rendered record (``texts`` from ``_render_texts``); raises
    RenderError. ``gen_cache``: generation-prompt text -> its ids, filled as it goes."""
    text, without_gen, tools, args_as_string = texts
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        raise RenderError(DOUBLE_BOS, f"the prompt starts with two BOS ids ({bos}); the template already writes BOS, "
                          "so the text must not contain another one")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise RenderError(PROMPT_TOO_LONG, f"{len(ids)} prompt tokens > max_prompt_tokens {max_prompt_tokens}")
    # the text without the generation prompt is nearly always a prefix: a startswith is O(n) in C, commonprefix
    # a Python loop over characters
    cut = len(without_gen) if text.startswith(without_gen) else len(os.path.commonprefix([text, without_gen]))
    generation_prompt = text[cut:]
    # equal texts reach here only through answers_after_tool_outputs: the generation prompt is empty, its ids none
    gen_ids = [] if text == without_gen else _generation_prompt_ids(tokenizer, ids, generation_prompt, gen_cache)
    scope = ids if gen_ids is None else gen_ids  # the whole prompt only when the tail cannot be delimited
    opens = opens_think_block(scope, profile)
    after_start: list[int] | None = None
    if opens:
        last = len(scope) - 1 - scope[::-1].index(profile.think_start_id)
        after_start = scope[last + 1:]
    flags = {
        "bos": bool(ids) and bos is not None and ids[0] == bos,
        "has_tools": bool(tools),
        "enable_thinking": enable_thinking,
        "ends_with_think_start": opens,
        "ids_after_think_start": after_start,
        "tool_arguments_as_string": args_as_string,
        "generation_prompt": generation_prompt,
        "generation_prompt_tokens": None if gen_ids is None else len(gen_ids),
    }
    return RenderedPrompt(prompt_ids=ids, n_prompt_tokens=len(ids), template_hash=t_hash, flags=flags, text=text)
