"""Types of SGLang's native ``/generate`` protocol, and the validation of a reply before it becomes training data.

Sources (sgl-project/sglang):

- Request body: ``GenerateReqInput`` in ``python/sglang/srt/managers/io_struct.py``: ``input_ids`` (one list of ints
  or a list of them), ``sampling_params`` (a dict, or one per item), ``rid`` (a string, or one per item),
  ``return_hidden_states``, ``return_logprob`` / ``logprob_start_len`` / ``top_logprobs_num``. One prompt's body
  is :class:`GenerateRequest`; its reply :class:`GenerateReply`. Client, embedded server and tests use these two.
- Sampling fields and defaults: ``SamplingParams`` in ``python/sglang/srt/sampling/sampling_params.py``:
  ``max_new_tokens`` defaults to **128** when absent, ``temperature`` 1.0 (values below 1e-6 mean greedy),
  ``top_p`` 1.0, ``top_k`` -1 (whole vocabulary), ``stop_token_ids``, ``skip_special_tokens`` (default True there),
  ``ignore_eos``, ``sampling_seed``. Unknown keys make SGLang reject the request, so ``to_json`` only writes
  SGLang's own names.
- Reply: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "e2e_latency", ...}}`` built by ``TokenizerManager`` (``tokenizer_manager.py``); a list of them
  for a batch request.
- ``finish_reason`` is ``BaseFinishReason.to_json()`` in ``python/sglang/srt/managers/schedule_batch.py``:
  ``FINISH_MATCHED_TOKEN`` -> ``{"type": "stop", "matched": <token id>}``, ``FINISH_MATCHED_STR`` ->
  ``{"type": "stop", "matched": <str>}`` (``"NaN happened"`` when the sampled id was out of range and SGLang
  overwrote it), ``FINISH_LENGTH`` -> ``{"type": "length", "length": max_new_tokens}``, ``FINISH_ABORT`` ->
  ``{"type": "abort", "message", "status_code", "err_type"}`` (an abort arrives as HTTP 200).
  ``Req.check_finished`` tests the length cap before stop ids, so a stop id sampled exactly at the cap reports
  ``length``. ``output_ids`` keep the matched stop id (the detokenizer trims it from ``text`` only).
- Counting convention: ``meta_info.completion_tokens`` is ``len(req.output_ids)`` (``scheduler_output_processor``
  / ``BatchTokenIDOutput``), so it includes the matched stop id; ``prompt_tokens`` is ``len(origin_input_ids)``.
- Known traps this module checks for: a missing ``max_new_tokens`` silently means 128 tokens; some SGLang versions
  return the last few prompt ids (the incremental-detokenization window, ``INIT_INCREMENTAL_DETOKENIZATION_OFFSET =
  5`` in ``schedule_batch.py``) in front of ``output_ids``, and some of them count those ids in
  ``completion_tokens`` too, so the counts cannot be the only evidence (``prompt_echo_length``: also a control id
  among the echoed ids, the cap, or the reply's shape through an injected ``WellFormed`` check, since this layer
  knows no model family).

Every reply is judged, never trusted to be well-behaved: a body that is not JSON, nests deeper than the parsers
recurse (``[[[[...]]]]`` 100k deep), or holds values whose text cannot be shown (ints past Python's 4,300-digit
limit) is one ``ReplyError`` (``bad_json`` for the body, the field's kind for a value), never an exception that fails
the partition. Values quoted in an error are cut by :func:`clip_text` / :func:`show_value`, which end every cut with
``CUT_MARK``: the client redacts its API key after these cuts, and removes a key prefix left before that mark
(``GenerateClient.redact``).

The rules a stored row must also pass (ids in the vocab, the counts, the prompt echo, the cap, the matched stop id)
are implemented once here (``reply_defect``, ``stop_mismatch``) and applied by ``parse_generate_reply`` to every
reply and by ``structure.segment.segment_output`` to every row of a generations shard, whoever wrote it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Sequence

import orjson

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_TEMPERATURE_EPS = 1e-6
FINISH_TYPES = ("stop", "length", "abort")
SGLANG_NAN_MATCHED = "NaN happened"
_INT_ONLY = {int}
# The longest prompt tail compared with the head of output_ids. SGLang echoes at most its detokenization window
# (INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5 ids); the margin covers other versions and proxies.
ECHO_WINDOW = 64
# Without the target's control ids, this many ids repeating the prompt's end are the evidence: the last ids of a
# rendered prompt are the end of the user turn and the assistant header, which no reply begins by repeating.
ECHO_MIN_IDS = 3

# The injected structural check (``WellFormed``): ``well_formed(prompt_ids, output_ids, finish_type, rid)`` is True
# when ``output_ids`` (ints), finished as ``finish_type`` ("stop" / "length"), are a well-formed reply of the target's
# family to the prompt ``prompt_ids`` (request ``rid``, None when unknown); a reply cut at the cap counts as
# well-formed when nothing before the cut breaks a rule. The serving layer knows no family: the generation stage
# builds it from the family profile and QC's segmentation (``structure.segment.StructureCheck``).
WellFormed = Callable[[Sequence[int], Sequence[int], str, "str | None"], bool]

# SGLang sampling keys this project does not use; a request may carry them only at SGLang's default values.
_IGNORABLE_AT_DEFAULT: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "min_p": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_new_tokens": (0, None),
    "stop": (None, "", ()),
    "stop_regex": (None, "", ()),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "custom_params": (None,),
    "logit_bias": (None,),
    "stream_interval": (None,),
    "no_stop_trim": (False, None),
    "spaces_between_special_tokens": (True, None),
}


# What ends a text cut short by ``clip_text``. The client's ``redact`` removes a prefix of its API key found right
# before it: a reply quoting the key may be cut inside it here, where the key is unknown.
CUT_MARK = "..."


def clip_text(text: str, limit: int) -> str:
    """``text`` unchanged when it has at most ``limit`` characters, else its first ``limit`` characters and
    ``CUT_MARK`` (so a reader, and ``GenerateClient.redact``, can tell the cut)."""
    return text if len(text) <= limit else text[:limit] + CUT_MARK


def show_value(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut by :func:`clip_text` to ``limit`` characters; never raises.

    A reply's values are shown in error messages, and ``repr`` itself fails on some of them: a list nested deeper
    than the interpreter's recursion limit (orjson accepts 1,024 levels, ``repr`` stops near 1,000) raises
    ``RecursionError``, an int past 4,300 digits ``ValueError``. Those are described instead of shown.
    """
    try:
        text = repr(value)
    except RecursionError:
        return f"<a {type(value).__name__} nested too deeply to show>"
    except ValueError:
        return f"<a {type(value).__name__} too large to show>"
    return clip_text(text, limit)


def _shown_text(value: Any, limit: int) -> str:
    """A reply's text field as ``str()`` would show it (no quotes for a string), cut; never raises."""
    return clip_text(value, limit) if isinstance(value, str) else show_value(value, limit)


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    # bools compare by identity so that True does not pass for a default of 1
    if isinstance(value, list):
        value = tuple(value)
    for d in defaults:
        if value is d or (type(value) is not bool and type(d) is not bool and value == d):
            return True
    return False


class ReplyError(Exception):
    """A ``/generate`` reply that must not become a training row.

    Attributes:
        kind: short machine-readable reason: ``bad_json``, ``not_object``, ``server_error``, ``missing_field``,
            ``bad_type``, ``id_out_of_vocab``, ``length_mismatch``, ``prompt_echo``, ``prompt_tokens_mismatch``,
            ``rid_mismatch``, ``unknown_finish_reason``, ``stop_mismatch``, ``too_long``, ``nan_output``, ``abort``.
        detail: what was wrong and what to do about it.
        retryable: whether sending the same request again may succeed. Every kind is retryable (a misbehaving
            server or proxy may answer correctly next time, and attempts are bounded) except an ``abort`` that
            carries a 4xx ``status_code``, which SGLang uses for requests it will always refuse.
    """

    def __init__(self, kind: str, detail: str, retryable: bool = True):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.retryable = retryable


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one ``/generate`` request (SGLang ``SamplingParams`` names and defaults).

    Attributes:
        max_new_tokens: cap on generated tokens (>= 1). REQUIRED here: SGLang silently uses 128 when the field is
            absent, which truncates reasoning chains without any error; constructing without it raises ValueError.
        temperature: >= 0; below 1e-6 means greedy (argmax), as in SGLang.
        top_p: nucleus mass in (0, 1].
        top_k: -1 (whole vocabulary) or >= 1.
        stop_token_ids: extra ids that end generation, on top of the model's EOS ids. The matched id stays in
            ``output_ids``.
        skip_special_tokens: affects only the reply's ``text`` (SGLang default True; False here so special tokens
            such as ``<think>`` stay visible).
        seed: per-request sampling seed, sent as SGLang's ``sampling_seed``; None = server's randomness.
        ignore_eos: do not stop at EOS or ``stop_token_ids`` (SGLang ignores both when set).

    Raises:
        ValueError: missing or non-positive ``max_new_tokens``, or any value outside the ranges above.
    """

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = False
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            raise ValueError(
                "SamplingParams.max_new_tokens is required: SGLang silently caps a request without it at "
                f"{SGLANG_DEFAULT_MAX_NEW_TOKENS} tokens, which truncates long answers without any error. "
                "Set it explicitly (e.g. the partition's sampling.max_new_tokens in the catalog)."
            )
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        temp = self.temperature
        if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temp!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (whole vocabulary) or an int >= 1, got {self.top_k!r}")
        stops = self.stop_token_ids
        if stops is None:
            stops = ()
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {stops!r}")
        stops = tuple(stops)
        for t in stops:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r} in {list(stops)}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "temperature", float(temp))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        """True when SGLang would decode greedily (temperature < 1e-6 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def to_json(self) -> dict[str, Any]:
        """The ``sampling_params`` dict in SGLang's field names (``seed`` is sent as ``sampling_seed``)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "skip_special_tokens": self.skip_special_tokens,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out

    @classmethod
    def from_json(cls, obj: Any, *, default_max_new_tokens: int | None = None) -> "SamplingParams":
        """Parse a request's ``sampling_params`` dict (SGLang names; ``seed`` accepted for ``sampling_seed``).

        Args:
            obj: the dict (None = empty).
            default_max_new_tokens: used when ``max_new_tokens`` is absent; a server imitating SGLang passes 128.
                None (default) makes an absent value an error.
        Raises:
            ValueError: not a dict, unknown keys, a feature this project does not implement used at a non-default
                value (penalties, min_p, grammars, stop strings, n > 1), or invalid values.
        """
        if obj is None:
            obj = {}
        if not isinstance(obj, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {type(obj).__name__}")
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "skip_special_tokens",
                 "sampling_seed", "seed", "ignore_eos"}
        unknown = sorted(k for k in obj if k not in known and k not in _IGNORABLE_AT_DEFAULT)
        if unknown:
            raise ValueError(f"unknown sampling_params keys {unknown}; supported: {sorted(known)}")
        unsupported = sorted(
            k for k, defaults in _IGNORABLE_AT_DEFAULT.items() if k in obj and not _is_default(obj[k], defaults)
        )
        if unsupported:
            raise ValueError(
                f"sampling_params {unsupported} are not supported by this server at non-default values "
                f"(got {({k: obj[k] for k in unsupported})}); use stop_token_ids instead of stop strings and "
                "serve with SGLang for penalties or grammars"
            )
        max_new = obj.get("max_new_tokens", None)
        if max_new is None:
            max_new = default_max_new_tokens
        seed = obj.get("sampling_seed", obj.get("seed"))
        top_k = obj.get("top_k", -1)
        temperature = obj.get("temperature", 1.0)
        top_p = obj.get("top_p", 1.0)
        return cls(
            max_new_tokens=max_new,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=-1 if top_k is None else top_k,
            stop_token_ids=tuple(obj.get("stop_token_ids") or ()),
            skip_special_tokens=bool(obj.get("skip_special_tokens", True)),
            seed=seed,
            ignore_eos=bool(obj.get("ignore_eos", False)),
        )


@dataclass(frozen=True)
class FinishReason:
    """``meta_info.finish_reason`` of a reply (``schedule_batch.py`` ``FINISH_*`` classes, ``to_json``).

    Attributes:
        type: ``"stop"``, ``"length"`` or ``"abort"``.
        matched: for ``stop``: the matched stop token id (int), or a stop string (str).
        length: for ``length``: the cap that was hit (SGLang reports ``max_new_tokens``).
        message: for ``abort``: SGLang's message.
        status_code: for ``abort``: the HTTP-like status SGLang attached (400 = the request itself is invalid).
        err_type: for ``abort``: SGLang's error class name (``BadRequestError``, ``InternalServerError``).
    """

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    @classmethod
    def from_json(cls, obj: Any) -> "FinishReason":
        """Parse the ``finish_reason`` dict. Raises ``ReplyError`` (``unknown_finish_reason``) for anything else."""
        if not isinstance(obj, dict):
            raise ReplyError(
                "unknown_finish_reason",
                f"meta_info.finish_reason must be an object with a 'type', got {show_value(obj)} "
                "(None means the request had not finished: a streaming chunk, or a server bug)",
            )
        ftype = obj.get("type")
        if ftype not in FINISH_TYPES:
            raise ReplyError("unknown_finish_reason",
                             f"finish_reason.type {show_value(ftype)} is not one of {FINISH_TYPES}")
        matched = obj.get("matched")
        if isinstance(matched, list) and len(matched) == 1:
            matched = matched[0]
        if matched is not None and (isinstance(matched, bool) or not isinstance(matched, (int, str))):
            raise ReplyError("unknown_finish_reason",
                             f"finish_reason.matched must be an int or str, got {show_value(matched)}")
        length = obj.get("length")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
            raise ReplyError("unknown_finish_reason", f"finish_reason.length must be an int, got {show_value(length)}")
        status = obj.get("status_code")
        message = obj.get("message")
        return cls(
            type=ftype,
            matched=matched,
            length=length,
            # str() of a deeply nested value raises RecursionError: a non-string message is shown, cut
            message=None if message is None else message if isinstance(message, str) else show_value(message, 500),
            status_code=status if isinstance(status, int) and not isinstance(status, bool) else None,
            err_type=obj.get("err_type") if isinstance(obj.get("err_type"), str) else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The SGLang dict form (only the fields of this ``type``)."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": self.type, "message": self.message, "status_code": self.status_code,
                "err_type": self.err_type}


@dataclass(frozen=True)
class GenerateRequest:
    """The ``/generate`` body for one prompt (``GenerateReqInput``'s single-item form, SGLang names).

    Attributes:
        input_ids: the prompt's token ids (ints of the target vocab), as ``apply_chat_template`` gave them.
        sampling_params: :class:`SamplingParams` (``max_new_tokens`` always set).
        rid: request id, echoed as ``meta_info.id``; None lets the server choose one.
        return_hidden_states: ``True`` (every position's state), ``"last"`` (the last one) or ``False``.
        return_logprob, logprob_start_len, top_logprobs_num: SGLang's logprob request (-1 = output tokens only).
    """

    input_ids: Sequence[int]
    sampling_params: SamplingParams
    rid: str | None = None
    return_hidden_states: bool | str = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0

    def to_json(self) -> dict[str, Any]:
        """The body as a dict: ``input_ids``, ``sampling_params`` and ``rid``, and the other fields when they are
        not SGLang's defaults."""
        ids = self.input_ids
        # the client hands over plain-int lists it has already checked: pass them through (a check in C), so the
        # per-request cost stays that of the encoding
        if type(ids) is not list or not set(map(type, ids)) <= _INT_ONLY:
            ids = [int(t) for t in ids]
        out: dict[str, Any] = {"input_ids": ids, "sampling_params": self.sampling_params.to_json()}
        if self.rid is not None:
            out["rid"] = self.rid
        if self.return_hidden_states:
            out["return_hidden_states"] = self.return_hidden_states
        if self.return_logprob:
            out.update(return_logprob=True, logprob_start_len=self.logprob_start_len,
                       top_logprobs_num=self.top_logprobs_num)
        return out

    def to_bytes(self, sampling_json: bytes | None = None) -> bytes:
        """The body as compact JSON bytes. ``sampling_json``: ``sampling_params`` already encoded (a client sends
        thousands of requests with one :class:`SamplingParams`, and encodes it once)."""
        body = self.to_json()
        if sampling_json is not None:
            body["sampling_params"] = orjson.Fragment(sampling_json)
        try:
            return orjson.dumps(body)
        except TypeError:  # ints past 64 bits (no vocab check upstream): json writes them, the server refuses them
            return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, default_max_new_tokens: int | None = None) -> "GenerateRequest":
        """One single-item body (``input_ids`` a flat list). Raises ``ValueError`` naming the field that is wrong."""
        ids = obj.get("input_ids")
        if not isinstance(ids, list) or not ids or not set(map(type, ids)) <= _INT_ONLY:
            raise ValueError(f"input_ids must be a non-empty list of ints, got {show_value(ids, 80)}")
        rid = obj.get("rid")
        return cls(input_ids=ids, rid=None if rid is None else str(rid),
                   sampling_params=SamplingParams.from_json(obj.get("sampling_params"),
                                                            default_max_new_tokens=default_max_new_tokens),
                   return_hidden_states=obj.get("return_hidden_states", False),
                   return_logprob=bool(obj.get("return_logprob", False)),
                   logprob_start_len=obj.get("logprob_start_len", -1), top_logprobs_num=obj.get("top_logprobs_num", 0))


@dataclass(slots=True)
class GenerateReply:
    """One validated ``/generate`` result.

    Attributes:
        output_ids: generated token ids (ints of the target vocab), the matched stop id included.
        text: the reply's ``text`` (the detokenized ids, a matched stop id trimmed); not validated.
        finish_reason: parsed ``meta_info.finish_reason`` (never ``abort``: aborts raise ``ReplyError``).
        prompt_tokens: ``meta_info.prompt_tokens`` (== len(prompt ids) when they were given to
            ``parse_generate_reply``).
        completion_tokens: ``meta_info.completion_tokens`` (== len(output_ids)).
        e2e_latency: server-side seconds from arrival to finish (``meta_info.e2e_latency``), None if absent.
        cached_tokens: ``meta_info.cached_tokens`` (prefix-cache hits), None if absent.
        rid: ``meta_info.id``.
        attempts: HTTP attempts the client needed (1 = no retry); set by the client.
        latency_s: client-measured seconds from the first attempt to the validated reply; set by the client.
        server_url: base URL that answered; set by the client.
    """

    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    e2e_latency: float | None = None
    cached_tokens: int | None = None
    rid: str | None = None
    attempts: int = 1
    latency_s: float | None = None
    server_url: str | None = None
    text: str = ""

    def to_json(self, **meta: Any) -> dict[str, Any]:
        """The reply as SGLang writes it: ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
        "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency", **meta}}`` (``meta``: the optional
        fields a request asked for, e.g. ``hidden_states``)."""
        info: dict[str, Any] = {"id": self.rid, "finish_reason": self.finish_reason.to_json(),
                                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                                "cached_tokens": self.cached_tokens or 0, "e2e_latency": self.e2e_latency, **meta}
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": info}


@dataclass(frozen=True)
class GenerateFailure:
    """A request that produced no valid reply after all attempts.

    Attributes:
        rid: the caller's request id.
        kind: ``ReplyError.kind`` of the last attempt, or a transport kind: ``connection``, ``timeout``,
            ``http_429``, ``http_5xx``, ``bad_request`` (HTTP 400/422), ``unauthorized`` (401/403), ``not_found``,
            ``http_<code>``, ``reply_too_large`` (a body over the client's size cap, refused unread or read only up to
            the cap), or ``bad_input`` (rejected by the client before sending).
        attempts: HTTP attempts made (0 for ``bad_input``).
        last_error: the last error message (never contains the API key).
        errors: kind of every failed attempt, in order.
    """

    rid: str
    kind: str
    attempts: int
    last_error: str
    errors: tuple[str, ...] = field(default=())


def _int_field(meta: dict, name: str) -> int:
    value = meta.get(name)
    if value is None:
        raise ReplyError("missing_field", f"meta_info.{name} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReplyError("bad_type", f"meta_info.{name} must be an int >= 0, got {show_value(value)}")
    return value


@dataclass(frozen=True)
class Defect:
    """A rule a reply or a stored row breaks: ``kind`` (a ``ReplyError`` kind and a QC drop reason of the same
    name), ``detail`` (what was found and what to do)."""

    kind: str
    detail: str


def _is_tail(output_ids: Sequence[int], prompt_ids: Sequence[int], k: int) -> bool:
    """``output_ids[:k] == prompt_ids[-k:]`` for a k of 1 or more that both can hold."""
    if not 0 < k <= min(len(prompt_ids), len(output_ids)):
        return False
    return all(output_ids[i] == prompt_ids[len(prompt_ids) - k + i] for i in range(k))


def prompt_echo_length(
    output_ids: Sequence[int],
    prompt_ids: Sequence[int] | None,
    *,
    completion_tokens: int | None = None,
    cap: int | None = None,
    control_ids: Collection[int] | None = None,
    well_formed: Callable[[Sequence[int]], bool] | None = None,
) -> int:
    """How many ids at the head of ``output_ids`` are an echo of the prompt's tail; 0 when there is no evidence.

    An echo is ``output_ids[:k] == prompt_ids[-k:]``. Equal ids alone are no evidence (a reply may begin with a
    newline or a word the prompt ends with), so one of these must hold as well:

    1. counts: ``len(output_ids) - completion_tokens == k`` (the server did not count the echoed ids);
    2. the cap: ``len(output_ids) - cap == k`` (the ids overrun ``max_new_tokens`` by exactly the echo, so the
       server counted them; ``cap`` is the request's ``max_new_tokens``);
    3. structure: the k ids hold a control id (``control_ids``: the target's special and added tokens, e.g.
       ``<|im_start|>``, ``<｜Assistant｜>``, ``<|im_middle|>``, or the ``<think>`` the prompt already wrote). A
       completion follows the generation prompt; it never begins by writing the chat template's structure that
       ends the prompt again. The longest such k (up to ``ECHO_WINDOW``) is the echo. When the caller does not
       know the target's tokens (``control_ids`` None), k >= ``ECHO_MIN_IDS`` is the structural evidence instead.
    4. the reply's shape: ``well_formed(output_ids)`` is False and ``well_formed(output_ids[k:])`` is True: the
       reply is well-formed for its family only without the k ids (e.g. Qwen3's prompt ends ``assistant\n``,
       ordinary ids, and ``output_ids`` = ``assistant\n<think>...</think>...``: only without them does the reasoning
       block open at the first output id, where the prompt expects it). The longest such k is the echo. A reply
       that begins like the prompt's tail and is well-formed as it stands is no echo by this rule.

    Args: ``output_ids`` and ``prompt_ids`` (ints; None prompt = no check), ``completion_tokens`` and ``cap``
    (None = that evidence is unavailable), ``control_ids`` (None = unknown), ``well_formed`` (the family's
    structure check of this reply, bound to its prompt and finish reason, e.g. a ``WellFormed``; None = rule 4 off;
    it is called only when some head repeats the prompt's tail and rules 1-3 found nothing).
    Returns: k (>= 1) or 0. Never raises for well-typed input (``well_formed``'s own errors propagate).
    """
    if not prompt_ids or not output_ids:
        return 0
    n = len(output_ids)
    for total in (completion_tokens, cap):
        if total is not None and _is_tail(output_ids, prompt_ids, n - total):
            return n - total
    first, window = output_ids[0], min(n, len(prompt_ids), ECHO_WINDOW)
    shortest = 1 if control_ids is not None else ECHO_MIN_IDS
    # only the alignments where the prompt id k from the end equals the first output id can match (few, usually 0)
    for k in range(window, shortest - 1, -1):
        if prompt_ids[-k] != first or not _is_tail(output_ids, prompt_ids, k):
            continue
        if control_ids is None or any(t in control_ids for t in output_ids[:k]):
            return k
    if well_formed is not None:
        heads = [k for k in range(window, 0, -1) if prompt_ids[-k] == first and _is_tail(output_ids, prompt_ids, k)]
        if heads and not well_formed(output_ids):
            for k in heads:
                if well_formed(output_ids[k:]):
                    return k
    return 0


def first_out_of_vocab(output_ids: Sequence[int], vocab_size: int | None) -> int | None:
    """Position of the first id outside ``[0, vocab_size)``, None when all are inside (or ``vocab_size`` is None)."""
    if vocab_size is None or not output_ids:
        return None
    if 0 <= min(output_ids) and max(output_ids) < vocab_size:
        return None
    return next(i for i, t in enumerate(output_ids) if t < 0 or t >= vocab_size)


def reply_defect(
    output_ids: Sequence[int],
    *,
    completion_tokens: int | None,
    prompt_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    max_new_tokens: int | None = None,
    control_ids: Collection[int] | None = None,
    well_formed: Callable[[Sequence[int]], bool] | None = None,
) -> Defect | None:
    """The first protocol rule ``output_ids`` break, in this order, or None.

    ``id_out_of_vocab`` (an id outside ``[0, vocab_size)``), ``prompt_echo`` (``prompt_echo_length`` > 0, with
    ``control_ids`` and ``well_formed`` as the evidence it names),
    ``length_mismatch`` (``len(output_ids) != completion_tokens``), ``too_long`` (more ids than
    ``max_new_tokens``). Arguments left None skip their rule (a stored row of an older producer may lack
    ``completion_tokens``). The matched-stop rule is ``stop_mismatch``.
    """
    pos = first_out_of_vocab(output_ids, vocab_size)
    if pos is not None:
        return Defect(
            "id_out_of_vocab",
            f"output_ids[{pos}] = {show_value(output_ids[pos], 40)} is outside the target vocab [0, {vocab_size}); "
            "the server serves a different model or tokenizer than the one the prompts were rendered with",
        )
    n_out = len(output_ids)
    echo = prompt_echo_length(output_ids, prompt_ids, completion_tokens=completion_tokens, cap=max_new_tokens,
                              control_ids=control_ids, well_formed=well_formed)
    if echo:
        counted = "not counted in" if completion_tokens is not None and n_out - completion_tokens == echo else \
            "counted in"
        shape = ""
        if well_formed is not None and not well_formed(output_ids) and well_formed(output_ids[echo:]):
            shape = "; the reply is well-formed for its family only without them"
        return Defect(
            "prompt_echo",
            f"output_ids start with the last {echo} prompt ids {list(output_ids[:echo])} ({n_out} ids, "
            f"completion_tokens={show_value(completion_tokens, 40)}: the echo is {counted} it{shape}); this SGLang "
            "version returns the incremental-detokenization prompt tail in output_ids: upgrade SGLang (the rows "
            "would otherwise duplicate prompt tokens)",
        )
    if completion_tokens is not None and n_out != completion_tokens:
        return Defect(
            "length_mismatch",
            f"len(output_ids)={n_out} but meta_info.completion_tokens={show_value(completion_tokens, 40)}; refusing a "
            "reply whose ids and token count disagree",
        )
    if max_new_tokens is not None and n_out > max_new_tokens:
        return Defect("too_long", f"{n_out} completion tokens exceed max_new_tokens={max_new_tokens}")
    return None


def stop_mismatch(output_ids: Sequence[int], matched: Any) -> bool:
    """True when ``finish_reason.matched`` is a token id that is not the last output id (SGLang keeps the matched
    id in ``output_ids``, so the ids were trimmed or belong to another request). A stop string or None matches."""
    if not isinstance(matched, int) or isinstance(matched, bool):
        return False
    return not output_ids or output_ids[-1] != matched


def parse_generate_reply(
    reply: bytes | str | dict,
    prompt_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    *,
    max_new_tokens: int | None = None,
    rid: str | None = None,
    control_ids: Collection[int] | None = None,
    well_formed: WellFormed | None = None,
) -> GenerateReply:
    """Validate one ``/generate`` reply and return it as a ``GenerateReply``.

    Length: the checks run in one sequence, each raising its own ``ReplyError`` kind, so which defect a reply is
    reported with (the first that applies) is read in one place.

    Args:
        reply: the HTTP body (bytes/str, parsed here) or the already parsed dict of ONE item.
        prompt_ids: the request's ``input_ids``; enables the ``prompt_tokens`` and prompt-echo checks.
        vocab_size: target vocab size; every output id must be in ``[0, vocab_size)``. None skips the check.
        max_new_tokens: the request's cap; more completion tokens than this is ``too_long``.
        rid: the request id sent; a different ``meta_info.id`` is ``rid_mismatch`` (a router mixing replies).
        control_ids: the target's special and added token ids (``target_model.render.control_token_ids``): the
            evidence that finds an echo whose ids are counted in ``completion_tokens`` (``prompt_echo_length``);
            None = unknown, then ``ECHO_MIN_IDS`` ids repeating the prompt's end are the evidence.
        well_formed: the target family's structure check (``WellFormed``, called with ``prompt_ids``, the ids, the
            finish type and ``rid``): an echo whose removal alone makes the reply well-formed is ``prompt_echo``
            even when the counts agree and the echoed ids are ordinary (``prompt_echo_length`` rule 4); None = off.
    Returns:
        the reply, with ``len(output_ids) == completion_tokens`` guaranteed.
    Raises:
        ReplyError: kinds listed on ``ReplyError``; ``reply_defect`` decides ``id_out_of_vocab``, ``prompt_echo``,
            ``length_mismatch`` and ``too_long``, ``stop_mismatch`` decides ``stop_mismatch``. Nothing else escapes
            for any body: one nested past the parsers' depth is ``bad_json``, values that cannot be shown are
            described (``show_value``).
    """
    try:
        return _parse_generate_reply(reply, prompt_ids, vocab_size, max_new_tokens=max_new_tokens, rid=rid,
                                     control_ids=control_ids, well_formed=well_formed)
    except RecursionError:
        # the last guard: a check reached a value nested deeper than the interpreter recurses; the reply is one
        # failure, not an exception that ends the partition
        raise ReplyError("bad_json", "reply nests arrays or objects deeper than any /generate reply") from None


def _parse_generate_reply(
    reply: bytes | str | dict,
    prompt_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    *,
    max_new_tokens: int | None = None,
    rid: str | None = None,
    control_ids: Collection[int] | None = None,
    well_formed: WellFormed | None = None,
) -> GenerateReply:
    """``parse_generate_reply`` without its last guard against ``RecursionError``."""
    if isinstance(reply, (bytes, bytearray, str)):
        try:
            # orjson: ~10x faster than json on a reply of ~1,000 ids (the client's largest cost per request)
            reply = orjson.loads(reply)
        except orjson.JSONDecodeError as first:
            # what orjson refuses and json reads (NaN, ints past 64 bits, lone surrogates) keeps json's outcome
            try:
                reply = json.loads(reply)
            except (ValueError, UnicodeDecodeError) as exc:
                size = len(reply)
                raise ReplyError("bad_json", f"reply body ({size} bytes) is not valid JSON: {exc}") from None
            except RecursionError:
                # orjson stops at 1,024 levels; json recurses once per level and hits the interpreter's limit. No
                # SGLang reply nests more than a few levels: this is a broken or hostile server, one failure
                size = len(reply)
                raise ReplyError("bad_json", f"reply body ({size} bytes) nests arrays or objects deeper than any "
                                             f"/generate reply ({first})") from None
    if not isinstance(reply, dict):
        raise ReplyError("not_object", f"expected one reply object, got {type(reply).__name__}")
    if "error" in reply and "output_ids" not in reply:
        raise ReplyError("server_error", f"server answered with an error object: {_shown_text(reply['error'], 500)}")
    meta = reply.get("meta_info")
    if not isinstance(meta, dict):
        raise ReplyError("missing_field", "reply has no meta_info object")
    finish = FinishReason.from_json(meta.get("finish_reason"))
    if finish.type == "abort":
        refused = finish.status_code is not None and 400 <= finish.status_code < 500
        raise ReplyError(
            "abort",
            f"server aborted the request (status_code={finish.status_code}): {_shown_text(finish.message, 500)}",
            retryable=not refused,
        )
    output_ids = reply.get("output_ids")
    if output_ids is None:
        raise ReplyError(
            "missing_field",
            "reply has no output_ids (an SGLang server returns them for input_ids requests; check the URL is "
            "SGLang's native /generate, not an OpenAI endpoint)",
        )
    if type(output_ids) is not list or not set(map(type, output_ids)) <= _INT_ONLY:
        bad = output_ids if type(output_ids) is not list else next(t for t in output_ids if type(t) is not int)
        raise ReplyError("bad_type", f"output_ids must be a list of ints, found {show_value(bad)}")
    completion = _int_field(meta, "completion_tokens")
    prompt_tokens = _int_field(meta, "prompt_tokens")
    shape = None
    if well_formed is not None and prompt_ids is not None:
        def shape(ids: Sequence[int]) -> bool:
            return well_formed(prompt_ids, ids, finish.type, rid)
    defect = reply_defect(output_ids, completion_tokens=completion, prompt_ids=prompt_ids, vocab_size=vocab_size,
                          max_new_tokens=max_new_tokens, control_ids=control_ids, well_formed=shape)
    if defect is not None:
        raise ReplyError(defect.kind, defect.detail)
    if prompt_ids is not None and prompt_tokens != len(prompt_ids):
        raise ReplyError(
            "prompt_tokens_mismatch",
            f"meta_info.prompt_tokens={prompt_tokens} but the request had {len(prompt_ids)} input_ids; the reply "
            "belongs to another request or the server re-tokenized the prompt",
        )
    server_rid = meta.get("id")
    if server_rid is not None and (isinstance(server_rid, bool) or not isinstance(server_rid, (str, int))):
        # SGLang's id is the rid string; str() of a nested value could not even be taken (RecursionError)
        raise ReplyError("bad_type", f"meta_info.id must be a string, got {show_value(server_rid)}")
    if rid is not None and server_rid is not None and str(server_rid) != rid:
        raise ReplyError("rid_mismatch", f"meta_info.id={show_value(server_rid)} but the request's rid was {rid!r}")
    if finish.type == "stop":
        if finish.matched == SGLANG_NAN_MATCHED:
            raise ReplyError(
                "nan_output",
                "SGLang reported 'NaN happened': the sampled id was out of range and was overwritten; the "
                "target model produced NaN logits",
            )
        if stop_mismatch(output_ids, finish.matched):
            last = output_ids[-1] if output_ids else None
            raise ReplyError(
                "stop_mismatch",
                f"finish_reason matched stop id {show_value(finish.matched, 40)} but the last output id is "
                f"{show_value(last, 40)}; SGLang keeps "
                "the matched id in output_ids, so the ids were trimmed or belong to another request",
            )
    latency = meta.get("e2e_latency")
    cached = meta.get("cached_tokens")
    return GenerateReply(
        output_ids=output_ids,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        e2e_latency=float(latency) if isinstance(latency, (int, float)) and not isinstance(latency, bool) else None,
        cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
        rid=None if server_rid is None else str(server_rid),
        text=reply["text"] if isinstance(reply.get("text"), str) else "",
    )
