"""Drafter features from the serving engine: aux hidden states and teacher targets of each training row, from an
SGLang server (or our embedded one) in aux-capture mode, for targets the trainer cannot load (Kimi-K2.5, DeepSeek).

The protocol (SGLang 0.5.23 source; the launch side is :mod:`eagle_assets.serving.aux_capture`, the reply side is
mirrored by :mod:`eagle_assets.serving.server`): one ``POST /generate`` per row with

``{"input_ids": row, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_hidden_states": true,
"return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": K}``

- ``max_new_tokens: 1``, not 0: a prefill-only request finishes with ``finished_len = 0`` and SGLang's
  ``output_streamer.py`` slices ``hidden_states[:finished_len]`` to ``[]``. With 1 the reply's
  ``meta_info.hidden_states`` is ``[[row_0, .., row_{T-1}]]``: one prompt block of ``T`` rows of ``W = k * H`` floats,
  the capture layers concatenated in ascending capture id (the final-layer state is not there).
- ``return_logprob`` + ``logprob_start_len: 0``: a prefix-cache hit would shorten the prefill and with it the
  returned block (``schedule_batch.py::_compute_max_prefix_len`` stops matching at ``logprob_start_len``), so even
  hard-label requests ask for logprobs from position 0. ``input_top_logprobs[i]`` is the top-K of the distribution
  predicting prompt token ``i`` (entry 0 is None): teacher position ``q`` reads entry ``q + 1``.
- SGLang keeps the hidden states of the LAST prefill chunk only, so a row longer than ``--chunked-prefill-size``
  comes back short; such rows are refused (counted) with that reason, never silently cut.

Teachers (catalog ``training.features.teacher``): ``hard``: the row's own next token at every teacher position
(exact for the target's own greedy generations; the server's top-1 is asked for anyway and the share of positions
where it differs is reported as ``hard_label_disagreement``); ``topk``: the target's top-K logprobs there,
renormalized over the draft vocab by :func:`~eagle_assets.drafter.features.served_cache.served_supervision`. With
``K`` at least the vocab size this is exactly the local teacher (the target softmax restricted to the draft vocab).

Sizes (why this is built for bounded memory): a reply carries ``T * W`` floats as JSON text, 10-20 bytes each
(about 11 for bfloat16 values, 19-21 for float32/float64 ones), against 2 bytes per value in a bfloat16 shard. Rows
are fetched ``concurrency`` per server at a time, parsed with orjson straight into float32 arrays, and written shard
by shard (:mod:`eagle_assets.drafter.features.shard_format`); docs/served_features.md has the worked Kimi-K2.5 numbers.
Each reply is read up to :meth:`ServedFeatureSource.reply_cap` bytes, derived from what the request asks for (the
longest row of a batch x its capture width x the longest JSON text of one value, plus the logprobs), so a server or
proxy that sends more is one ``reply_too_large`` refusal, not a process that runs out of memory.

Transport: the serving client (:meth:`eagle_assets.serving.client.GenerateClient.post_many`) sends the requests, so
HTTP, retries, backoff, server choice and API-key redaction have one implementation: connection errors, timeouts,
HTTP 408/429/5xx and unusable replies (a short block, a non-finite value, malformed logprobs, ...) are retried up to
``max_attempts``; a row whose replies stay unusable, or that the server refuses (HTTP 400), becomes a
:class:`RefusedRow` with the reason; transport failures that outlast the attempts, 401/403/404 and a server that
refuses hidden states raise :class:`ServedFeaturesError` (no row could succeed).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from eagle_assets.catalog import FeaturesSpec as ServedFeaturesSpec
from eagle_assets.drafter.features.shard_format import (
    FeatureSpec,
    RowFeatures,
)
from eagle_assets.drafter.features.teacher import teacher_positions
from eagle_assets.serving.aux_capture import (
    AuxCapture,
    capture_convention,
    capture_flag_ids,
    capture_ids_from_flag,
    capture_rule,
    num_layers_of,
    text_config,
)
from eagle_assets.serving.client import GenerateClient, normalize_url, run_sync
from eagle_assets.serving.protocol import (
    GenerateFailure,
    GenerateRequest,
    ReplyError,
    SamplingParams,
    clip_text,
    show_value,
)
from eagle_assets.target_model.config import ModelConfigError, read_json_config

Row = Any  # (input_ids, loss_mask) pair, or an object with .ids and .mask (local_cache.PreparedRow)

# The reply size cap (ServedFeatureSource.reply_cap). A value of hidden_states arrives as JSON text of a float64
# (SGLang's tensor.tolist() then orjson): at most 24 characters, "-2.2250738585072014e-308", plus its separator. A
# logprob entry [logprob, token id, text] without text (return_text_in_logprobs is not asked): a float, an id of up
# to 20 digits, null and punctuation, under 64 bytes. Per token a margin for the row's brackets, output ids and
# text; per reply one for meta_info's other fields.
JSON_FLOAT_MAX_BYTES = 25
LOGPROB_ENTRY_MAX_BYTES = 64
REPLY_TOKEN_MARGIN_BYTES = 512
REPLY_BASE_BYTES = 1 << 20


class ServedFeaturesError(RuntimeError):
    """The server cannot give features at all (not in capture mode, other layers, unreachable): no row would
    succeed, so the run stops with what to change."""


@dataclass
class RefusedRow:
    """A row whose reply was unusable; it is left out of training and counted under ``reason``."""

    row_id: str
    reason: str
    detail: str


@dataclass
class ServedFeatureStats:
    """Counters of one source's work (``refused`` / ``shards_refused``: reason -> count)."""

    rows_ok: int = 0
    refused: Counter = field(default_factory=Counter)
    requests: int = 0
    retries: int = 0
    reply_bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    shards_written: int = 0
    shards_reused: int = 0
    shards_refused: Counter = field(default_factory=Counter)
    teacher_positions: int = 0
    hard_label_disagreements: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def hard_label_disagreement(self) -> float:
        """Share of teacher positions where the row's token is not the server's greedy token (hard teacher)."""
        return self.hard_label_disagreements / self.teacher_positions if self.teacher_positions else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows_ok": self.rows_ok, "refused": dict(self.refused), "requests": self.requests,
            "retries": self.retries, "reply_bytes": self.reply_bytes, "tokens": self.tokens,
            "seconds": round(self.seconds, 3), "shards_written": self.shards_written,
            "shards_reused": self.shards_reused, "shards_refused": dict(self.shards_refused),
            "hard_label_disagreement": round(self.hard_label_disagreement, 6), "notes": list(self.notes),
        }


def row_arrays(row: Row) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(row, "ids") and hasattr(row, "mask"):
        return np.asarray(row.ids, dtype=np.int64), np.asarray(row.mask).astype(np.int8)
    ids, mask = row
    return np.asarray(ids, dtype=np.int64), np.asarray(mask).astype(np.int8)


def _load_config(target: Any) -> Any:
    if isinstance(target, (str, Path)):
        try:
            return read_json_config(target)
        except (OSError, ModelConfigError) as exc:
            raise ServedFeaturesError(f"cannot read the target config {Path(target) / 'config.json'}: {exc}") from None
    return target


class ServedFeatureSource:
    """Fetches :class:`RowFeatures` for rows from one or more servers in aux-capture mode.

    Args:
        target_config: the target's ``config.json`` (a dict, a ``PretrainedConfig``, or the model directory): its
            layer count, hidden size and SGLang's layer-id rule for it. Only the config is read.
        settings: :class:`ServedFeaturesSpec`. Without ``url``, call :meth:`use_urls` before fetching (e.g. with
            the URL of a server launched with :meth:`aux_capture`'s settings).
        capture_ids: capture ids the drafter is trained on (``training.aux_layer_ids``; None = SGLang's default
            ``[2, L // 2, L - 3]``).
        target_name: the target's identity recorded in shard specs (path or hub id).

    Raises:
        ServedFeaturesError: an unreadable config.
        AuxCaptureError: capture ids SGLang could not be asked for.
    """

    def __init__(self, target_config: Any, settings: ServedFeaturesSpec, capture_ids: Sequence[int] | None = None,
                 target_name: str = "", log: Callable[[str], None] | None = None):
        config = _load_config(target_config)
        self.settings = settings
        self.urls: list[str] = []
        self.use_urls(settings.urls)
        self.num_layers = num_layers_of(config)
        self.hidden_size = int(_cfg(text_config(config), "hidden_size"))
        self.vocab_size = int(_cfg(text_config(config), "vocab_size"))
        self.convention = capture_convention(config)
        self.target_config = config
        default = capture_ids_from_flag(None, self.num_layers, self.convention)
        self.capture_ids = sorted(int(c) for c in capture_ids) if capture_ids is not None else default
        # the flag is only needed when the ids differ from the model's default
        self.flag_layer_ids = capture_flag_ids(config, self.capture_ids)
        top_k = settings.top_k if settings.teacher == "topk" else 1
        self.spec = FeatureSpec(
            capture_ids=tuple(self.capture_ids),
            flag_layer_ids=tuple(self.flag_layer_ids) if self.flag_layer_ids is not None else None,
            hidden_size=self.hidden_size, teacher=settings.teacher, top_k=top_k, target=str(target_name),
            storage_dtype=settings.storage_dtype,
        )
        self.stats = ServedFeatureStats()
        self._stats_lock = threading.Lock()  # fetch threads count requests, bytes and disagreements
        self.log = log or (lambda msg: None)
        if settings.api_key_env and not os.environ.get(settings.api_key_env):
            raise ServedFeaturesError(f"api_key_env={settings.api_key_env!r} names an unset or empty variable")

    # ------------------------------------------------------------------------------------------- the server
    def use_urls(self, urls: str | Sequence[str]) -> None:
        """Send requests to ``urls`` (base URLs; a trailing ``/generate`` is accepted); checked again on next use."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [normalize_url(u) for u in urls]
        self._checked = False
        # HTTP, retries and backoff are the serving client's (one place for them): a connection error, timeout,
        # 408/429/5xx or an unusable reply is retried up to max_attempts, with backoff, preferring another server
        self.client = GenerateClient(
            self.urls, concurrency_per_server=self.settings.concurrency, timeout_s=self.settings.timeout_s,
            max_attempts=self.settings.max_attempts, api_key_env=self.settings.api_key_env,
        ) if self.urls else None

    def _need_urls(self) -> None:
        if not self.urls:
            raise ServedFeaturesError(
                "training.features.url is not set: give the URL of a server launched with "
                f"{' '.join(self.aux_capture().server_args('sglang'))}, or launch one with "
                "launch_server(..., aux_capture=source.aux_capture()) and call source.use_urls(server.url)"
            )

    def aux_capture(self, max_row_tokens: int | None = None) -> AuxCapture:
        """Launch settings for a server that serves exactly these features (pass to ``launch_server``)."""
        return AuxCapture(layer_ids=tuple(self.flag_layer_ids) if self.flag_layer_ids is not None else None,
                          max_row_tokens=max_row_tokens)

    def check_server(self, max_row_tokens: int | None = None) -> dict[str, Any]:
        """Compare each server's ``/server_info`` with what this source needs (fields a server does not report are
        checked on the replies instead).

        Raises:
            ServedFeaturesError: capture mode off, other capture layers, or the server unreachable.
        """
        self._need_urls()
        info: dict[str, Any] = {}
        for url in self.urls:
            info = self._server_info(url)
            if info.get("enable_return_aux_hidden_states") is False:
                raise ServedFeaturesError(
                    f"{url} was not launched in aux-capture mode; relaunch it with "
                    f"{' '.join(self.aux_capture(max_row_tokens).server_args('sglang'))}"
                )
            served = info.get("aux_capture_ids")
            if served is None and info.get("enable_return_aux_hidden_states"):
                # a server launched with DFLASH / DSPARK as its capture convention adds 1 to every id
                rule = capture_rule(self.target_config, info.get("aux_hidden_state_capture"))
                served = capture_ids_from_flag(info.get("return_aux_hidden_state_layer_ids"), self.num_layers, rule)
            if served is not None and sorted(served) != self.capture_ids:
                raise ServedFeaturesError(
                    f"{url} captures layers {sorted(served)} (--return-aux-hidden-state-layer-ids "
                    f"{info.get('return_aux_hidden_state_layer_ids')}), but the drafter is trained on capture ids "
                    f"{self.capture_ids}; relaunch with {' '.join(self.aux_capture().server_args('sglang'))}"
                )
            chunk = info.get("chunked_prefill_size")
            if max_row_tokens and isinstance(chunk, int) and 0 < chunk < max_row_tokens:
                self.stats.notes.append(
                    f"{url}: --chunked-prefill-size {chunk} < longest row {max_row_tokens}: SGLang returns only the "
                    "last chunk's hidden states, so longer rows will be refused (relaunch with a larger size)"
                )
        self._checked = True
        return info

    def _server_info(self, url: str) -> dict[str, Any]:
        import aiohttp

        last: BaseException | None = None
        for path in ("/server_info", "/get_server_info"):
            try:
                body = run_sync(self.client.get_json(path, url))
                return body if isinstance(body, dict) else {}
            except aiohttp.ClientResponseError as exc:
                last = exc
                if exc.status in (401, 403):
                    raise ServedFeaturesError(f"{url}{path}: HTTP {exc.status}; set training.features.api_key_env")
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                last = exc
        if isinstance(last, aiohttp.ClientResponseError):
            return {}  # a server without the endpoint: the replies are checked instead
        raise ServedFeaturesError(f"cannot reach {url}: {self.client.redact(str(last))}")

    # ----------------------------------------------------------------------------------------- one request
    def reply_cap(self, row_tokens: int) -> int:
        """The most bytes a reply to one request for a row of ``row_tokens`` tokens may have (the client refuses a
        larger one as ``reply_too_large``).

        ``REPLY_BASE_BYTES + T * (W * JSON_FLOAT_MAX_BYTES + (K + 1) * LOGPROB_ENTRY_MAX_BYTES +
        REPLY_TOKEN_MARGIN_BYTES)`` with ``T`` = ``row_tokens``, ``W`` = capture layers x hidden size (the values of
        one token's hidden-state row), ``K`` = the top logprobs asked for per position (``input_top_logprobs``)
        plus one ``input_token_logprobs`` entry. The largest JSON text of each part bounds it (constants above), so
        a genuine reply never reaches it. Measured on the embedded server (8-layer demo target, W = 384, float32
        values at 19.4-19.5 bytes each): replies of 16 / 64 / 256 tokens are 127 kB / 508 kB / 2.03 MB (hard
        teacher; 2.57 MB with K = 64), their caps 9.6x / 3.4x / 1.8x that; for long rows it tends to 25 / 19.5.
        """
        k = self.settings.top_k if self.settings.teacher == "topk" else 1
        per_token = (self.spec.width * JSON_FLOAT_MAX_BYTES + (k + 1) * LOGPROB_ENTRY_MAX_BYTES
                     + REPLY_TOKEN_MARGIN_BYTES)
        return REPLY_BASE_BYTES + max(1, int(row_tokens)) * per_token

    def request_body(self, input_ids: np.ndarray, rid: str) -> bytes:
        """The ``/generate`` body for one row (see the module docstring)."""
        k = self.settings.top_k if self.settings.teacher == "topk" else 1
        return GenerateRequest(input_ids=input_ids.tolist(), sampling_params=SamplingParams(max_new_tokens=1,
                               temperature=0.0), rid=rid, return_hidden_states=True, return_logprob=True,
                               logprob_start_len=0, top_logprobs_num=k).to_bytes()

    def _add(self, **counts: int) -> None:
        with self._stats_lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def fetch_row(self, row_id: str, input_ids: np.ndarray, loss_mask: np.ndarray) -> RowFeatures | RefusedRow:
        """Features of one row, or the reason its reply was refused.

        Raises:
            ServedFeaturesError: a server-level problem (see the class doc).
        """
        return next(self.fetch([(row_id, input_ids, loss_mask)]))

    def _parse(self, rows: dict[str, tuple[np.ndarray, np.ndarray]], rid: str, raw: bytes) -> RowFeatures:
        """The client's reply check: an unusable reply raises ``ReplyError`` (retried, then a refused row)."""
        self._add(reply_bytes=len(raw))
        ids, mask = rows[rid]
        try:
            return self.parse_features_reply(rid, ids, mask, raw)
        except ReplyRefused as r:
            raise ReplyError(r.reason, r.detail) from None
        except RecursionError:
            # the last guard: a value nested deeper than the interpreter recurses is one refused row, not an
            # exception that stops the whole source
            raise ReplyError("bad_json", "reply nests arrays or objects deeper than any /generate reply") from None

    def _outcome(self, rid: str, got: RowFeatures | GenerateFailure) -> RowFeatures | RefusedRow:
        """A row's features, or its refusal; a failure no other row could escape raises ServedFeaturesError."""
        if not isinstance(got, GenerateFailure):
            return got
        relaunch = " ".join(self.aux_capture().server_args("sglang"))
        if got.kind in ("unauthorized", "not_found"):
            raise ServedFeaturesError(f"{got.last_error} (row {rid})")
        if got.kind == "bad_request" and ("hidden states" in got.last_error or "hidden_states" in got.last_error):
            raise ServedFeaturesError(f"the server refuses hidden states ({got.last_error}); relaunch it with "
                                      f"{relaunch}")
        if got.kind in ("connection", "timeout", "http_429", "http_5xx"):
            raise ServedFeaturesError(f"/generate failed {got.attempts} times for row {rid} (last: "
                                      f"{got.last_error}); is the server up?")
        return RefusedRow(rid, got.kind, f"{got.last_error} ({got.attempts} attempts)")

    def parse_features_reply(self, row_id: str, input_ids: np.ndarray, loss_mask: np.ndarray,
                             raw: bytes) -> RowFeatures:
        """Check a ``/generate`` reply and turn it into :class:`RowFeatures`.

        Raises:
            ReplyRefused: the row's reply is unusable (abort, short block, non-finite, malformed logprobs, not JSON,
                values of the wrong type or range); nothing else escapes for any body.
            ServedFeaturesError: a reply no row could pass (no hidden states, wrong width).
        """
        import orjson

        try:
            reply = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ReplyRefused("bad_json", f"reply is not JSON: {exc}") from None
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        meta = reply.get("meta_info") if isinstance(reply, dict) else None
        if not isinstance(meta, dict):
            raise ReplyRefused("bad_reply", "reply has no meta_info object")
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            message = finish.get("message", finish)
            raise ReplyRefused("abort", clip_text(message, 300) if isinstance(message, str)
                               else show_value(message, 300))
        t = int(input_ids.size)
        if t < 2:
            raise ReplyRefused("too_short", f"a {t}-token row has no position to teach")
        hs = meta.get("hidden_states")
        if hs is None:
            raise ServedFeaturesError(
                "the reply has no meta_info.hidden_states: the server ignores return_hidden_states (not SGLang's "
                "/generate, or a proxy dropped the field)"
            )
        if not isinstance(hs, list):
            raise ReplyRefused("bad_hidden_states", f"meta_info.hidden_states is not a list: {show_value(hs, 80)}")
        if not hs:
            raise ServedFeaturesError(
                "meta_info.hidden_states is empty: SGLang returns [] for max_new_tokens 0 (finished_len 0); this "
                "source sends max_new_tokens 1, so the server or a proxy changed the request"
            )
        try:
            block = np.asarray(hs[0], dtype=np.float32)  # JSON null (a non-finite value) becomes NaN
        except (TypeError, ValueError, OverflowError):
            raise ReplyRefused("bad_hidden_states", "meta_info.hidden_states[0] is not a [T][W] block") from None
        if block.ndim != 2:
            raise ReplyRefused("bad_hidden_states", f"meta_info.hidden_states[0] has shape {block.shape}, not [T, W]")
        if block.shape[1] != self.spec.width:
            raise ServedFeaturesError(
                f"the server returns {block.shape[1]} values per token, but {len(self.capture_ids)} capture layers "
                f"x hidden {self.hidden_size} = {self.spec.width}: it captures a different number of layers (or "
                "serves another model)"
            )
        if block.shape[0] != t:
            why = ("the server's prefix cache served part of the prompt or chunked prefill split it (SGLang keeps "
                   "only the last chunk's hidden states): launch with --disable-radix-cache and "
                   f"--chunked-prefill-size >= {t}") if block.shape[0] < t else "more rows than prompt tokens"
            raise ReplyRefused("short_prefill" if block.shape[0] < t else "long_prefill",
                           f"{block.shape[0]} hidden-state rows for a {t}-token row: {why}")
        if not np.isfinite(block).all():
            raise ReplyRefused("non_finite", f"{int((~np.isfinite(block)).sum())} non-finite aux values")
        q = teacher_positions(loss_mask)
        greedy_row = input_ids[q + 1]
        top = meta.get("input_top_logprobs")
        if not isinstance(top, list) or len(top) != t:
            raise ReplyRefused("bad_logprobs", f"input_top_logprobs has {len(top) if isinstance(top, list) else 0} "
                                           f"entries for {t} tokens (logprob_start_len 0 ignored?)")
        k = self.spec.top_k
        out_ids = reply.get("output_ids")
        if (not isinstance(out_ids, list) or len(out_ids) != 1 or type(out_ids[0]) is not int
                or not 0 <= out_ids[0] < self.vocab_size):
            raise ReplyRefused("bad_reply", f"output_ids {show_value(out_ids, 80)} is not the one greedy token of the "
                                            f"target vocab [0, {self.vocab_size}) asked for")
        try:
            # every position's top-K (entry p + 1 predicts token p + 1): the teacher and the greedy ids
            lp_all = np.array([[e[0] for e in entry[:k]] for entry in top[1:]], dtype=np.float32).reshape(t - 1, -1)
            ids_all = np.array([[e[1] for e in entry[:k]] for entry in top[1:]], dtype=np.int64).reshape(t - 1, -1)
        except (TypeError, LookupError, ValueError, OverflowError):  # a dict entry, an id past int64, ...
            raise ReplyRefused("bad_logprobs",
                           "input_top_logprobs entries are not [[logprob, token_id, text], ..]") from None
        if (lp_all.shape[1] != k or np.isnan(lp_all).any() or (ids_all < 0).any()
                or (ids_all >= self.vocab_size).any()):
            raise ReplyRefused("bad_logprobs",
                               f"input_top_logprobs entries hold {lp_all.shape[1]} of {k} usable values")
        target_greedy = np.empty(t, dtype=np.int64)
        target_greedy[:-1] = ids_all[np.arange(t - 1), lp_all.argmax(axis=1)]
        target_greedy[-1] = out_ids[0]  # temperature 0: the sampled token is the last position's greedy id
        lp, ids = lp_all[q], ids_all[q]
        server_greedy = target_greedy[q]
        if self.spec.teacher == "hard":
            self._add(hard_label_disagreements=int((server_greedy != greedy_row).sum()))
            teacher_ids = greedy_row[:, None]
            teacher_lp = np.zeros((len(q), 1), dtype=np.float32)
            greedy = greedy_row
        else:
            teacher_ids, teacher_lp, greedy = ids, lp, server_greedy
        self._add(teacher_positions=int(len(q)))
        return RowFeatures(
            row_id=row_id, input_ids=input_ids, aux_hidden=torch.from_numpy(block), teacher_positions=q,
            teacher_ids=torch.from_numpy(np.ascontiguousarray(teacher_ids)),
            teacher_logprobs=torch.from_numpy(np.ascontiguousarray(teacher_lp)),
            greedy=torch.from_numpy(np.ascontiguousarray(greedy)),
            target_greedy=target_greedy,
        )

    # ------------------------------------------------------------------------------------------- many rows
    def fetch(self, items: Iterable[tuple[str, np.ndarray, np.ndarray]]) -> Iterator[RowFeatures | RefusedRow]:
        """Features of ``(row_id, input_ids, loss_mask)`` items, in order, through the serving client
        (:meth:`~eagle_assets.serving.client.GenerateClient.post_many`): ``concurrency`` requests in flight per
        server, items taken ``concurrency x servers`` at a time, so at most that many replies are held at once.
        Row ids must be unique within one call."""
        if not self._checked:
            self.check_server()
        window = self.settings.concurrency * len(self.urls)
        chunk: list[tuple[str, np.ndarray, np.ndarray]] = []
        for item in items:
            chunk.append(item)
            if len(chunk) >= window:
                yield from self._fetch_chunk(chunk)
                chunk = []
        if chunk:
            yield from self._fetch_chunk(chunk)

    def _fetch_chunk(self, chunk: list[tuple[str, np.ndarray, np.ndarray]]) -> Iterator[RowFeatures | RefusedRow]:
        t0 = time.perf_counter()
        rows = {str(rid): (ids, mask) for rid, ids, mask in chunk}
        if len(rows) != len(chunk):
            raise ValueError("served features need unique row ids within one fetch")
        bodies = [(str(rid), self.request_body(ids, str(rid))) for rid, ids, _ in chunk]
        try:
            # one cap for the batch, from its longest row: the bound on memory is concurrency x that cap
            cap = self.reply_cap(max(int(ids.size) for _, ids, _ in chunk))
            got = self.client.post_all(bodies, lambda rid, raw: self._parse(rows, rid, raw), max_reply_bytes=cap)
        finally:
            stats = self.client.last_stats
            if stats is not None:
                self._add(requests=stats.attempts, retries=stats.retries)
            self.stats.seconds += time.perf_counter() - t0
        self.stats.tokens += sum(int(ids.size) for _, ids, _ in chunk)
        for (rid, _, _), result in zip(chunk, got):
            yield self._count(self._outcome(str(rid), result))

    def _count(self, got: RowFeatures | RefusedRow) -> RowFeatures | RefusedRow:
        if isinstance(got, RefusedRow):
            self.stats.refused[got.reason] += 1
            self.log(f"served features: row {got.row_id} refused ({got.reason}): {got.detail}")
        else:
            self.stats.rows_ok += 1
        return got


class ReplyRefused(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _cfg(config: Any, name: str) -> Any:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    if value is None:
        raise ServedFeaturesError(f"the target config has no {name}")
    return value
