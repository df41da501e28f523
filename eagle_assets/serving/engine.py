"""Continuous batched decoding of a local transformers causal LM, the compute side of the embedded server.

One background thread owns the model. It takes queued requests, prefills them together (left padded, sorted by
length, in chunks of at most ``max_prefill_tokens`` padded tokens), then runs ONE forward per decode step for every
running sequence. New requests join the running batch between steps (their KV cache is left padded to the running
length and concatenated on the batch axis) and finished sequences leave it, so a long answer does not hold back
short ones. Columns that are padding for every remaining row are trimmed from the cache.

Batch invariance: a row's result must not depend on which other rows share its batch (the pipeline resumes and
retries requests in different company). Left padding is neutralised by the 2D attention mask and by explicit
``position_ids`` (each row counts positions from its own first real token), but float32 kernels still round
differently for different batch shapes (about 5e-7 on logits in our measurements), which can flip a greedy argmax
at a near tie. ``resolve_dtype("auto")`` therefore runs CPU models of up to 1e9 parameters in float64, where the
batch-to-single difference is about 1e-15; ``eagle_assets_tests/test_serving_engine.py`` asserts identical ids.

Finish rules follow SGLang's ``Req.check_finished`` (``python/sglang/srt/managers/schedule_batch.py``): the length
cap is tested first, then the stop ids (request ``stop_token_ids`` plus the model's EOS ids) unless ``ignore_eos``;
the matched id stays in ``output_ids``.

Caches whose layers are not plain ``DynamicLayer`` (sliding-window or linear-attention models) cannot be padded and
merged safely, so those models run in static mode: a batch is admitted only when the previous one has finished.

Hidden states and logprobs (SGLang's ``return_hidden_states`` / ``return_logprob``): with ``hidden_states`` set the
engine records, for requests that ask, one row per fed token: the whole prompt at prefill (one ``[T, W]`` block;
padding removed) and the fed token at each decode step, as SGLang's scheduler does
(``scheduler_components/batch_result_processor.py``). ``W`` is ``k * H`` for aux capture (the inputs of the capture
layers, :class:`~eagle_assets.serving.aux_capture.HiddenStateTap`) or ``H`` for the final-normed state. Input
logprobs come from the final-normed prompt states through the lm_head, computed only for the asked positions.
A ``prefill_only`` request (SGLang's ``max_new_tokens: 0``) runs its prefill and finishes with
``{"type": "length", "length": 0}`` and no output ids.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from eagle_assets.serving.aux_capture import AuxCaptureError, HiddenStateTap
from eagle_assets.serving.protocol import SamplingParams

log = logging.getLogger(__name__)

FLOAT64_MAX_PARAMS = 1_000_000_000


@dataclass
class EngineRequest:
    """One sequence to generate.

    Attributes:
        rid: request id (echoed as ``meta_info.id``).
        input_ids: prompt ids, non-empty, each in ``[0, vocab)`` (the server validates before submitting).
        params: sampling parameters; ``max_new_tokens`` already capped to the context window.
        on_done: called once, FROM THE ENGINE THREAD, with the ``EngineResult``; not called if ``cancelled``.
        arrival: ``time.monotonic()`` at arrival, for ``e2e_latency``.
        cancelled: set (from any thread) when nobody waits for the result any more; the row is dropped.
        hidden: ``"full"`` (every fed token's row), ``"last"`` (only the latest) or None: SGLang's
            ``return_hidden_states`` True / ``"last"`` / False. Needs an engine built with ``hidden_states``.
        prefill_only: run the prefill only (SGLang's ``max_new_tokens: 0``); ``params.max_new_tokens`` is ignored.
        logprob_start: absolute prompt position input logprobs start at (SGLang's resolved ``logprob_start_len``;
            ``len(input_ids)`` = output logprobs only), or None for no logprobs at all.
        top_logprobs: top-k entries per logprob position (SGLang's ``top_logprobs_num``; 0 = none).
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[["EngineResult"], None]
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    hidden: str | None = None
    prefill_only: bool = False
    logprob_start: int | None = None
    top_logprobs: int = 0


@dataclass
class EngineResult:
    """Outcome of one ``EngineRequest``; ``finish_reason`` is SGLang's dict form (stop / length / abort).

    Attributes (only for requests that asked for them; CPU tensors in the model's dtype):
        hidden_blocks: ``[prompt block [T, W], then one [W] row per decode step]`` (``"full"``), or the single
            latest row (``"last"``).
        input_logprobs: ``[T - s]`` logprob of prompt token ``s + i`` given the tokens before it; entry 0 is NaN
            (SGLang sends None there). ``input_top``: ``(values [T - s, k], ids [T - s, k])``, row 0 unused.
        output_logprobs / output_top: per output token, its logprob (log_softmax of the raw logits) and the
            top-k ``(values [k], ids [k])`` of that position.
    """

    rid: str
    output_ids: list[int]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    e2e_latency: float
    hidden_blocks: list[torch.Tensor] | None = None
    input_logprobs: torch.Tensor | None = None
    input_top: tuple[torch.Tensor, torch.Tensor] | None = None
    output_logprobs: list[float] | None = None
    output_top: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class EngineStats:
    """Counters since start. ``decode_rows`` sums the batch size of every decode step, so
    ``decode_rows / decode_steps`` is the mean decode batch. Times in seconds."""

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_cancelled: int = 0
    forward_calls: int = 0
    prefill_calls: int = 0
    prefill_rows: int = 0
    max_prefill_batch: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    max_decode_batch: int = 0
    tokens_generated: int = 0
    busy_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["busy_s"] = round(self.busy_s, 4)
        out["mean_decode_batch"] = round(self.decode_rows / self.decode_steps, 3) if self.decode_steps else 0.0
        return out


class _Row:
    """A running sequence: its request, generated ids and, for sampled requests, its own RNG."""

    __slots__ = ("req", "output", "next_token", "stop_ids", "generator", "greedy", "done", "hidden", "in_lp",
                 "in_top", "out_lp", "out_top")

    def __init__(self, req: EngineRequest, eos_ids: frozenset[int], seed_source: torch.Generator):
        self.req = req
        self.output: list[int] = []
        self.next_token = -1
        self.done = False
        self.hidden: list[torch.Tensor] | None = [] if req.hidden else None
        self.in_lp: torch.Tensor | None = None
        self.in_top: tuple[torch.Tensor, torch.Tensor] | None = None
        self.out_lp: list[float] | None = [] if req.logprob_start is not None else None
        self.out_top: list[tuple[torch.Tensor, torch.Tensor]] | None = (
            [] if req.logprob_start is not None and req.top_logprobs > 0 else None
        )
        p = req.params
        self.stop_ids = frozenset() if p.ignore_eos else eos_ids | frozenset(p.stop_token_ids)
        self.greedy = p.greedy
        self.generator: torch.Generator | None = None
        if not self.greedy:
            # A per-request generator makes a seeded request reproducible whatever else shares its batch.
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=seed_source))
            self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor) -> int:
        p = self.req.params
        # sampled on CPU: the per-request generator is a CPU generator whatever the model's device
        probs = sampling_probs(logits.to(device="cpu"), p.temperature, p.top_p, p.top_k)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def record_hidden(self, rows: torch.Tensor) -> None:
        """Keep the hidden-state rows of this forward: ``[n, W]`` at prefill, ``[W]`` at a decode step."""
        if self.hidden is None:
            return
        rows = rows.detach().to("cpu").clone()
        if self.req.hidden == "last":
            self.hidden[:] = [rows[-1] if rows.dim() == 2 else rows]
        else:
            self.hidden.append(rows)

    def record_output_logprob(self, logprobs: torch.Tensor, token: int) -> None:
        """Logprob (and top-k) of the token just sampled from this position's ``[V]`` log-softmax."""
        if self.out_lp is None:
            return
        self.out_lp.append(float(logprobs[token]))
        if self.out_top is not None:
            vals, ids = torch.topk(logprobs, min(self.req.top_logprobs, logprobs.shape[-1]))
            self.out_top.append((vals.cpu(), ids.cpu()))

    def push(self, token: int) -> dict[str, Any] | None:
        """Append a token; return the finish reason dict when the row is done (SGLang's order of checks)."""
        self.output.append(token)
        self.next_token = token
        cap = self.req.params.max_new_tokens
        if len(self.output) >= cap:
            return {"type": "length", "length": cap}
        if token in self.stop_ids:
            return {"type": "stop", "matched": token}
        return None


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """The distribution a sampled request draws from: float64 ``[..., V]`` from logits ``[..., V]``.

    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (``-1`` = all) and then to the
    smallest set of most probable tokens whose mass reaches ``top_p`` (a token is dropped when the mass before it
    already reaches ``top_p``; the top token always stays), renormalized: SGLang's sampler
    (``layers/sampler.py``: temperature, then ``top_k_top_p_min_p_sampling_from_probs``) and the probabilities its
    speculative verification reads (``speculative/eagle_info.py``: ``softmax(logits / T)``, ``top_k_renorm_prob``,
    ``top_p_renorm_prob``). The embedded server samples from it and the evaluation's sampled acceptance
    (``drafter.evaluation.sampled``) reads it.

    Raises:
        ValueError: ``temperature`` <= 0 (a greedy request takes the argmax; it has no distribution here).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a sampling distribution, got {temperature}")
    x = logits.to(torch.float64) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_x = sorted_x.masked_fill(drop, -math.inf)
        x = torch.full_like(x, -math.inf).scatter(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)


def resolve_dtype(dtype: str, n_params: int, device: str) -> torch.dtype:
    """Compute dtype for ``dtype`` in {"auto", "float64", "float32", "bfloat16", "float16"}.

    "auto": float64 on CPU for models of at most ``FLOAT64_MAX_PARAMS`` parameters (batch-invariant greedy ids,
    see the module docstring), otherwise float32. Raises ValueError for other names.
    """
    names = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return torch.float64 if device == "cpu" and n_params <= FLOAT64_MAX_PARAMS else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype must be one of {['auto', *names]}, got {dtype!r}")
    return names[dtype]


def load_causal_lm(model_path: str, *, dtype: str = "auto", device: str = "cpu") -> torch.nn.Module:
    """Load a transformers causal LM for serving: eval mode, SDPA attention, dtype per ``resolve_dtype``.

    Args:
        model_path: a local model directory (loaded with ``local_files_only``) or a hub id.
        dtype: see ``resolve_dtype``.
        device: torch device string.
    Raises:
        OSError / ValueError from transformers when the directory holds no loadable causal LM.
    """
    import os

    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if os.path.isdir(model_path):
        kwargs["local_files_only"] = True
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa", **kwargs)
    except (ValueError, ImportError) as exc:
        if "sdpa" not in str(exc).lower() and "scaled_dot_product" not in str(exc).lower():
            raise
        # Left-padded rows must go through SDPA: eager attention turns fully masked padding rows into NaN
        # (measured in float64), which then leaks into real rows through the value matmul.
        raise ValueError(
            f"{model_path}: this server needs a model with SDPA attention support ({exc}); serve it with SGLang"
        ) from exc
    n_params = sum(p.numel() for p in model.parameters())
    model = model.to(device=device, dtype=resolve_dtype(dtype, n_params, device))
    model.eval()
    return model


def model_eos_ids(model: torch.nn.Module, tokenizer: Any | None = None) -> frozenset[int]:
    """EOS ids the way SGLang collects them: ``config.eos_token_id``, ``generation_config.eos_token_id`` (int or
    list) and the tokenizer's ``eos_token_id``."""
    ids: set[int] = set()
    sources = [getattr(model.config, "eos_token_id", None)]
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        sources.append(getattr(gen, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(getattr(tokenizer, "eos_token_id", None))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(t) for t in s if isinstance(t, int))
    return frozenset(ids)


class DecodeEngine:
    """Continuous batching decoder over one model, running in its own thread.

    Args:
        model: a causal LM in eval mode (see ``load_causal_lm``).
        eos_ids: ids that end every request unless it sets ``ignore_eos`` (see ``model_eos_ids``).
        max_batch_size: most sequences decoded together.
        batch_wait_s: when idle, how long to wait after the first arrival for more requests to batch with it.
        max_prefill_tokens: padded tokens (rows x longest prompt) per prefill forward; larger groups are split.
        seed: seeds the source of per-request seeds for sampled requests without their own seed.
        hidden_states: what a request's ``hidden`` rows hold: ``"aux"`` (the inputs of ``capture_ids``,
            concatenated; SGLang's ``--enable-return-aux-hidden-states``), ``"final"`` (the final-normed state;
            ``--enable-return-hidden-states``) or None (requests may not ask).
        capture_ids: ascending capture ids for ``"aux"`` (:func:`~eagle_assets.serving.aux_capture.
            capture_ids_from_flag`).

    Use ``start()``, ``submit()`` from any thread, ``stop()``; ``stats`` is readable at any time.

    Raises:
        ValueError: bad sizes, ``hidden_states="aux"`` without capture ids, or a model the hooks cannot find the
            layers of.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_ids: frozenset[int] | set[int] = frozenset(),
        *,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        max_prefill_tokens: int = 16384,
        seed: int | None = None,
        hidden_states: str | None = None,
        capture_ids: Sequence[int] = (),
    ):
        from transformers import DynamicCache

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.eos_ids = frozenset(eos_ids)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = EngineStats()
        self.device = next(model.parameters()).device
        self._dynamic_cache = DynamicCache
        try:
            probe = DynamicCache(config=model.config)
            self.continuous = bool(probe.layers) and all(type(layer) is DynamicLayer for layer in probe.layers)
        except Exception:  # a config DynamicCache cannot describe: never reshape its cache
            self.continuous = False
        self._seed_source = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**62))
        self._queue: collections.deque[EngineRequest] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, L] int64, 1 = real token
        self._next_pos: torch.Tensor | None = None  # [B] int64, position of each row's next fed token
        if hidden_states not in (None, "aux", "final"):
            raise ValueError(f"hidden_states must be None, 'aux' or 'final', got {hidden_states!r}")
        if hidden_states == "aux" and not capture_ids:
            raise ValueError("hidden_states='aux' needs capture_ids")
        self.hidden_states = hidden_states
        self.capture_ids = [int(c) for c in capture_ids] if hidden_states == "aux" else []
        self._tap: HiddenStateTap | None = None
        self._tap_error: str | None = None
        try:
            self._tap = HiddenStateTap(model, self.capture_ids)
        except AuxCaptureError as exc:
            if hidden_states is not None:
                raise
            self._tap_error = str(exc)  # logprob requests are refused with this reason

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the decode thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; queued and running requests finish with an ``abort`` reason."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests (thread-safe). After ``stop()`` they are aborted at once."""
        with self._cv:
            if self._stopping:
                stopped = True
            else:
                stopped = False
                self._queue.extend(requests)
                self.stats.requests_submitted += len(requests)
                self._cv.notify()
        if stopped:
            for r in requests:
                self._finish_abort(r, "server is shutting down", 503)

    @property
    def recording_error(self) -> str | None:
        """Why this model's hidden states cannot be recorded (input logprobs need them), or None."""
        return self._tap_error

    @property
    def alive(self) -> bool:
        """True while the decode thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> int:
        """Unfinished sequences in the decode batch."""
        return sum(1 for row in self._rows if not row.done)

    @property
    def queued(self) -> int:
        """Requests waiting for admission."""
        return len(self._queue)

    # ---------------------------------------------------------------------------------------------- the thread
    def _collect(self) -> list[EngineRequest] | None:
        with self._cv:
            if not self._rows:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                deadline = time.monotonic() + self.batch_wait_s
                while not self._stopping and len(self._queue) < self.max_batch_size:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cv.wait(remaining)
            if self._stopping:
                return None
            if self._rows and not self.continuous:
                return []
            taken: list[EngineRequest] = []
            while self._queue and len(self._rows) + len(taken) < self.max_batch_size:
                req = self._queue.popleft()
                if req.cancelled:
                    self.stats.requests_cancelled += 1
                    continue
                taken.append(req)
            return taken

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                new = self._collect()
                if new is None:
                    break
                started = time.perf_counter()
                try:
                    if new:
                        self._admit(new)
                        new = []
                    if self._rows:
                        self._decode_step()
                except Exception as exc:  # a failing forward must not kill the server: abort what it held
                    log.exception("decode engine: forward failed; aborting %d requests", len(self._rows) + len(new))
                    message = f"{type(exc).__name__}: {exc}"
                    for row in self._rows:
                        if not row.done:
                            self._finish_abort(row.req, message, 500)
                    for req in new:
                        self._finish_abort(req, message, 500)
                    self._reset()
                self.stats.busy_s += time.perf_counter() - started
        with self._cv:
            pending = list(self._queue)
            self._queue.clear()
        for row in self._rows:
            if not row.done:
                self._finish_abort(row.req, "server is shutting down", 503)
        for req in pending:
            self._finish_abort(req, "server is shutting down", 503)
        self._reset()

    def _reset(self) -> None:
        self._rows, self._cache, self._mask, self._next_pos = [], None, None, None

    # ------------------------------------------------------------------------------------------------- prefill
    def _admit(self, requests: list[EngineRequest]) -> None:
        requests = sorted(requests, key=lambda r: len(r.input_ids))
        group: list[EngineRequest] = []
        for req in requests:
            longest = len(req.input_ids)  # sorted ascending: the newcomer is the longest of the group
            if group and longest * (len(group) + 1) > self.max_prefill_tokens:
                self._prefill(group)
                group = []
            group.append(req)
        if group:
            self._prefill(group)

    def _prefill(self, requests: list[EngineRequest]) -> None:
        batch, width = len(requests), max(len(r.input_ids) for r in requests)
        ids = torch.tensor([[0] * (width - len(r.input_ids)) + r.input_ids for r in requests], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(r.input_ids)) + [1] * len(r.input_ids) for r in requests], device=self.device
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        rows = [_Row(r, self.eos_ids, self._seed_source) for r in requests]
        tapped = self._tap_on(rows)
        try:
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                logits_to_keep=1,
            )
        finally:
            if tapped:
                self._tap.stop()
        self.stats.forward_calls += 1
        self.stats.prefill_calls += 1
        self.stats.prefill_rows += batch
        self.stats.max_prefill_batch = max(self.stats.max_prefill_batch, batch)
        last_logits = out.logits[:, -1, :]
        if tapped:
            self._record_prefill(rows, ids, width, last_logits)
        tokens = self._sample(last_logits, rows)
        keep: list[int] = []
        for i, (row, token) in enumerate(zip(rows, tokens)):
            if row.req.prefill_only:
                self._finish(row, {"type": "length", "length": 0})
                continue
            if self._advance(row, last_logits[i], token):
                keep.append(i)
        if not keep:
            return
        if not self.continuous:
            # static mode never reshapes a cache: finished rows ride along (marked done) until the batch ends
            keep = list(range(batch))
        elif len(keep) < batch:
            index = torch.tensor(keep, device=self.device)
            cache.batch_select_indices(index)
            mask = mask[index]
        next_pos = torch.tensor([len(rows[i].req.input_ids) for i in keep], device=self.device)
        self._merge(cache, mask, next_pos, [rows[i] for i in keep])

    def _new_cache(self) -> Any:
        """A ``DynamicCache`` for one prefill; in continuous mode its layers are :class:`GrowingKVLayer`."""
        cache = self._dynamic_cache(config=self.model.config)
        if self.continuous:
            cache.layers = [GrowingKVLayer() for _ in cache.layers]
        return cache

    def _tap_on(self, rows: list[_Row]) -> bool:
        """Start recording this forward's hidden states when a row needs them (hidden rows or input logprobs)."""
        need = any(r.hidden is not None or (r.req.logprob_start is not None
                                            and r.req.logprob_start < len(r.req.input_ids)) for r in rows)
        if need and self._tap is None:
            raise RuntimeError(f"this model's hidden states cannot be recorded: {self._tap_error}")
        if need:
            self._tap.start()
        return need

    def _record_prefill(self, rows: list[_Row], ids: torch.Tensor, width: int, last_logits: torch.Tensor) -> None:
        """Per row: its prompt block of hidden states and its input logprobs, padding columns dropped."""
        tap = self._tap
        hidden = None
        if any(r.hidden is not None for r in rows):
            hidden = tap.aux() if self.hidden_states == "aux" else tap.final
        head = tap.lm_head
        for b, row in enumerate(rows):
            n = len(row.req.input_ids)
            first = width - n
            if row.hidden is not None:
                row.record_hidden(hidden[b, first:])
            start = row.req.logprob_start
            if start is None or start >= n:
                continue
            # logits of positions start .. n-2 predict prompt tokens start+1 .. n-1; the last position's logits
            # (already computed) are the output token's
            states = tap.final[b, first + start: width - 1]
            k = row.req.top_logprobs
            count = n - start
            lp = torch.full((count,), float("nan"), dtype=torch.float64)
            top_v = torch.full((count, k), float("nan"), dtype=torch.float64) if k else None
            top_i = torch.zeros((count, k), dtype=torch.long) if k else None
            nxt = ids[b, first + start + 1:].to("cpu")
            for c0 in range(0, states.shape[0], 1024):  # bounds the [chunk, V] logits buffer
                chunk = torch.log_softmax(head(states[c0:c0 + 1024]).double(), dim=-1).cpu()
                lp[1 + c0: 1 + c0 + chunk.shape[0]] = chunk.gather(1, nxt[c0:c0 + chunk.shape[0], None])[:, 0]
                if k:
                    v, i = torch.topk(chunk, min(k, chunk.shape[-1]), dim=-1)
                    top_v[1 + c0: 1 + c0 + chunk.shape[0], : v.shape[1]] = v
                    top_i[1 + c0: 1 + c0 + chunk.shape[0], : i.shape[1]] = i
            row.in_lp = lp
            row.in_top = (top_v, top_i) if k else None
        tap.clear()

    def _merge(self, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, rows: list[_Row]) -> None:
        if not self._rows:
            self._cache, self._mask, self._next_pos, self._rows = cache, mask, next_pos, rows
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        for mine, theirs in zip(self._cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], dim=0)
        self._mask = torch.cat([F.pad(self._mask, (width - old_len, 0)), F.pad(mask, (width - new_len, 0))], dim=0)
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._rows = self._rows + rows

    # -------------------------------------------------------------------------------------------------- decode
    def _decode_step(self) -> None:
        rows = self._rows
        batch = len(rows)
        feed = torch.tensor([[row.next_token] for row in rows], device=self.device)
        self._mask = torch.cat([self._mask, self._mask.new_ones((batch, 1))], dim=1)
        tapped = any(r.hidden is not None and not r.done for r in rows)
        if tapped:
            self._tap.start()
        try:
            out = self.model(
                input_ids=feed,
                attention_mask=self._mask,
                position_ids=self._next_pos[:, None],
                cache=self._cache,
                use_cache=True,
            )
        finally:
            if tapped:
                self._tap.stop()
        if tapped:
            fed = self._tap.aux() if self.hidden_states == "aux" else self._tap.final
            self._tap.clear()
        self._next_pos = self._next_pos + 1
        self.stats.forward_calls += 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += batch
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, batch)
        tokens = self._sample(out.logits[:, -1, :], rows)
        keep: list[int] = []
        for i, (row, token) in enumerate(zip(rows, tokens)):
            if row.done:
                continue
            if row.req.cancelled:
                row.done = True
                self.stats.requests_cancelled += 1
                continue
            if row.hidden is not None:
                row.record_hidden(fed[i, -1])
            if self._advance(row, out.logits[i, -1], token):
                keep.append(i)
        if not keep:
            self._reset()
        elif self.continuous and len(keep) < batch:
            self._select(keep)

    def _select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        self._next_pos = self._next_pos[index]
        self._rows = [self._rows[i] for i in keep]
        first_real = int(self._mask.any(dim=0).to(torch.int8).argmax())
        if first_real > 0:
            for layer in self._cache.layers:
                layer.keys = layer.keys[..., first_real:, :]
                layer.values = layer.values[..., first_real:, :]
            self._mask = self._mask[:, first_real:]

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for i, row in enumerate(rows):
            if not row.greedy:
                tokens[i] = row.sample(logits[i])
        return tokens

    # ------------------------------------------------------------------------------------------------- results
    def _advance(self, row: _Row, logits: torch.Tensor, token: int) -> bool:
        """Append ``token`` (sampled from ``logits``, ``[V]``) to ``row``, recording its logprob when asked; finish
        the row when it stopped; True when it goes on."""
        if row.out_lp is not None:
            row.record_output_logprob(torch.log_softmax(logits.double(), dim=-1), token)
        finish = row.push(token)
        if finish is not None:
            self._finish(row, finish)
            return False
        return True

    def _finish(self, row: _Row, finish: dict[str, Any]) -> None:
        row.done = True
        req = row.req
        self.stats.requests_finished += 1
        self.stats.tokens_generated += len(row.output)
        if req.cancelled:
            return
        req.on_done(
            EngineResult(
                rid=req.rid,
                output_ids=row.output,
                finish_reason=finish,
                prompt_tokens=len(req.input_ids),
                completion_tokens=len(row.output),
                e2e_latency=time.monotonic() - req.arrival,
                hidden_blocks=row.hidden,
                input_logprobs=row.in_lp,
                input_top=row.in_top,
                output_logprobs=row.out_lp,
                output_top=row.out_top,
            )
        )

    def _finish_abort(self, req: EngineRequest, message: str, status_code: int) -> None:
        self.stats.requests_aborted += 1
        if req.cancelled:
            return
        req.on_done(
            EngineResult(
                rid=req.rid,
                output_ids=[],
                finish_reason={
                    "type": "abort",
                    "message": message,
                    "status_code": status_code,
                    "err_type": "InternalServerError" if status_code >= 500 else "BadRequestError",
                },
                prompt_tokens=len(req.input_ids),
                completion_tokens=0,
                e2e_latency=time.monotonic() - req.arrival,
            )
        )


class GrowingKVLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers with spare capacity along the sequence axis.

    transformers' ``DynamicLayer.update`` concatenates the whole cache with each new token, so a decode step
    copies every cached key and value (half the time of a decode step at batch 48 and 300 cached tokens in our
    profile of the demo target). Here a step writes its token into the spare columns, and the buffer doubles when
    full, so the copying is amortised O(1) per token. ``keys`` / ``values`` read as views ``[B, H, L, D]`` of the
    first ``L`` columns, the same values ``DynamicLayer`` would hold (attention reads identical numbers, so the
    logits are bit-identical: ``test_serving_engine.py``); assigning either (the engine's merge, row selection and
    column trim) replaces that buffer, with its own length, so keys and values may be reassigned in any order.
    """

    def __init__(self):
        self._buf: dict[str, torch.Tensor | None] = {"k": None, "v": None}
        self._len = {"k": 0, "v": 0}
        super().__init__()

    def _view(self, which: str) -> torch.Tensor | None:
        buf = self._buf[which]
        return None if buf is None else buf[..., : self._len[which], :]

    def _assign(self, which: str, t: torch.Tensor | None) -> None:
        self._buf[which] = t
        self._len[which] = t.shape[-2] if t is not None and t.dim() == 4 else 0

    keys = property(lambda self: self._view("k"), lambda self, t: self._assign("k", t))
    values = property(lambda self: self._view("v"), lambda self, t: self._assign("v", t))

    def _append(self, which: str, states: torch.Tensor) -> None:
        buf, n, add = self._buf[which], self._len[which], states.shape[-2]
        if n + add > buf.shape[-2]:
            grown = buf.new_empty((*buf.shape[:2], max(2 * buf.shape[-2], n + add, 64), buf.shape[-1]))
            grown[..., :n, :] = buf[..., :n, :]
            self._buf[which] = buf = grown
        buf[..., n: n + add, :] = states
        self._len[which] = n + add

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self._len["k"] == 0:
            self.device, self.is_initialized = key_states.device, True
            self.keys, self.values = key_states, value_states
        else:
            self._append("k", key_states)
            self._append("v", value_states)
        return self.keys, self.values


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad a [B, H, L, D] cache tensor with zeros on the left of L up to ``width``."""
    missing = width - t.shape[-2]
    return t if missing == 0 else F.pad(t, (0, 0, missing, 0))
