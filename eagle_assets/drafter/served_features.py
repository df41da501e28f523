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
renormalized over the draft vocab by :func:`served_supervision`. With ``K`` at least the vocab size this is exactly
the local teacher (the target softmax restricted to the draft vocab).

Sizes (why this is built for bounded memory): a reply carries ``T * W`` floats as JSON text, 10-20 bytes each
(about 11 for bfloat16 values, 19-21 for float32/float64 ones), against 2 bytes per value in a bfloat16 shard. Rows
are fetched ``concurrency`` per server at a time, parsed with orjson straight into float32 arrays, and written shard
by shard (:mod:`eagle_assets.drafter.feature_shards`); docs/served_features.md has the worked Kimi-K2.5 numbers.

Transport: the serving client (:meth:`eagle_assets.serving.client.GenerateClient.post_many`) sends the requests, so
HTTP, retries, backoff, server choice and API-key redaction have one implementation: connection errors, timeouts,
HTTP 408/429/5xx and unusable replies (a short block, a non-finite value, malformed logprobs, ...) are retried up to
``max_attempts``; a row whose replies stay unusable, or that the server refuses (HTTP 400), becomes a
:class:`RefusedRow` with the reason; transport failures that outlast the attempts, 401/403/404 and a server that
refuses hidden states raise :class:`ServedFeaturesError` (no row could succeed).
"""

from __future__ import annotations

import json
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
from eagle_assets.drafter.feature_shards import (
    FeatureShardError,
    FeatureSpec,
    RowFeatures,
    ShardIndex,
    plan_shards,
    read_rows,
    row_key,
    shard_name,
    verify_shard,
    write_shard,
)
from eagle_assets.drafter.ttt_loss import Supervision, teacher_positions
from eagle_assets.serving.aux_capture import (
    AuxCapture,
    capture_convention,
    capture_flag_ids,
    capture_ids_from_flag,
    num_layers_of,
    text_config,
)
from eagle_assets.serving.client import GenerateClient, normalize_url, run_sync
from eagle_assets.serving.protocol import GenerateFailure, ReplyError

Row = Any  # (input_ids, loss_mask) pair, or an object with .ids and .mask (feature_cache.PreparedRow)


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


def _row_arrays(row: Row) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(row, "ids") and hasattr(row, "mask"):
        return np.asarray(row.ids, dtype=np.int64), np.asarray(row.mask).astype(np.int8)
    ids, mask = row
    return np.asarray(ids, dtype=np.int64), np.asarray(mask).astype(np.int8)


def _load_config(target: Any) -> Any:
    if isinstance(target, (str, Path)):
        path = Path(target) / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ServedFeaturesError(f"cannot read the target config {path}: {exc}") from None
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
                served = capture_ids_from_flag(info.get("return_aux_hidden_state_layer_ids"), self.num_layers,
                                               self.convention)
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
    def request_body(self, input_ids: np.ndarray, rid: str) -> bytes:
        """The ``/generate`` body for one row (see the module docstring)."""
        k = self.settings.top_k if self.settings.teacher == "topk" else 1
        body = {
            "rid": rid,
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_hidden_states": True,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": k,
        }
        return json.dumps(body).encode()

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
            return self.parse_reply(rid, ids, mask, raw)
        except _Refused as r:
            raise ReplyError(r.reason, r.detail) from None

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

    def parse_reply(self, row_id: str, input_ids: np.ndarray, loss_mask: np.ndarray, raw: bytes) -> RowFeatures:
        """Check a ``/generate`` reply and turn it into :class:`RowFeatures`.

        Raises:
            _Refused: the row's reply is unusable (abort, short block, non-finite, malformed logprobs).
            ServedFeaturesError: a reply no row could pass (no hidden states, wrong width).
        """
        import orjson

        try:
            reply = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _Refused("bad_json", f"reply is not JSON: {exc}") from None
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        meta = reply.get("meta_info") if isinstance(reply, dict) else None
        if not isinstance(meta, dict):
            raise _Refused("bad_reply", "reply has no meta_info object")
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise _Refused("abort", str(finish.get("message", finish))[:300])
        t = int(input_ids.size)
        if t < 2:
            raise _Refused("too_short", f"a {t}-token row has no position to teach")
        hs = meta.get("hidden_states")
        if hs is None:
            raise ServedFeaturesError(
                "the reply has no meta_info.hidden_states: the server ignores return_hidden_states (not SGLang's "
                "/generate, or a proxy dropped the field)"
            )
        if not hs:
            raise ServedFeaturesError(
                "meta_info.hidden_states is empty: SGLang returns [] for max_new_tokens 0 (finished_len 0); this "
                "source sends max_new_tokens 1, so the server or a proxy changed the request"
            )
        try:
            block = np.asarray(hs[0], dtype=np.float32)  # JSON null (a non-finite value) becomes NaN
        except (TypeError, ValueError):
            raise _Refused("bad_hidden_states", "meta_info.hidden_states[0] is not a [T][W] block") from None
        if block.ndim != 2:
            raise _Refused("bad_hidden_states", f"meta_info.hidden_states[0] has shape {block.shape}, not [T, W]")
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
            raise _Refused("short_prefill" if block.shape[0] < t else "long_prefill",
                           f"{block.shape[0]} hidden-state rows for a {t}-token row: {why}")
        if not np.isfinite(block).all():
            raise _Refused("non_finite", f"{int((~np.isfinite(block)).sum())} non-finite aux values")
        q = teacher_positions(loss_mask)
        greedy_row = input_ids[q + 1]
        top = meta.get("input_top_logprobs")
        if not isinstance(top, list) or len(top) != t:
            raise _Refused("bad_logprobs", f"input_top_logprobs has {len(top) if isinstance(top, list) else 0} "
                                           f"entries for {t} tokens (logprob_start_len 0 ignored?)")
        k = self.spec.top_k
        out_ids = reply.get("output_ids")
        if not isinstance(out_ids, list) or len(out_ids) != 1 or type(out_ids[0]) is not int:
            raise _Refused("bad_reply", f"output_ids {str(out_ids)[:80]} is not the one greedy token asked for")
        try:
            # every position's top-K (entry p + 1 predicts token p + 1): the teacher and the greedy ids
            lp_all = np.array([[e[0] for e in entry[:k]] for entry in top[1:]], dtype=np.float32).reshape(t - 1, -1)
            ids_all = np.array([[e[1] for e in entry[:k]] for entry in top[1:]], dtype=np.int64).reshape(t - 1, -1)
        except (TypeError, IndexError, ValueError):
            raise _Refused("bad_logprobs",
                           "input_top_logprobs entries are not [[logprob, token_id, text], ..]") from None
        if (lp_all.shape[1] != k or np.isnan(lp_all).any() or (ids_all < 0).any()
                or (ids_all >= self.vocab_size).any()):
            raise _Refused("bad_logprobs", f"input_top_logprobs entries hold {lp_all.shape[1]} of {k} usable values")
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
            got = self.client.post_all(bodies, lambda rid, raw: self._parse(rows, rid, raw))
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


class _Refused(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _cfg(config: Any, name: str) -> Any:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    if value is None:
        raise ServedFeaturesError(f"the target config has no {name}")
    return value


# ------------------------------------------------------------------------------------------ the integration point
def served_features(
    rows: Sequence[Row],
    source: ServedFeatureSource,
    *,
    row_ids: Sequence[str] | None = None,
    cache_dir: str | Path | None = None,
    worker: int = 0,
    workers: int = 1,
) -> Iterator[RowFeatures | RefusedRow]:
    """Served features of ``rows``, in order: the integration point for the trainer.

    Args:
        rows: ``(input_ids, loss_mask)`` pairs (int ``[T]``, 0/1 ``[T]``) or ``PreparedRow`` objects, already cut
            to the trainer's ``max_length`` (features of a prefix do not depend on what follows, so cut first).
        source: a :class:`ServedFeatureSource` (server URL(s), teacher, capture ids).
        row_ids: ids for the rows (default their positions, as strings).
        cache_dir: None = stream (nothing stored); a directory = verified shards there, fetched only when absent
            or refused (refusals are counted in ``source.stats.shards_refused`` and the file is replaced).
        worker / workers: with ``cache_dir``, handle only shards ``worker, worker + workers, ..`` of the plan, so
            ``workers`` processes fill one cache together (parsing JSON holds the GIL: one process parses about
            one core's worth, see docs/served_features.md); a later call with the defaults reads them all.

    Yields:
        :class:`RowFeatures` (aux float32 ``[T, W]``, teacher ids/logprobs ``[N, K]``, greedy ``[N]``) or a
        :class:`RefusedRow` (the row is left out; never fatal). At most one shard plus ``concurrency`` replies per
        server are held at once.

    Raises:
        ServedFeaturesError: the server cannot give features at all.
    """
    arrays = [_row_arrays(r) for r in rows]
    ids = [str(i) for i in range(len(arrays))] if row_ids is None else [str(r) for r in row_ids]
    if len(ids) != len(arrays):
        raise ValueError(f"{len(ids)} row_ids for {len(arrays)} rows")
    if cache_dir is None:
        yield from source.fetch((rid, a, m) for rid, (a, m) in zip(ids, arrays))
        return
    if not 0 <= worker < workers:
        raise ValueError(f"worker must be in [0, {workers}), got {worker}")
    store = ShardedFeatures(cache_dir, source)
    for rng in store.plan([a.size for a, _ in arrays])[worker::workers]:
        yield from store.shard(rng, ids, arrays)


class ShardedFeatures:
    """A directory of verified feature shards for one :class:`ServedFeatureSource` (see :func:`served_features`).

    A shard's file name is derived from the spec and the rows' :func:`~eagle_assets.drafter.feature_shards.row_key`
    values, so a rerun over the same rows reuses it and any change of rows or spec fetches anew.
    """

    def __init__(self, cache_dir: str | Path, source: ServedFeatureSource):
        self.dir = Path(cache_dir)
        self.source = source
        self.index_at: dict[int, ShardIndex] = {}  # first row of a planned range -> its verified shard

    def plan(self, lengths: Sequence[int]) -> list[range]:
        return plan_shards(lengths, self.source.spec.width, int(self.source.settings.shard_mb * (1 << 20)))

    def shard(self, rng: range, ids: Sequence[str], arrays: Sequence[tuple[np.ndarray, np.ndarray]]
              ) -> Iterator[RowFeatures | RefusedRow]:
        """The rows of ``rng``: read from their shard when it verifies, else fetched and written."""
        keys = [row_key(*arrays[i]) for i in rng]
        path = self.dir / shard_name(self.source.spec, keys)
        stats = self.source.stats
        if path.exists():
            try:
                index = verify_shard(path, self.source.spec)
                if set(index.row_keys) | set(index.quarantined) != set(keys):
                    raise FeatureShardError(f"feature shard {path} holds other rows than its name says")
                stats.shards_reused += 1
                self.index_at[rng.start] = index
                by_key = dict(zip(index.row_keys, read_rows(index)))
                for i, key in zip(rng, keys):
                    if key in by_key:
                        stats.rows_ok += 1
                        feats = by_key[key]
                        feats.row_id = ids[i]
                        yield feats
                    else:
                        reason = index.quarantined[key]
                        stats.refused[reason.split(":")[0]] += 1
                        yield RefusedRow(ids[i], reason.split(":")[0], reason)
                return
            except FeatureShardError as exc:
                reason = str(exc)
                stats.shards_refused[_shard_reason(reason)] += 1
                stats.notes.append(reason)
                self.source.log(f"served features: {reason}")
        got: list[RowFeatures] = []
        masks: list[np.ndarray] = []
        quarantined: dict[str, str] = {}
        for i, key, feats in zip(rng, keys, self.source.fetch((ids[i], *arrays[i]) for i in rng)):
            if isinstance(feats, RefusedRow):
                quarantined[key] = f"{feats.reason}: {feats.detail}"
            else:
                got.append(feats)
                masks.append(arrays[i][1])
            yield feats
        if got or quarantined:
            write_shard(path, self.source.spec, got, masks, quarantined)
            stats.shards_written += 1
            self.index_at[rng.start] = verify_shard(path, self.source.spec)


def _shard_reason(message: str) -> str:
    for needle, reason in (("hash mismatch", "hash_mismatch"), ("non-finite", "non_finite"),
                           ("capture layers", "layer_ids"), ("different feature spec", "spec"),
                           ("cannot be read", "unreadable"), ("format", "format")):
        if needle in message:
            return reason
    return "invalid"


# --------------------------------------------------------------------------------------- what the trainer calls
def target_to_draft_index(draft_token_ids: np.ndarray, target_vocab_size: int) -> torch.Tensor:
    """int64 ``[V]``: the draft id of each target id, -1 outside the draft vocab."""
    index = np.full(int(target_vocab_size), -1, dtype=np.int64)
    index[np.asarray(draft_token_ids, dtype=np.int64)] = np.arange(len(draft_token_ids), dtype=np.int64)
    return torch.from_numpy(index)


def served_supervision(teachers: Sequence[np.ndarray], feats: Sequence[RowFeatures], in_draft: torch.Tensor,
                       draft_index: torch.Tensor) -> Supervision:
    """The :class:`~eagle_assets.drafter.ttt_loss.Supervision` of a batch from served teachers: the same object
    ``ttt_loss.supervision`` builds from the target's lm_head, so ``ttt_loss`` runs unchanged.

    ``teacher_p`` is the teacher's probability mass on the draft vocab, renormalized: for ``topk`` the
    ``exp(logprob)`` of the top-K ids that are in the draft vocab (with K >= vocab this is exactly the local
    ``softmax(lm_head[draft rows] @ h)``); for ``hard`` a one-hot on the row's token. Positions whose ``greedy`` id
    is outside the draft vocab are dropped and counted, as in the local path.

    Args:
        teachers: per row of the batch, its teacher positions int64 ``[N_b]`` (``PreparedRow.teacher``); they must
            equal the features' ``teacher_positions`` (same rows, same cut).
        feats: per row, its :class:`RowFeatures`.
        in_draft: bool ``[V]`` (``DraftVocab.t2d``); draft_index: :func:`target_to_draft_index`.

    Raises:
        ValueError: teacher positions that differ from the features' (features of another row or another cut).
    """
    rows, positions, probs, greedy = [], [], [], []
    dropped = 0
    n_draft = int(in_draft.sum())
    for b, (teacher, f) in enumerate(zip(teachers, feats)):
        if not np.array_equal(np.asarray(teacher), f.teacher_positions):
            raise ValueError(f"row {f.row_id}: the trainer's teacher positions differ from its served features'")
        keep = in_draft[f.greedy]
        dropped += int((~keep).sum())
        ids = f.teacher_ids[keep]
        p = torch.exp(f.teacher_logprobs[keep].double())
        slot = draft_index[ids]
        dense = torch.zeros((ids.shape[0], n_draft), dtype=torch.float64)
        dense.scatter_add_(1, slot.clamp(min=0), torch.where(slot >= 0, p, torch.zeros_like(p)))
        dense /= dense.sum(dim=1, keepdim=True)
        probs.append(dense.float())
        q = torch.from_numpy(np.asarray(teacher, dtype=np.int64))[keep]
        rows.append(torch.full_like(q, b))
        positions.append(q)
        greedy.append(f.greedy[keep])
    return Supervision(torch.cat(rows), torch.cat(positions), torch.cat(probs), torch.cat(greedy), dropped)


class ServedFeatureCache:
    """The trainer's view of served features, shaped like ``feature_cache.FeatureCache``: ``get(batch)`` gives per
    row ``(aux [T, W], RowFeatures, greedy [N])`` and :meth:`supervision` replaces ``ttt_loss.supervision``.

    Args:
        rows: the trainer's prepared rows (``.ids``, ``.mask``, ``.teacher``), already cut.
        source: the :class:`ServedFeatureSource`.
        cache: ``disk`` (shards under ``cache_dir``, rows read back one by one: bounded memory), ``memory`` (all
            rows held) or ``none`` (every :meth:`get` fetches its rows: nothing stored).
        draft_token_ids / target_vocab_size: the draft vocab (``DraftVocab.draft_token_ids``, ``.target_vocab_size``).

    Rows the server's replies were refused for are listed in :attr:`refused` (index -> reason); the trainer must
    leave them out of its batches (:meth:`usable`).
    """

    #: where ``FeatureCache`` keeps what the trainer computed: nothing here (fetch time is ``source.stats.seconds``)
    cache = None

    def __init__(self, rows: Sequence[Row], source: ServedFeatureSource, cache: str, draft_token_ids: np.ndarray,
                 target_vocab_size: int, cache_dir: str | Path | None = None):
        if cache not in ("disk", "memory", "none"):
            raise ValueError(f"cache must be disk, memory or none, got {cache!r}")
        if cache == "disk" and cache_dir is None:
            raise ValueError("cache='disk' needs a cache_dir")
        self.rows = rows
        self.source = source
        self.mode = cache
        self.draft_index = target_to_draft_index(draft_token_ids, target_vocab_size)
        self.refused: dict[int, str] = {}
        self._memory: dict[int, RowFeatures] = {}
        self._where: dict[int, tuple[ShardIndex, int]] = {}
        self._arrays = [_row_arrays(r) for r in rows]
        if cache == "none":
            return
        ids = [str(i) for i in range(len(rows))]
        if cache == "memory":
            for i, got in enumerate(served_features(rows, source)):
                self._keep(i, got)
            return
        self.store = ShardedFeatures(cache_dir, source)
        for rng in self.store.plan([a.size for a, _ in self._arrays]):
            for got in self.store.shard(rng, ids, self._arrays):
                if isinstance(got, RefusedRow):
                    self.refused[int(got.row_id)] = got.reason
                del got  # only the shard's index is kept; rows are read back when trained on
            index = self.store.index_at.get(rng.start)
            if index is None:
                continue
            pos_of = {key: pos for pos, key in enumerate(index.row_keys)}
            for i in rng:
                key = row_key(*self._arrays[i])
                if key in pos_of:
                    self._where[i] = (index, pos_of[key])

    def _keep(self, i: int, got: RowFeatures | RefusedRow) -> None:
        if isinstance(got, RefusedRow):
            self.refused[i] = got.reason
        else:
            self._memory[i] = got

    def usable(self) -> list[int]:
        """Indices of the rows that have features."""
        return [i for i in range(len(self.rows)) if i not in self.refused]

    def subset(self, indices: Sequence[int]) -> "ServedFeatureCache":
        """A view on rows ``indices`` (e.g. :meth:`usable`), renumbered ``0..len - 1``, sharing the fetched
        features: build the trainer's batches over ``[rows[i] for i in indices]`` and ask this view."""
        view = object.__new__(ServedFeatureCache)
        view.rows = [self.rows[i] for i in indices]
        view.source, view.mode, view.draft_index = self.source, self.mode, self.draft_index
        view._arrays = [self._arrays[i] for i in indices]
        view.refused = {n: self.refused[i] for n, i in enumerate(indices) if i in self.refused}
        view._memory = {n: self._memory[i] for n, i in enumerate(indices) if i in self._memory}
        view._where = {n: self._where[i] for n, i in enumerate(indices) if i in self._where}
        return view

    def get(self, batch: Sequence[int]) -> list[tuple[torch.Tensor, RowFeatures, torch.Tensor]]:
        """Features of the rows ``batch`` (indices into ``rows``), in that order.

        Raises:
            KeyError: a refused row was asked for.
        """
        refused = [i for i in batch if i in self.refused]
        if refused:
            raise KeyError(f"rows {refused} have no served features ({[self.refused[i] for i in refused]})")
        if self.mode == "memory":
            feats = [self._memory[i] for i in batch]
        elif self.mode == "disk":
            by_shard: dict[int, list[int]] = {}
            for i in batch:
                by_shard.setdefault(id(self._where[i][0]), []).append(i)
            got: dict[int, RowFeatures] = {}
            for members in by_shard.values():  # one open per shard the batch touches
                index = self._where[members[0]][0]
                for i, f in zip(members, read_rows(index, [self._where[i][1] for i in members])):
                    got[i] = f
            feats = [got[i] for i in batch]
        else:
            feats = []
            for i, got in zip(batch, self.source.fetch((str(i), *self._arrays[i]) for i in batch)):
                if isinstance(got, RefusedRow):
                    self.refused[i] = got.reason
                    raise KeyError(f"row {i} has no served features ({got.reason}: {got.detail})")
                feats.append(got)
        return [(f.aux_hidden, f, f.greedy) for f in feats]

    def supervision(self, teachers: Sequence[np.ndarray], feats: Sequence[tuple[torch.Tensor, RowFeatures,
                    torch.Tensor]], in_draft: torch.Tensor) -> Supervision:
        """``ttt_loss.supervision`` for served features (see :func:`served_supervision`)."""
        return served_supervision(teachers, [f[1] for f in feats], in_draft, self.draft_index)


def read_target_tensor(model_dir: str | Path, suffix: str = "embed_tokens.weight") -> torch.Tensor:
    """One weight of a safetensors checkpoint, read without building the model (the drafter needs only the
    target's input embedding ``[V, H]`` when its features are served).

    The tensor is the single name ending in ``suffix`` (DeepSeek-V3 ``model.embed_tokens.weight``, Kimi-K2.5
    ``language_model.model.embed_tokens.weight``), found through ``model.safetensors.index.json`` or in
    ``model.safetensors``; only its shard is opened.

    Raises:
        FileNotFoundError: no safetensors checkpoint in ``model_dir``.
        KeyError: no tensor, or several, end in ``suffix``.
    """
    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            weight_map = {name: "model.safetensors" for name in f.keys()}
    else:
        raise FileNotFoundError(f"{root} has no model.safetensors(.index.json)")
    names = [n for n in weight_map if n == suffix or n.endswith("." + suffix)]
    if len(names) != 1:
        raise KeyError(f"{root}: {len(names)} tensors end in {suffix!r} ({names[:4]}); pass a longer suffix")
    with safe_open(str(root / weight_map[names[0]]), framework="pt") as f:
        return f.get_tensor(names[0])
