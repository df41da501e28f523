"""The ``/generate`` body in and the reply out, as SGLang reads and writes them (shapes from sgl-project/sglang
``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput`` and ``tokenizer_manager.py``'s ``meta_info``):
:meth:`GenerateIO.parse` checks a body and turns it into :class:`GenerateItem` s (or raises :class:`BadRequest`, which
SGLang answers with HTTP 400); :meth:`GenerateIO.reply` builds one reply from an engine result. The HTTP side is
:mod:`eagle_assets.serving.server`."""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from eagle_assets.serving.engine import EngineResult
from eagle_assets.serving.protocol import (
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    FinishReason,
    GenerateReply,
    GenerateRequest,
    SamplingParams,
)

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request SGLang would answer with HTTP 400."""


_HIDDEN_RANK = {None: 0, "last": 1, "full": 2}  # SGLang's CaptureHiddenMode order NULL < LAST < FULL


@dataclass
class GenerateItem:
    """One parsed input of a ``/generate`` body: the typed request (its ``max_new_tokens`` capped to the context
    left) and what the server resolved from it."""

    request: GenerateRequest
    prefill_only: bool = False
    hidden: str | None = None
    logprob_start: int | None = None
    top_logprobs: int = 0
    text_in_logprobs: bool = False

    @property
    def rid(self) -> str:
        return str(self.request.rid)

    @property
    def ids(self) -> list[int]:
        return list(self.request.input_ids)

    @property
    def sp(self) -> SamplingParams:
        return self.request.sampling_params


def _per_item(body: dict, key: str, n: int, default: Any) -> list[Any]:
    value = body.get(key, default)
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"The length of {key} should be equal to the batch size ({len(value)} for {n} inputs).")
        return value
    return [value] * n


def _hidden_mode(value: Any) -> str | None:
    # SGLang's get_return_hidden_states_mode: True -> FULL, "last" -> LAST, False -> NULL, anything else refused
    if value is True:
        return "full"
    if value == "last":
        return "last"
    if value is False or value is None:
        return None
    raise BadRequest("return_hidden_states must be a boolean or the string literal 'last'.")


def _json_rows(t: Any) -> Any:
    """``tensor.tolist()``, with non-finite values as None (JSON has no NaN; SGLang's orjson writes null)."""
    import torch

    if bool(torch.isfinite(t).all()):
        return t.tolist()
    rows = t.tolist()
    if t.dim() == 1:
        return [v if math.isfinite(v) else None for v in rows]
    return [[v if math.isfinite(v) else None for v in r] for r in rows]


class GenerateIO:
    """Parses ``/generate`` bodies and builds replies for one served model.

    Args:
        tokenizer: the model's tokenizer, or None (then ``text`` inputs are refused and replies carry ``"text": ""``).
        vocab_size: ids must be in ``[0, vocab_size)``.
        context_length: prompt + completion limit (None = unlimited); ``max_new_tokens`` is capped to what is left.
        return_hidden_states_mode: the most a request may ask (``None`` | ``last`` | ``full``).
        recording_error: why input logprobs cannot be recorded for this model (None when they can); asked per
            request that wants them.
    """

    def __init__(self, tokenizer: Any | None, vocab_size: int, context_length: int | None,
                 return_hidden_states_mode: str | None, recording_error: Callable[[], str | None]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.return_hidden_states_mode = return_hidden_states_mode
        self.recording_error = recording_error
        self.warned_default_max_new = False

    def parse(self, body: Any) -> tuple[list[GenerateItem], bool]:
        if not isinstance(body, dict):
            raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by this server; send a non-streaming request")
        input_ids = body.get("input_ids")
        if input_ids is None and body.get("text") is not None:
            input_ids = self._tokenize(body["text"])
        if input_ids is None:
            raise BadRequest("input_ids is required (a list of token ids, or a list of such lists)")
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("input_ids must be a non-empty list of ints or a non-empty list of such lists")
        single = not isinstance(input_ids[0], list)
        batch = [input_ids] if single else input_ids
        n = len(batch)
        params = body.get("sampling_params")
        if isinstance(params, list):
            if len(params) != n:
                raise BadRequest(f"sampling_params has {len(params)} entries for {n} inputs")
            param_list = params
        else:
            param_list = [params] * n
        rid = body.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(rid, list):
            if len(rid) != n:
                raise BadRequest(f"rid has {len(rid)} entries for {n} inputs")
            rids = [str(r) for r in rid]
        else:
            rids = [str(rid)] if single else [f"{rid}_{i}" for i in range(n)]
        if body.get("token_ids_logprob") is not None:
            raise BadRequest("token_ids_logprob is not supported by this server; use top_logprobs_num")
        hidden = [_hidden_mode(v) for v in _per_item(body, "return_hidden_states", n, False)]
        self._check_hidden_allowed(hidden)
        want_lp = _per_item(body, "return_logprob", n, False)
        starts = _per_item(body, "logprob_start_len", n, -1)
        tops = _per_item(body, "top_logprobs_num", n, 0)
        text_in_lp = bool(body.get("return_text_in_logprobs", False))
        parsed_cache: dict[int, tuple[SamplingParams, bool]] = {}
        items = []
        for i, (ids, p, r) in enumerate(zip(batch, param_list, rids)):
            self._check_ids(ids, i, single)
            key = id(p)
            parsed = parsed_cache.get(key)
            if parsed is None:
                parsed = self._sampling(p)
                parsed_cache[key] = parsed
            sp, prefill_only = parsed
            if self.context_length is not None:
                room = self.context_length - len(ids)
                if room <= 0:
                    raise BadRequest(
                        f"The input ({len(ids)} tokens) is longer than the model's context length "
                        f"({self.context_length} tokens)."
                    )
                if sp.max_new_tokens > room:
                    sp = dataclasses.replace(sp, max_new_tokens=room)
            request = GenerateRequest(input_ids=ids, sampling_params=sp, rid=r,
                                      return_hidden_states={"last": "last", "full": True}.get(hidden[i], False),
                                      return_logprob=bool(want_lp[i]), logprob_start_len=starts[i],
                                      top_logprobs_num=tops[i])
            item = GenerateItem(request, prefill_only=prefill_only, hidden=hidden[i], text_in_logprobs=text_in_lp)
            if want_lp[i]:
                item.logprob_start, item.top_logprobs = self._logprob_range(ids, starts[i], tops[i], prefill_only)
            items.append(item)
        return items, single

    def _check_hidden_allowed(self, hidden: list[str | None]) -> None:
        asked = max(_HIDDEN_RANK[h] for h in hidden)
        if asked <= _HIDDEN_RANK[self.return_hidden_states_mode]:
            return
        if self.return_hidden_states_mode is not None:
            raise BadRequest(
                "The requested return_hidden_states mode exceeds the server maximum "
                f"`{self.return_hidden_states_mode}`. Please launch with `--return-hidden-states-mode full` to allow "
                "return_hidden_states=True."
            )
        raise BadRequest(
            "The server is not configured to return hidden states. Please set `--return-hidden-states-mode last`, "
            "`--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
        )

    def _logprob_range(self, ids: list[int], start: Any, top: Any, prefill_only: bool) -> tuple[int, int]:
        """SGLang's resolved ``logprob_start_len`` (``scheduler.py``: -1 = output tokens only) and top-k."""
        if type(start) is not int or start < -1:
            raise BadRequest(f"logprob_start_len must be an int >= -1, got {start!r}")
        if type(top) is not int or top < 0:
            raise BadRequest(f"top_logprobs_num must be an int >= 0, got {top!r}")
        if top > self.vocab_size:
            raise BadRequest(f"top_logprobs_num={top} is larger than the vocabulary ({self.vocab_size})")
        resolved = len(ids) if start == -1 else start
        if resolved < len(ids) and self.recording_error():
            raise BadRequest(f"input logprobs are not available for this model: {self.recording_error()}")
        if resolved > len(ids):
            raise BadRequest(
                f"logprob_start_len={resolved} is higher than the number of input tokens len(req.origin_input_ids)="
                f"{len(ids)}. Please use a smaller logprob_start_len."
            )
        return resolved, top

    def _sampling(self, obj: Any) -> tuple[SamplingParams, bool]:
        """``(params, prefill_only)``; ``max_new_tokens: 0`` is SGLang's prefill-only request."""
        if isinstance(obj, dict) and type(obj.get("max_new_tokens")) is int and obj["max_new_tokens"] == 0:
            return self._sampling_params({**obj, "max_new_tokens": 1}), True
        return self._sampling_params(obj), False

    def _sampling_params(self, obj: Any) -> SamplingParams:
        if not (isinstance(obj, dict) and obj.get("max_new_tokens") is not None) and not self.warned_default_max_new:
            self.warned_default_max_new = True
            log.warning(
                "a request has no sampling_params.max_new_tokens: using SGLang's silent default of %d",
                SGLANG_DEFAULT_MAX_NEW_TOKENS,
            )
        try:
            return SamplingParams.from_json(obj, default_max_new_tokens=SGLANG_DEFAULT_MAX_NEW_TOKENS)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def _check_ids(self, ids: Any, index: int, single: bool) -> None:
        where = "input_ids" if single else f"input_ids[{index}]"
        if not isinstance(ids, list) or not ids:
            raise BadRequest(f"{where} must be a non-empty list of ints")
        for pos, t in enumerate(ids):
            if type(t) is not int or not 0 <= t < self.vocab_size:
                raise BadRequest(f"{where}[{pos}] = {t!r} is not a token id in [0, {self.vocab_size})")

    def _tokenize(self, text: Any) -> list[int] | list[list[int]]:
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer; send input_ids instead of text")
        if isinstance(text, str):
            return list(self.tokenizer(text).input_ids)
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [list(ids) for ids in self.tokenizer(text).input_ids]
        raise BadRequest("text must be a non-empty string or a non-empty list of strings")

    def reply(self, res: EngineResult, item: GenerateItem) -> dict[str, Any]:
        sp = item.sp
        text = ""
        if self.tokenizer is not None and res.output_ids:
            # SGLang trims a matched stop token from the text only; output_ids keep it
            shown = res.output_ids[:-1] if res.finish_reason.get("type") == "stop" else res.output_ids
            text = self.tokenizer.decode(shown, skip_special_tokens=sp.skip_special_tokens)
        meta: dict[str, Any] = {}
        if item.logprob_start is not None and res.finish_reason.get("type") != "abort":
            meta.update(self._logprob_meta(res, item))
        if item.hidden is not None and res.hidden_blocks is not None:
            blocks = res.hidden_blocks
            if item.hidden == "last":
                meta["hidden_states"] = _json_rows(blocks[-1]) if blocks else None
            else:
                # output_streamer.py: hs[: finished_len], and finished_len == len(output_ids) at the finish
                meta["hidden_states"] = [_json_rows(b) for b in blocks[: len(res.output_ids)]]
        reply = GenerateReply(output_ids=res.output_ids, finish_reason=FinishReason.from_json(res.finish_reason),
                              prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                              e2e_latency=round(res.e2e_latency, 6), cached_tokens=0, rid=res.rid, text=text)
        return reply.to_json(**meta)

    def _token_text(self, ids: list[int], with_text: bool) -> list[str | None]:
        if not with_text or self.tokenizer is None:
            return [None] * len(ids)
        return [self.tokenizer.decode([t]) for t in ids]

    def _logprob_meta(self, res: EngineResult, item: GenerateItem) -> dict[str, Any]:
        """SGLang's logprob fields of ``meta_info`` (``[logprob, token_id, text]`` triples)."""
        with_text = item.text_in_logprobs
        start = item.logprob_start
        in_ids = item.ids[start:]
        in_text = self._token_text(in_ids, with_text)
        in_vals = res.input_logprobs.tolist() if res.input_logprobs is not None else []
        input_lp = [[None if i == 0 else in_vals[i], t, in_text[i]] for i, t in enumerate(in_ids)]
        out_vals = res.output_logprobs or []
        out_text = self._token_text(res.output_ids, with_text)
        output_lp = [[v, t, x] for v, t, x in zip(out_vals, res.output_ids, out_text)]
        meta: dict[str, Any] = {
            "input_token_logprobs": input_lp,
            "output_token_logprobs": output_lp,
            "output_token_logprobs_length": len(output_lp),
        }
        if item.top_logprobs > 0:
            def triples(vals: list[float], ids: list[int]) -> list[list[Any]]:
                texts = self._token_text(ids, with_text)
                return [[v, t, x] for v, t, x in zip(vals, ids, texts)]

            input_top: list[Any] = []
            if res.input_top is not None:
                vals, ids = res.input_top[0].tolist(), res.input_top[1].tolist()
                input_top = [None] + [triples(v, i) for v, i in zip(vals[1:], ids[1:])]
            elif in_ids:
                input_top = [None]
            meta["input_top_logprobs"] = input_top
            meta["output_top_logprobs"] = [triples(v.tolist(), i.tolist()) for v, i in (res.output_top or [])]
        return meta
