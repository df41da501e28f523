"""A small server speaking SGLang's native HTTP protocol over any local transformers causal LM.

It lets the pipeline use one client code path everywhere: on a machine without a GPU the embedded default target is
served here; on a GPU host the same client talks to ``python -m sglang.launch_server``.

Endpoints (shapes from sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py``):

- ``POST /generate`` (also PUT): ``GenerateReqInput`` of ``python/sglang/srt/managers/io_struct.py``:
  ``{"input_ids": [..] | [[..], ..], "text": str | [str] (alternative), "sampling_params": {..} | [{..}],
  "rid": str | [str]}``. Reply: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency"}}``, or a list of them for a batch input. Like SGLang, a
  missing ``max_new_tokens`` means 128 (logged), an invalid request is HTTP 400 ``{"error": {"message": ..}}``, a
  prompt at or over the context length is refused, and ``max_new_tokens`` is capped to the context left.
  ``stream: true`` is refused (400). A failed forward or a shutdown answers HTTP 200 with an ``abort`` reason.
  ``max_new_tokens: 0`` is a prefill-only request (SGLang's ``Req.is_prefill_only``): ``output_ids`` [],
  ``finish_reason`` ``{"type": "length", "length": 0}``.
- Hidden states (SGLang 0.5.23, see :mod:`eagle_assets.serving.aux_capture` for the launch side): with
  ``--enable-return-aux-hidden-states`` (or ``--enable-return-hidden-states`` for the final-normed state) a request
  with ``return_hidden_states: true`` gets ``meta_info.hidden_states`` built as SGLang's scheduler builds it
  (``scheduler_components/batch_result_processor.py::_append_prefill_hidden_states`` /
  ``_append_decode_hidden_states``, then ``output_streamer.py`` slices it to ``[: finished_len]``): a list whose
  first element is the prompt block ``[T][W]`` and whose further elements are one ``[W]`` row per decode step (the
  fed token; the last sampled token is never fed), so ``max_new_tokens: N`` giving ``n`` tokens returns
  ``1 + (n - 1)`` entries. Consequences copied on purpose: ``max_new_tokens: 0`` returns ``[]`` (``finished_len``
  is 0), so features need ``max_new_tokens: 1``, which returns ``[[row_0, ..., row_{T-1}]]``; the final-layer
  state is not in it. ``return_hidden_states: "last"`` returns the latest row alone, ``[W]``. ``W`` is ``k * H``
  (capture layers in ascending capture id). Non-finite values are sent as ``null``, as SGLang's orjson does. A
  request asking for more than the server allows is HTTP 400 with SGLang's message.
- Logprobs (``tokenizer_manager.py::add_logprob_to_meta_info``, ``logprob_result_processor.py``): with
  ``return_logprob: true``, ``logprob_start_len`` (-1 = output tokens only) and ``top_logprobs_num``:
  ``meta_info.input_token_logprobs`` ``[[logprob | None, token_id, text | None], ..]`` for prompt tokens
  ``logprob_start_len ..`` (the first entry's logprob is None), ``output_token_logprobs`` (one per output token),
  ``output_token_logprobs_length``, and with ``top_logprobs_num > 0`` ``input_top_logprobs`` (entry ``i`` = the
  top-k of the distribution that predicts prompt token ``logprob_start_len + i``; entry 0 is None) and
  ``output_top_logprobs``. Logprobs are ``log_softmax`` of the raw logits (SGLang's value for greedy requests and
  for all input logprobs); ``return_text_in_logprobs`` fills the text slot. ``token_ids_logprob`` is refused. One
  known difference: a ``max_new_tokens: 0`` request gets no output logprobs here, where SGLang reports one for the
  dummy token id 0 it puts in place of sampling (``tp_worker.py``).
- ``GET /health``, ``GET /health_generate``: 200 with an empty body while the decode thread is alive, else 503.
- ``GET /get_model_info`` (alias ``/model_info``, the newer name): ``{"model_path", "tokenizer_path",
  "is_generation": true, "preferred_sampling_params", "weight_version"}`` as SGLang, plus ``vocab_size``,
  ``context_length``, ``eos_token_ids``, ``dtype``, ``max_batch_size``.
- ``GET /get_server_info`` (alias ``/server_info``): the model info plus ``engine`` (``EngineStats``: forward calls,
  prefill and decode batches, mean decode batch) and ``running``/``queued`` counts: the batching counters tests
  assert on. ``sglang-router`` reads these two endpoints when it registers a worker.
- ``GET|POST /flush_cache``: no-op 200 (there is no prefix cache), for tools that call it.

API key: with ``api_key`` set every path except ``/health*`` needs ``Authorization: Bearer <key>``, else HTTP 401
``{"error": "Unauthorized"}`` (SGLang's ``add_api_key_middleware``).

Batching and determinism: see ``eagle_assets.serving.engine``. The model runs in the engine thread, so the event
loop keeps answering ``/health`` and accepting requests while a batch decodes.

CLI: ``python -m eagle_assets.serving.server --model-path DIR [--host 127.0.0.1] [--port 30000]
[--max-batch-size 64] [--api-key-env VAR] [--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states
[--return-aux-hidden-state-layer-ids I J K]] [--enable-return-hidden-states] [--return-hidden-states-mode
last|full]``; prints ``EAGLE_ASSETS_SERVER_READY http://HOST:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from aiohttp import web

from eagle_assets.serving.aux_capture import (
    CAPTURE_ALGORITHMS,
    AuxCaptureError,
    capture_convention,
    capture_ids_from_flag,
    num_layers_of,
)
from eagle_assets.serving.engine import DecodeEngine, EngineRequest, EngineResult, load_causal_lm, model_eos_ids
from eagle_assets.serving.launch import READY_PREFIX
from eagle_assets.serving.protocol import SGLANG_DEFAULT_MAX_NEW_TOKENS, SamplingParams

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024


class _BadRequest(ValueError):
    """A request SGLang would answer with HTTP 400."""


_HIDDEN_RANK = {None: 0, "last": 1, "full": 2}  # SGLang's CaptureHiddenMode order NULL < LAST < FULL


@dataclass
class _Item:
    """One parsed input of a ``/generate`` body."""

    rid: str
    ids: list[int]
    sp: SamplingParams
    prefill_only: bool = False
    hidden: str | None = None
    logprob_start: int | None = None
    top_logprobs: int = 0
    text_in_logprobs: bool = False


def _per_item(body: dict, key: str, n: int, default: Any) -> list[Any]:
    value = body.get(key, default)
    if isinstance(value, list):
        if len(value) != n:
            raise _BadRequest(f"The length of {key} should be equal to the batch size ({len(value)} for {n} inputs).")
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
    raise _BadRequest("return_hidden_states must be a boolean or the string literal 'last'.")


def _json_rows(t: Any) -> Any:
    """``tensor.tolist()``, with non-finite values as None (JSON has no NaN; SGLang's orjson writes null)."""
    import torch

    if bool(torch.isfinite(t).all()):
        return t.tolist()
    rows = t.tolist()
    if t.dim() == 1:
        return [v if math.isfinite(v) else None for v in rows]
    return [[v if math.isfinite(v) else None for v in r] for r in rows]


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        status=status, body=json.dumps({"error": {"message": message}}).encode(), content_type="application/json"
    )


def _deliver(fut: asyncio.Future, result: EngineResult) -> None:
    if not fut.done():
        fut.set_result(result)


class ModelServer:
    """Model, tokenizer and decode engine behind the HTTP endpoints.

    Args:
        model_path: local transformers model directory (or hub id).
        tokenizer_path: defaults to ``model_path``; when no tokenizer loads, ``text`` inputs are refused and replies
            carry ``"text": ""``.
        max_batch_size: most sequences decoded together.
        batch_wait_s: how long an idle engine waits after a first request for others to batch with it.
        dtype: ``auto`` | ``float64`` | ``float32`` | ``bfloat16`` | ``float16`` (see ``engine.resolve_dtype``).
        device: torch device.
        api_key: require ``Authorization: Bearer <api_key>`` (except on ``/health*``).
        context_length: prompt + completion limit; defaults to ``config.max_position_embeddings``.
        seed: seeds the per-request seeds of sampled requests without ``sampling_seed``.
        enable_return_aux_hidden_states / speculative_algorithm / return_aux_hidden_state_layer_ids: SGLang's
            capture-only mode (see :mod:`eagle_assets.serving.aux_capture`); ``speculative_algorithm`` only names
            the convention (EAGLE3; no draft runs).
        enable_return_hidden_states: allow ``return_hidden_states`` for the final-normed state (no aux capture).
        return_hidden_states_mode: the most a request may ask (``last`` | ``full``); default ``full`` when either
            flag is on, else hidden states are refused.
    Raises:
        ValueError / OSError when the model cannot be loaded; AuxCaptureError (a ValueError) for capture settings
        SGLang would refuse, with SGLang's message.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        dtype: str = "auto",
        device: str = "cpu",
        api_key: str | None = None,
        context_length: int | None = None,
        seed: int | None = None,
        enable_return_aux_hidden_states: bool = False,
        speculative_algorithm: str | None = None,
        return_aux_hidden_state_layer_ids: list[int] | None = None,
        enable_return_hidden_states: bool = False,
        return_hidden_states_mode: str | None = None,
    ):
        self._check_capture_args(enable_return_aux_hidden_states, speculative_algorithm,
                                 return_aux_hidden_state_layer_ids, return_hidden_states_mode)
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.model = load_causal_lm(self.model_path, dtype=dtype, device=device)
        self.tokenizer = self._load_tokenizer(self.tokenizer_path)
        config = self.model.config
        self.vocab_size = int(getattr(config, "vocab_size", None) or self.model.get_output_embeddings().weight.shape[0])
        self.context_length = context_length or getattr(config, "max_position_embeddings", None)
        self.eos_ids = model_eos_ids(self.model, self.tokenizer)
        self.api_key = api_key or None
        self.enable_return_aux_hidden_states = bool(enable_return_aux_hidden_states)
        self.return_aux_hidden_state_layer_ids = (
            [int(i) for i in return_aux_hidden_state_layer_ids] if return_aux_hidden_state_layer_ids is not None
            else None
        )
        self.capture_ids: list[int] = []
        self.capture_convention: str | None = None
        if self.enable_return_aux_hidden_states:
            self.capture_convention = capture_convention(config)
            self.capture_ids = capture_ids_from_flag(
                self.return_aux_hidden_state_layer_ids, num_layers_of(config), self.capture_convention
            )
        self.enable_return_hidden_states = bool(enable_return_hidden_states) or return_hidden_states_mode is not None
        if return_hidden_states_mode is None and (self.enable_return_hidden_states
                                                  or self.enable_return_aux_hidden_states):
            return_hidden_states_mode = "full"
        self.return_hidden_states_mode = return_hidden_states_mode
        source = "aux" if self.enable_return_aux_hidden_states else ("final" if return_hidden_states_mode else None)
        self.engine = DecodeEngine(
            self.model, self.eos_ids, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, seed=seed,
            hidden_states=source, capture_ids=self.capture_ids,
        )
        self._warned_default_max_new = False

    @staticmethod
    def _check_capture_args(enabled: bool, algorithm: str | None, layer_ids: list[int] | None,
                            mode: str | None) -> None:
        """SGLang's ``handle_aux_hidden_state_capture`` / ``handle_return_hidden_states_mode`` checks."""
        if mode not in (None, "last", "full"):
            raise AuxCaptureError("return_hidden_states_mode must be one of: None, 'last', or 'full'.")
        if not enabled:
            if layer_ids is not None:
                raise AuxCaptureError(
                    "--return-aux-hidden-state-layer-ids requires --enable-return-aux-hidden-states."
                )
            if algorithm is not None:
                raise AuxCaptureError(
                    f"--speculative-algorithm {algorithm}: this server runs no speculative decoding; it takes the "
                    "flag only with --enable-return-aux-hidden-states, to name the capture convention"
                )
            return
        method = (algorithm or "").upper()
        if method not in CAPTURE_ALGORITHMS:
            raise AuxCaptureError(
                "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3, DFLASH or DSPARK to name "
                f"the capture convention, got {algorithm!r}."
            )
        if method != "EAGLE3":
            raise AuxCaptureError(f"this server implements the EAGLE3 capture convention only, not {method}")

    @staticmethod
    def _load_tokenizer(path: str) -> Any | None:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path))
        except Exception as exc:  # a model dir without tokenizer files can still serve input_ids
            log.warning("no tokenizer loaded from %s (%s); text inputs are refused, replies carry no text", path, exc)
            return None

    # ---------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread and run one tiny request so the first real batch does not pay warm-up."""
        self.engine.start()
        done = threading.Event()
        self.engine.submit(
            [EngineRequest("warmup", [0, 0], SamplingParams(max_new_tokens=2, temperature=0.0), lambda r: done.set())]
        )
        done.wait(300)

    def stop(self) -> None:
        """Stop the engine thread (pending requests get an ``abort`` reply)."""
        self.engine.stop()

    def model_info(self) -> dict[str, Any]:
        """Body of ``GET /get_model_info``."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "eos_token_ids": sorted(self.eos_ids),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "max_batch_size": self.engine.max_batch_size,
        }

    def capture_info(self) -> dict[str, Any]:
        """The hidden-state fields of ``/server_info``, under SGLang's resolved server-arg names (SGLang resets
        ``speculative_algorithm`` to None in capture mode and records the convention in
        ``aux_hidden_state_capture``), plus ``aux_capture_ids`` (ours: what the columns hold)."""
        return {
            "enable_return_aux_hidden_states": self.enable_return_aux_hidden_states,
            "return_aux_hidden_state_layer_ids": self.return_aux_hidden_state_layer_ids,
            "aux_hidden_state_capture": "eagle3" if self.enable_return_aux_hidden_states else None,
            "speculative_algorithm": None,
            "enable_return_hidden_states": self.enable_return_hidden_states,
            "return_hidden_states_mode": self.return_hidden_states_mode,
            "chunked_prefill_size": -1,  # prompts are never split here
            "disable_radix_cache": True,  # there is no prefix cache
            "aux_capture_ids": list(self.capture_ids),
            "aux_capture_convention": self.capture_convention,
        }

    # ------------------------------------------------------------------------------------------------- parsing
    def _parse(self, body: Any) -> tuple[list[_Item], bool]:
        if not isinstance(body, dict):
            raise _BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
        if body.get("stream"):
            raise _BadRequest("stream=true is not supported by this server; send a non-streaming request")
        input_ids = body.get("input_ids")
        if input_ids is None and body.get("text") is not None:
            input_ids = self._tokenize(body["text"])
        if input_ids is None:
            raise _BadRequest("input_ids is required (a list of token ids, or a list of such lists)")
        if not isinstance(input_ids, list) or not input_ids:
            raise _BadRequest("input_ids must be a non-empty list of ints or a non-empty list of such lists")
        single = not isinstance(input_ids[0], list)
        batch = [input_ids] if single else input_ids
        n = len(batch)
        params = body.get("sampling_params")
        if isinstance(params, list):
            if len(params) != n:
                raise _BadRequest(f"sampling_params has {len(params)} entries for {n} inputs")
            param_list = params
        else:
            param_list = [params] * n
        rid = body.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(rid, list):
            if len(rid) != n:
                raise _BadRequest(f"rid has {len(rid)} entries for {n} inputs")
            rids = [str(r) for r in rid]
        else:
            rids = [str(rid)] if single else [f"{rid}_{i}" for i in range(n)]
        if body.get("token_ids_logprob") is not None:
            raise _BadRequest("token_ids_logprob is not supported by this server; use top_logprobs_num")
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
                    raise _BadRequest(
                        f"The input ({len(ids)} tokens) is longer than the model's context length "
                        f"({self.context_length} tokens)."
                    )
                if sp.max_new_tokens > room:
                    sp = dataclasses.replace(sp, max_new_tokens=room)
            item = _Item(r, ids, sp, prefill_only=prefill_only, hidden=hidden[i], text_in_logprobs=text_in_lp)
            if want_lp[i]:
                item.logprob_start, item.top_logprobs = self._logprob_range(ids, starts[i], tops[i], prefill_only)
            items.append(item)
        return items, single

    def _check_hidden_allowed(self, hidden: list[str | None]) -> None:
        asked = max(_HIDDEN_RANK[h] for h in hidden)
        if asked <= _HIDDEN_RANK[self.return_hidden_states_mode]:
            return
        if self.return_hidden_states_mode is not None:
            raise _BadRequest(
                "The requested return_hidden_states mode exceeds the server maximum "
                f"`{self.return_hidden_states_mode}`. Please launch with `--return-hidden-states-mode full` to allow "
                "return_hidden_states=True."
            )
        raise _BadRequest(
            "The server is not configured to return hidden states. Please set `--return-hidden-states-mode last`, "
            "`--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
        )

    def _logprob_range(self, ids: list[int], start: Any, top: Any, prefill_only: bool) -> tuple[int, int]:
        """SGLang's resolved ``logprob_start_len`` (``scheduler.py``: -1 = output tokens only) and top-k."""
        if type(start) is not int or start < -1:
            raise _BadRequest(f"logprob_start_len must be an int >= -1, got {start!r}")
        if type(top) is not int or top < 0:
            raise _BadRequest(f"top_logprobs_num must be an int >= 0, got {top!r}")
        if top > self.vocab_size:
            raise _BadRequest(f"top_logprobs_num={top} is larger than the vocabulary ({self.vocab_size})")
        resolved = len(ids) if start == -1 else start
        if resolved < len(ids) and self.engine.recording_error:
            raise _BadRequest(f"input logprobs are not available for this model: {self.engine.recording_error}")
        if resolved > len(ids):
            raise _BadRequest(
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
        if not (isinstance(obj, dict) and obj.get("max_new_tokens") is not None) and not self._warned_default_max_new:
            self._warned_default_max_new = True
            log.warning(
                "a request has no sampling_params.max_new_tokens: using SGLang's silent default of %d",
                SGLANG_DEFAULT_MAX_NEW_TOKENS,
            )
        try:
            return SamplingParams.from_json(obj, default_max_new_tokens=SGLANG_DEFAULT_MAX_NEW_TOKENS)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from None

    def _check_ids(self, ids: Any, index: int, single: bool) -> None:
        where = "input_ids" if single else f"input_ids[{index}]"
        if not isinstance(ids, list) or not ids:
            raise _BadRequest(f"{where} must be a non-empty list of ints")
        for pos, t in enumerate(ids):
            if type(t) is not int or not 0 <= t < self.vocab_size:
                raise _BadRequest(f"{where}[{pos}] = {t!r} is not a token id in [0, {self.vocab_size})")

    def _tokenize(self, text: Any) -> list[int] | list[list[int]]:
        if self.tokenizer is None:
            raise _BadRequest("this server has no tokenizer; send input_ids instead of text")
        if isinstance(text, str):
            return list(self.tokenizer(text).input_ids)
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [list(ids) for ids in self.tokenizer(text).input_ids]
        raise _BadRequest("text must be a non-empty string or a non-empty list of strings")

    def _reply(self, res: EngineResult, item: _Item) -> dict[str, Any]:
        sp = item.sp
        text = ""
        if self.tokenizer is not None and res.output_ids:
            # SGLang trims a matched stop token from the text only; output_ids keep it
            shown = res.output_ids[:-1] if res.finish_reason.get("type") == "stop" else res.output_ids
            text = self.tokenizer.decode(shown, skip_special_tokens=sp.skip_special_tokens)
        meta: dict[str, Any] = {
            "id": res.rid,
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "cached_tokens": 0,
            "e2e_latency": round(res.e2e_latency, 6),
        }
        if item.logprob_start is not None and res.finish_reason.get("type") != "abort":
            meta.update(self._logprob_meta(res, item))
        if item.hidden is not None and res.hidden_blocks is not None:
            blocks = res.hidden_blocks
            if item.hidden == "last":
                meta["hidden_states"] = _json_rows(blocks[-1]) if blocks else None
            else:
                # output_streamer.py: hs[: finished_len], and finished_len == len(output_ids) at the finish
                meta["hidden_states"] = [_json_rows(b) for b in blocks[: len(res.output_ids)]]
        return {"text": text, "output_ids": res.output_ids, "meta_info": meta}

    def _token_text(self, ids: list[int], with_text: bool) -> list[str | None]:
        if not with_text or self.tokenizer is None:
            return [None] * len(ids)
        return [self.tokenizer.decode([t]) for t in ids]

    def _logprob_meta(self, res: EngineResult, item: _Item) -> dict[str, Any]:
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

    # ------------------------------------------------------------------------------------------------ handlers
    async def _handle_generate(self, request: web.Request) -> web.Response:
        arrival = time.monotonic()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        try:
            items, single = self._parse(body)
        except _BadRequest as exc:
            return _error(400, str(exc))
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        reqs: list[EngineRequest] = []
        for item in items:
            fut = loop.create_future()

            def on_done(result: EngineResult, fut: asyncio.Future = fut) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                    loop.call_soon_threadsafe(_deliver, fut, result)

            futures.append(fut)
            reqs.append(EngineRequest(item.rid, item.ids, item.sp, on_done, arrival=arrival, hidden=item.hidden,
                                      prefill_only=item.prefill_only, logprob_start=item.logprob_start,
                                      top_logprobs=item.top_logprobs))
        self.engine.submit(reqs)
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for r in reqs:
                r.cancelled = True
            raise
        replies = [self._reply(res, item) for res, item in zip(results, items)]
        payload = replies[0] if single else replies
        return web.Response(body=json.dumps(payload).encode(), content_type="application/json")

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def _handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.model_info())

    async def _handle_server_info(self, request: web.Request) -> web.Response:
        info = self.model_info()
        info.update(self.capture_info())
        info.update(
            {
                "engine": self.engine.stats.to_json(),
                "continuous_batching": self.engine.continuous,
                "running": self.engine.running,
                "queued": self.engine.queued,
            }
        )
        return web.json_response(info)

    async def _handle_flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")

    def build_app(self) -> web.Application:
        """The aiohttp application (routes above, API-key middleware when ``api_key`` is set)."""
        middlewares = []
        if self.api_key:
            expected = f"Bearer {self.api_key}".encode()

            @web.middleware
            async def require_api_key(request: web.Request, handler):
                if request.method == "OPTIONS" or request.path.startswith("/health"):
                    return await handler(request)
                given = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return web.json_response({"error": "Unauthorized"}, status=401)
                return await handler(request)

            middlewares.append(require_api_key)
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.router.add_post("/generate", self._handle_generate)
        app.router.add_put("/generate", self._handle_generate)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/health_generate", self._handle_health)
        # newer SGLang (and sglang-router's worker discovery) use /model_info and /server_info; both names work
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self._handle_model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self._handle_server_info)
        app.router.add_route("*", "/flush_cache", self._handle_flush_cache)
        return app


async def start_site(server: ModelServer, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve ``server`` on ``host:port`` in the running loop (port 0 = any free port). Returns (runner, port).

    Handlers are cancelled when their client disconnects, which drops the request from the decode batch.
    """
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)


@dataclass
class RunningServer:
    """A server started by ``serve_in_thread``: ``url`` is ``http://host:port``."""

    url: str
    server: ModelServer


@contextlib.contextmanager
def serve_in_thread(model_path: str, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> Iterator[RunningServer]:
    """Run a ``ModelServer`` with its own event loop in a background thread of this process (tests, benchmarks).

    ``kwargs`` go to ``ModelServer``. Yields once the server answers; stops it on exit.
    """
    server = ModelServer(model_path, **kwargs)
    server.start()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            state["runner"], state["port"] = loop.run_until_complete(start_site(server, host, port))
        except BaseException as exc:  # surfaced to the caller below
            state["error"] = exc
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(state["runner"].cleanup())
        loop.close()

    thread = threading.Thread(target=run, name="eagle-assets-server", daemon=True)
    thread.start()
    ready.wait()
    if "error" in state:
        server.stop()
        raise state["error"]
    try:
        yield RunningServer(url=f"http://{host}:{state['port']}", server=server)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        server.stop()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eagle_assets.serving.server",
        description="Serve a local transformers causal LM over SGLang's native /generate protocol.",
    )
    p.add_argument("--model-path", required=True, help="local transformers model directory")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000, help="0 = any free port (printed in the ready line)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="idle wait for more requests to batch with")
    p.add_argument("--dtype", default="auto", help="auto (float64 for small CPU models) | float32 | bfloat16 | ...")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--api-key-env", default=None, help="environment variable holding the API key")
    p.add_argument("--api-key", default=None, help="API key (visible in the process list; prefer --api-key-env)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampled requests without sampling_seed")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true",
                   help="SGLang's capture-only mode: return_hidden_states returns the aux hidden states")
    p.add_argument("--speculative-algorithm", default=None,
                   help="with --enable-return-aux-hidden-states: the capture convention (EAGLE3); nothing else")
    p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+", default=None,
                   help="SGLang's layer ids (model-class rule, see eagle_assets.serving.aux_capture)")
    p.add_argument("--enable-return-hidden-states", action="store_true",
                   help="allow return_hidden_states (the final-normed hidden state)")
    p.add_argument("--return-hidden-states-mode", choices=["last", "full"], default=None)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="shut down when the launching process dies (set by eagle_assets.serving.launch)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(f"error: --api-key-env {args.api_key_env} is set but that environment variable is empty or "
                  "missing; export it or drop the flag", file=sys.stderr)
            return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("binding %s without an API key: anyone who can reach this port can use the model", args.host)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars only clutter the server log
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    try:
        server = ModelServer(
            args.model_path,
            tokenizer_path=args.tokenizer_path,
            max_batch_size=args.max_batch_size,
            batch_wait_s=args.batch_wait_ms / 1000.0,
            dtype=args.dtype,
            device=args.device,
            api_key=api_key,
            context_length=args.context_length,
            seed=args.seed,
            enable_return_aux_hidden_states=args.enable_return_aux_hidden_states,
            speculative_algorithm=args.speculative_algorithm,
            return_aux_hidden_state_layer_ids=args.return_aux_hidden_state_layer_ids,
            enable_return_hidden_states=args.enable_return_hidden_states,
            return_hidden_states_mode=args.return_hidden_states_mode,
        )
    except (OSError, ValueError) as exc:
        print(f"error: cannot serve {args.model_path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    server.start()

    async def serve() -> None:
        runner, port = await start_site(server, args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if args.exit_with_parent:
            parent = os.getppid()

            async def watch_parent() -> None:
                # a SIGKILLed launcher runs no teardown; its orphaned server must not keep the model loaded
                while os.getppid() == parent:
                    await asyncio.sleep(1.0)
                log.warning("launching process %d is gone; shutting down", parent)
                stop.set()

            watcher = asyncio.ensure_future(watch_parent())
        info = server.model_info()
        print(f"{READY_PREFIX} http://{args.host}:{port}", flush=True)
        log.info("serving %s (dtype %s, max batch %d, continuous batching %s)", args.model_path, info["dtype"],
                 args.max_batch_size, server.engine.continuous)
        await stop.wait()
        if args.exit_with_parent:
            watcher.cancel()
        await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
