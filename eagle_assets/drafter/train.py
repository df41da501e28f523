"""Train an EAGLE-3 drafter with training-time test (TTT) on prompt + completion rows, on CPU or GPU.

Alignment (explicit because SpecForge issue 885 shows how easily it slips by one): the target's logits at position
``q`` are its prediction of token ``q + 1``. A teacher position is a ``q`` whose NEXT token is a completion token
(``loss_mask[q + 1] == 1``), so the first answer token ``x[a]`` (a = prompt length) is supervised through the
teacher at ``q = a - 1``. TTT step ``i`` trains drafter row ``p = q - i - 1`` (inputs: aux of ``p``, embeddings of
``x[p+1..p+i+1]``) against that teacher; rows ``p < 0`` do not exist. See :func:`teacher_positions`.

Loss per step ``i``: soft cross-entropy (forward KL up to the teacher's entropy) of the drafter's draft-vocab
distribution against the target's softmax restricted to the draft vocab, averaged over that step's supervised rows;
total = sum_i 0.8^i * loss_i (EAGLE-3 / SpecForge weighting). Teacher positions whose target argmax lies outside the
draft vocab are left out (the drafter cannot propose that token; SpecForge's ``position_mask`` does the same) and
counted. Accuracy per step: the drafter's argmax (mapped to a target id) equals the target's argmax.

Resumable runs (``train_drafter(..., state_dir=...)``): every ``save_every_steps`` optimizer steps and at every epoch
end the trainer writes its whole state (drafter weights, AdamW moments and step counts, torch RNG state, position,
epoch accumulators, per-step metrics) and, when started again on the same inputs, continues from the last one. The
run is a pure function of (config, data, vocab, target, thread count): batch order of epoch ``e`` is drawn from
``SeedSequence([seed, e])`` alone, the learning rate is a function of the step number alone, the drafter has no
dropout and the loop draws no random numbers (its torch RNG stream is still saved and restored so that a future
random op stays reproducible). So a resumed run ends with exactly the weights of an unbroken one (bitwise on CPU
with the same thread count). See :class:`TrainState` for the files and the crash-safety protocol.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from eagle_assets.drafter.acceptance import AcceptanceResult, simulate_acceptance
from eagle_assets.drafter.export import CheckpointReport, export_checkpoint
from eagle_assets.drafter.features import aux_layer_ids, decoder_parts, head_argmax, run_target
from eagle_assets.drafter.model import DrafterConfig, Eagle3DraftModel
from eagle_assets.drafter.vocab import DraftVocab

Row = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of :func:`train_drafter`.

    Attributes:
        lr: peak AdamW learning rate.
        epochs: passes over the rows.
        max_length: rows are cut to their first ``max_length`` tokens.
        batch_tokens: a batch holds rows of similar length with ``rows x longest <= batch_tokens`` (a longer row
            forms a batch of its own).
        ttt_steps: TTT unroll length (EAGLE-3 uses 7).
        seed: (>= 0) seeds initialization and batch order; same seed + same rows + same threads = same losses.
        aux_layer_ids: target CAPTURE ids (None = SGLang default ``[2, L//2, L-3]``).
        warmup_steps: linear warm-up steps (0 = none); None = 5% of all steps (at least 1).
        schedule: learning rate after warm-up: ``"cosine"`` (half-cosine from ``lr`` down to ``min_lr_ratio * lr``
            at the last step) or ``"constant"`` (``lr``). See :func:`lr_at`.
        min_lr_ratio: cosine decay floor as a fraction of ``lr``.
        weight_decay: AdamW weight decay.
        grad_clip: global gradient-norm clip (0 disables).
        step_weight: loss weight decay per TTT step (``step_weight ** i``).
        intermediate_size: drafter MLP width (None = the target's).
        num_threads: torch CPU threads during training (None = leave as is).
        feature_cache_bytes: target features are computed once and kept in memory when they fit in this many bytes;
            otherwise they are recomputed for every batch.
        export_dtype: weight dtype of the exported checkpoint (None = the target's dtype from its config.json).
        acceptance_k: drafts per verification when ``eval_rows`` are given.
        acceptance_max_positions: verification cap for that simulation.
        save_every_steps: with a ``state_dir``, a training state is written every this many optimizer steps and at
            the end of every epoch (0 = at epoch ends only). Ignored without a ``state_dir``.
    """

    lr: float = 3e-4
    epochs: int = 2
    max_length: int = 2048
    batch_tokens: int = 4096
    ttt_steps: int = 7
    seed: int = 0
    aux_layer_ids: tuple[int, ...] | None = None
    warmup_steps: int | None = None
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    step_weight: float = 0.8
    intermediate_size: int | None = None
    num_threads: int | None = None
    feature_cache_bytes: int = 1 << 30
    export_dtype: str | None = None
    acceptance_k: int = 7
    acceptance_max_positions: int | None = 2000
    save_every_steps: int = 50


#: learning-rate schedules :func:`lr_at` knows.
SCHEDULES = ("cosine", "constant")

#: TrainConfig fields that change the sequence of weights; a saved state only resumes a run that agrees on all of
#: them (num_threads, feature_cache_bytes, export and acceptance settings, save_every_steps do not change it).
TRAJECTORY_FIELDS = (
    "lr", "epochs", "max_length", "batch_tokens", "ttt_steps", "seed", "aux_layer_ids", "warmup_steps", "schedule",
    "min_lr_ratio", "weight_decay", "grad_clip", "step_weight", "intermediate_size",
)


@dataclass
class StepMetrics:
    """One optimizer step.

    ``step_loss``/``step_acc``/``supervised`` have one entry per TTT step (None where nothing was supervised).
    """

    step: int
    epoch: int
    loss: float
    step_loss: list[float | None]
    step_acc: list[float | None]
    supervised: list[int]
    lr: float
    tokens: int
    seconds: float


@dataclass
class TrainResult:
    """Outcome of :func:`train_drafter`.

    Attributes:
        checkpoint_dir: the exported SGLang directory.
        checkpoint: its validation report.
        steps: per-step metrics.
        epochs: per-epoch means (``loss``, ``step_loss``, ``step_acc`` token-weighted over the epoch).
        rows_used / rows_skipped: rows trained on / left out, with ``skip_reasons`` counts.
        rows_truncated: rows cut to ``max_length``.
        tokens_per_epoch: tokens of the used rows (after truncation).
        out_of_draft_positions: teacher positions dropped because the target argmax is not in the draft vocab.
        feature_seconds / train_seconds: time spent extracting cached target features / in the optimization loop.
        tokens_per_s: training throughput (tokens processed by the loop per second, all epochs).
        aux_capture_ids: target capture ids used.
        drafter_config: the drafter's shape.
        acceptance: simulated acceptance on ``eval_rows`` (None when none were given).
        resumed_from_step: optimizer steps restored from a saved state (0 = trained from scratch); ``steps`` still
            lists every step of the run, the restored ones read back from the state.
        state_dir: where the training state was kept (None = not kept).
        state_seconds: time spent writing training states (not part of ``train_seconds``).
    """

    checkpoint_dir: Path
    checkpoint: CheckpointReport
    steps: list[StepMetrics]
    epochs: list[dict[str, Any]]
    rows_used: int
    rows_skipped: int
    skip_reasons: dict[str, int]
    rows_truncated: int
    tokens_per_epoch: int
    out_of_draft_positions: int
    feature_seconds: float
    train_seconds: float
    tokens_per_s: float
    aux_capture_ids: list[int]
    drafter_config: DrafterConfig
    config: TrainConfig
    acceptance: AcceptanceResult | None = None
    notes: list[str] = field(default_factory=list)
    resumed_from_step: int = 0
    state_dir: Path | None = None
    state_seconds: float = 0.0

    @property
    def first_loss(self) -> float:
        return self.steps[0].loss if self.steps else float("nan")

    @property
    def last_loss(self) -> float:
        return self.steps[-1].loss if self.steps else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_dir": str(self.checkpoint_dir),
            "steps": [asdict(s) for s in self.steps],
            "epochs": self.epochs,
            "rows_used": self.rows_used,
            "rows_skipped": self.rows_skipped,
            "skip_reasons": self.skip_reasons,
            "rows_truncated": self.rows_truncated,
            "tokens_per_epoch": self.tokens_per_epoch,
            "out_of_draft_positions": self.out_of_draft_positions,
            "feature_seconds": self.feature_seconds,
            "train_seconds": self.train_seconds,
            "tokens_per_s": self.tokens_per_s,
            "aux_capture_ids": self.aux_capture_ids,
            "drafter_config": self.drafter_config.to_dict(),
            "config": asdict(self.config),
            "acceptance": self.acceptance.to_dict() if self.acceptance else None,
            "notes": self.notes,
            "resumed_from_step": self.resumed_from_step,
            "state_dir": str(self.state_dir) if self.state_dir else None,
            "state_seconds": self.state_seconds,
        }


def teacher_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Teacher positions of one row: every ``q`` with ``loss_mask[q + 1] == 1``.

    Args:
        loss_mask: 0/1 ``[T]`` (1 = completion token).

    Returns:
        int64 ``[N]`` ascending positions ``q`` in ``[0, T - 2]``; the target's logits at ``q`` teach the drafter
        token ``q + 1``. TTT step ``i`` trains drafter row ``q - i - 1`` (see :func:`drafter_rows`).
    """
    m = np.asarray(loss_mask).astype(bool)
    return np.flatnonzero(m[1:]).astype(np.int64)


def drafter_rows(teacher: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Drafter rows trained at TTT ``step`` and the teacher positions they learn from.

    Returns:
        ``(rows, teachers)``: ``rows = teachers - step - 1``, keeping only ``rows >= 0``.
    """
    rows = np.asarray(teacher, dtype=np.int64) - step - 1
    keep = rows >= 0
    return rows[keep], np.asarray(teacher, dtype=np.int64)[keep]


def load_target(target: str | Path | nn.Module) -> nn.Module:
    """A HF causal LM in eval mode with frozen float32 weights (a path is loaded with ``AutoModelForCausalLM``)."""
    if isinstance(target, nn.Module):
        model = target
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    model.eval()
    model.requires_grad_(False)
    return model


def train_drafter(
    target_dir: str | Path | nn.Module,
    rows: Sequence[Row],
    draft_vocab: DraftVocab,
    config: TrainConfig,
    out_dir: str | Path,
    log: Callable[[str], None] | None = None,
    eval_rows: Sequence[Row] | None = None,
    state_dir: str | Path | None = None,
) -> TrainResult:
    """Train and export an EAGLE-3 drafter for a target model.

    Args:
        target_dir: local HF model directory of the target (or an already loaded causal LM).
        rows: ``(input_ids, loss_mask)`` with ``input_ids`` int32 ``[T]`` = prompt_ids + output_ids and
            ``loss_mask`` int8 ``[T]`` (0 prompt, 1 completion). Malformed rows are skipped and counted, never fatal.
        draft_vocab: from :func:`~eagle_assets.drafter.vocab.build_draft_vocab` over the same kind of data.
        config: :class:`TrainConfig`.
        out_dir: where the SGLang checkpoint (``config.json``, ``model.safetensors``) and ``training_metrics.json``
            are written.
        log: called with one human-readable line per optimizer step and a few summary lines. An exception it
            raises stops training there (the last saved state stays resumable).
        eval_rows: optional held-out rows for :func:`simulate_acceptance` after training.
        state_dir: directory for resumable training state (see :class:`TrainState`); None = nothing is saved or
            resumed. When it holds a state written for the same inputs (same :data:`TRAJECTORY_FIELDS` of
            ``config``, same rows after truncation, same draft vocab, same target weights, same
            :data:`STATE_VERSION`), training continues from it and ends with the weights an unbroken run would
            have (bitwise on CPU with the same thread count). A state for other inputs, or a damaged one, is never
            continued: it is deleted and training starts over, with a log line and a note in
            :attr:`TrainResult.notes` naming what differed. (Starting over rather than raising because the usual
            cause is an edited catalog or new data on a pipeline re-run, where the user wants the new run, not an
            error asking them to delete files.) A finished state is reused as is: the run only exports. The
            directory must lie outside ``out_dir``, which export replaces.

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: the draft vocab does not match the target vocab, no row has a supervised position, a config
            value is out of range, the aux ids do not fit the target, or ``state_dir`` lies inside ``out_dir`` (the
            message says what to change).
        RuntimeError: another process is training with the same ``state_dir``.
    """
    emit = log or (lambda _line: None)
    previous_threads = torch.get_num_threads()
    if config.num_threads:
        torch.set_num_threads(int(config.num_threads))
    try:
        # Training draws from its own torch RNG stream (seeded with config.seed, saved in the state) so neither the
        # caller's generator nor earlier calls change the weights.
        with torch.random.fork_rng(devices=[]):
            return _train(
                target_dir, rows, draft_vocab, config, Path(out_dir), emit, eval_rows,
                Path(state_dir) if state_dir is not None else None,
            )
    finally:
        torch.set_num_threads(previous_threads)


@dataclass
class _Prepared:
    ids: np.ndarray  # int64 [T]
    mask: np.ndarray  # bool [T]
    teacher: np.ndarray  # int64 [N] teacher positions


def _prepare_rows(
    rows: Sequence[Row], vocab_size: int, max_length: int
) -> tuple[list[_Prepared], dict[str, int], int]:
    prepared: list[_Prepared] = []
    reasons: dict[str, int] = {}
    truncated = 0

    def skip(reason: str) -> None:
        reasons[reason] = reasons.get(reason, 0) + 1

    for row in rows:
        if not isinstance(row, (tuple, list)) or len(row) != 2:
            skip("not_a_pair")
            continue
        try:
            ids = np.asarray(row[0])
            mask = np.asarray(row[1])
        except (TypeError, ValueError):
            skip("not_a_pair")
            continue
        if ids.ndim != 1 or mask.ndim != 1 or ids.shape != mask.shape:
            skip("shape_mismatch")
            continue
        if ids.size < 2:
            skip("too_short")
            continue
        if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_size:
            skip("id_out_of_vocab")
            continue
        if not np.isin(mask, (0, 1)).all():
            skip("mask_not_binary")
            continue
        if ids.size > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        teacher = teacher_positions(mask)
        if teacher.size == 0:
            skip("no_completion_tokens")
            continue
        prepared.append(_Prepared(ids.astype(np.int64), mask.astype(bool), teacher))
    return prepared, reasons, truncated


def _make_batches(rows: list[_Prepared], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(rows)), key=lambda i: (-rows[i].ids.size, i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = rows[current[0]].ids.size if current else rows[i].ids.size
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _pad(arrays: list[np.ndarray], value: int = 0) -> torch.Tensor:
    t = max(a.size for a in arrays)
    out = np.full((len(arrays), t), value, dtype=np.int64)
    for b, a in enumerate(arrays):
        out[b, : a.size] = a
    return torch.from_numpy(out)


class _Features:
    """Target features per row: aux ``[T, 3H]``, final-normed hidden at teacher positions, greedy ids there."""

    def __init__(self, target: nn.Module, capture: list[int], rows: list[_Prepared], cache: bool, batch_tokens: int):
        self.target = target
        self.capture = capture
        self.rows = rows
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        if cache:
            self.cache = {}
            for batch in _make_batches(rows, batch_tokens):
                for i, feats in zip(batch, self._compute(batch)):
                    self.cache[i] = feats

    def _compute(self, batch: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        ids = _pad([self.rows[i].ids for i in batch])
        aux, final = run_target(self.target, ids, self.capture)
        out = []
        for b, i in enumerate(batch):
            row = self.rows[i]
            t = row.ids.size
            teacher_hidden = final[b, torch.from_numpy(row.teacher)]
            greedy = head_argmax(self.target, teacher_hidden)
            out.append((aux[b, :t].contiguous(), teacher_hidden.contiguous(), greedy))
        return out

    def get(self, batch: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.cache is not None:
            return [self.cache[i] for i in batch]
        return self._compute(batch)


class _SoftCrossEntropy(torch.autograd.Function):
    """Per-row ``-sum_v p[v] * log_softmax(logits)[v]`` with a hand-written backward (``softmax - p``): on CPU the
    ``[N, draft_vocab]`` passes of the generic log_softmax/mul/sum graph cost more than the lm_head matmul."""

    @staticmethod
    def forward(ctx, logits, target_p):
        lse = torch.logsumexp(logits, dim=-1)
        dot = torch.bmm(logits.unsqueeze(1), target_p.unsqueeze(2)).view(-1)
        ctx.save_for_backward(logits, target_p, lse)
        return lse - dot

    @staticmethod
    def backward(ctx, grad):
        logits, target_p, lse = ctx.saved_tensors
        g = torch.sub(logits, lse.unsqueeze(-1))
        g.exp_().sub_(target_p).mul_(grad.unsqueeze(-1))
        return g, None


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy per row.

    Args:
        logits: float32 ``[N, D]`` drafter logits over the draft vocab.
        target_p: float32 ``[N, D]`` teacher probabilities (rows sum to 1; no gradient).

    Returns:
        float32 ``[N]``: ``H(p, q) = KL(p || q) + H(p)``, so its gradient is the forward-KL gradient.
    """
    return _SoftCrossEntropy.apply(logits.contiguous(), target_p.contiguous())


@dataclass
class _Supervision:
    """Teacher positions of one batch: row in batch ``[N]``, position ``q`` ``[N]``, target softmax over the draft
    vocab ``[N, D]`` and the target's greedy id ``[N]``; plus how many were dropped (argmax outside the vocab)."""

    row: torch.Tensor
    position: torch.Tensor
    teacher_p: torch.Tensor
    greedy: torch.Tensor
    out_of_draft: int


def _supervision(batch, feats, prepared, in_draft, teacher_w, teacher_b) -> _Supervision:
    rows, positions, hidden, greedy = [], [], [], []
    dropped = 0
    for b, (i, (_aux, teacher_hidden, teacher_greedy)) in enumerate(zip(batch, feats)):
        keep = in_draft[teacher_greedy]
        dropped += int((~keep).sum())
        q = torch.from_numpy(prepared[i].teacher)[keep]
        rows.append(torch.full_like(q, b))
        positions.append(q)
        hidden.append(teacher_hidden[keep])
        greedy.append(teacher_greedy[keep])
    with torch.no_grad():
        teacher_p = torch.softmax(F.linear(torch.cat(hidden), teacher_w, teacher_b), dim=-1)
    return _Supervision(torch.cat(rows), torch.cat(positions), teacher_p, torch.cat(greedy), dropped)


def _ttt_loss(
    model: Eagle3DraftModel,
    aux: torch.Tensor,
    ids: torch.Tensor,
    sup: _Supervision,
    weights: Sequence[float],
    draft_ids: torch.Tensor,
) -> tuple[torch.Tensor, list[tuple[int, float, int]]]:
    """Weighted TTT loss of one batch and, per step, ``(supervised rows, summed soft CE, correct argmaxes)``.

    Step ``i`` trains drafter row ``q - i - 1`` against the teacher at ``q`` (see :func:`teacher_positions`).
    """
    k = len(weights)
    # Rows before the first teacher minus k are prompt rows no step's loss reaches.
    row_start = max(0, int(sup.position.min()) - k) if sup.position.numel() else 0
    hiddens, _ = model.unroll(aux, ids, k, row_start=row_start)
    total = torch.zeros(())
    per_step: list[tuple[int, float, int]] = []
    for i in range(k):
        rows_i = sup.position - i - 1
        valid = rows_i >= 0
        n = int(valid.sum())
        if n == 0:
            per_step.append((0, 0.0, 0))
            continue
        everyone = n == valid.numel()
        logits = model.logits(hiddens[i][sup.row[valid], rows_i[valid] - row_start]).float()
        ce = soft_cross_entropy(logits, sup.teacher_p if everyone else sup.teacher_p[valid])
        total = total + weights[i] * ce.mean()
        with torch.no_grad():
            want = sup.greedy if everyone else sup.greedy[valid]
            per_step.append((n, float(ce.sum()), int((draft_ids[logits.argmax(-1)] == want).sum())))
    return total, per_step


def lr_at(step: int, total: int, warmup: int, lr: float, floor: float, schedule: str = "cosine") -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total``.

    A function of the step number alone, so the "scheduler state" of a resumed run is just its step count.
    Warm-up (``step < warmup``): ``lr * (step + 1) / warmup`` (linear, reaching ``lr`` at the last warm-up step).
    After it, ``"constant"``: ``lr``; ``"cosine"``: ``lr * (floor + (1 - floor) * (1 + cos(pi * progress)) / 2)``
    with ``progress = (step - warmup) / max(1, total - warmup)`` clipped to 1: the half-cosine of SGDR (Loshchilov
    and Hutter, arXiv 1608.03983) as in transformers' ``get_cosine_schedule_with_warmup``, decaying to
    ``floor * lr`` instead of 0.

    Raises:
        ValueError: ``schedule`` is not one of :data:`SCHEDULES`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; use one of {list(SCHEDULES)}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def epoch_order(seed: int, epoch: int, n_batches: int) -> np.ndarray:
    """Batch order of ``epoch``: int64 ``[n_batches]``, a permutation drawn from ``SeedSequence([seed, epoch])``.

    Depends on nothing else (not on earlier epochs or on how many batches a crashed run had consumed), so a run
    resumed mid-epoch continues the same order.
    """
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n_batches)


def _check_config(config: TrainConfig) -> None:
    problems = []
    if config.ttt_steps < 1 or config.epochs < 1 or config.batch_tokens < 1:
        problems.append(
            f"ttt_steps, epochs and batch_tokens must be >= 1 (got {config.ttt_steps}, {config.epochs}, "
            f"{config.batch_tokens})"
        )
    if config.max_length < 2:
        problems.append(f"max_length must be >= 2 (got {config.max_length})")
    if config.seed < 0:
        problems.append(f"seed must be >= 0 (got {config.seed})")
    if config.warmup_steps is not None and config.warmup_steps < 0:
        problems.append(f"warmup_steps must be >= 0 or None for 5% of the steps (got {config.warmup_steps})")
    if config.schedule not in SCHEDULES:
        problems.append(f"schedule must be one of {list(SCHEDULES)} (got {config.schedule!r})")
    if config.save_every_steps < 0:
        problems.append(f"save_every_steps must be >= 0, 0 = at epoch ends only (got {config.save_every_steps})")
    if problems:
        raise ValueError("invalid TrainConfig: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------------------
# Resumable state

#: format of the files :class:`TrainState` writes. Bump it whenever a code change alters the training trajectory
#: (loss, batching, initialization, optimizer), so that states from the old code are not continued by the new.
STATE_VERSION = 1


def _hash_tensors(items: Iterator[tuple[str, Any]]) -> str:
    """sha256 over ``(name, shape, dtype, raw bytes)`` of tensors / arrays, in the given order."""
    h = hashlib.sha256()
    for name, value in items:
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        else:
            a = np.ascontiguousarray(value)
            h.update(f"{name}|{a.shape}|{a.dtype.str}|".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def _fingerprint(
    config: TrainConfig,
    dconf: DrafterConfig,
    prepared: list[_Prepared],
    draft_vocab: DraftVocab,
    target: nn.Module,
    warmup: int,
    total_steps: int,
) -> dict[str, Any]:
    """What a saved state must agree on to be continued: JSON-normalized trajectory config, drafter shape, and
    sha256 of the training rows (after truncation, in order), of the draft vocab and of every target parameter."""
    trajectory = {name: getattr(config, name) for name in TRAJECTORY_FIELDS}
    trajectory.update(resolved_warmup_steps=warmup, total_steps=total_steps)
    return json.loads(json.dumps({
        "config": trajectory,
        "drafter": dconf.to_dict(),
        "data": _hash_tensors(
            (f"row{i}", a) for i, r in enumerate(prepared) for a in (r.ids, r.mask)
        ),
        "vocab": _hash_tensors([("d2t", draft_vocab.d2t), ("t2d", draft_vocab.t2d)]),
        "target": _hash_tensors(iter(target.named_parameters())),
    }))


def _fingerprint_diff(old: Any, new: dict[str, Any]) -> str:
    """Human-readable differences between two fingerprints ('' when equal)."""
    if not isinstance(old, dict):
        return "it has no fingerprint"
    out = []
    old_cfg, new_cfg = old.get("config") or {}, new["config"]
    changed = [f"{k} {old_cfg.get(k)!r} -> {new_cfg.get(k)!r}" for k in new_cfg if old_cfg.get(k) != new_cfg.get(k)]
    if changed:
        out.append("config " + ", ".join(changed))
    if old.get("drafter") != new["drafter"]:
        keys = [k for k in new["drafter"] if (old.get("drafter") or {}).get(k) != new["drafter"][k]]
        out.append(f"drafter shape ({', '.join(keys)})")
    for key, what in (("data", "training rows"), ("vocab", "draft vocab"), ("target", "target weights")):
        if old.get(key) != new[key]:
            out.append(what)
    return "; ".join(out)


@dataclass
class _Progress:
    """Everything of a run that a state must carry besides tensors (JSON-exact: floats round-trip via repr)."""

    step: int
    epochs: list[dict[str, Any]]
    loss_sum: list[float]
    correct: list[float]
    count: list[float]
    loss_total: float
    out_of_draft: int
    tokens_done: int
    train_seconds: float
    steps: list[StepMetrics]

    @classmethod
    def fresh(cls, k: int) -> "_Progress":
        return cls(0, [], [0.0] * k, [0.0] * k, [0.0] * k, 0.0, 0, 0, 0.0, [])

    def new_epoch(self, k: int) -> None:
        self.loss_sum, self.correct, self.count, self.loss_total = [0.0] * k, [0.0] * k, [0.0] * k, 0.0

    def record(self) -> dict[str, Any]:
        return {
            "epochs": self.epochs, "loss_sum": self.loss_sum, "correct": self.correct, "count": self.count,
            "loss_total": self.loss_total, "out_of_draft": self.out_of_draft, "tokens_done": self.tokens_done,
            "train_seconds": self.train_seconds,
        }

    @classmethod
    def from_record(cls, step: int, record: dict[str, Any], steps: list[StepMetrics]) -> "_Progress":
        return cls(
            step, record["epochs"], record["loss_sum"], record["correct"], record["count"], record["loss_total"],
            record["out_of_draft"], record["tokens_done"], record["train_seconds"], steps,
        )


@dataclass
class _Snapshot:
    step: int
    record: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    steps: list[StepMetrics]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a hidden sibling, fsync it, rename it over ``path``: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class TrainState:
    """The resumable state of one training run, kept in a directory (no pickles; crash-safe).

    Files:
        ``state.json``: the commit record: :data:`STATE_VERSION`, the run fingerprint (see :func:`train_drafter`),
            optimizer steps done, the tensors file it goes with and that file's size, completed epoch summaries,
            the running epoch's accumulators and counters.
        ``tensors-<step>.safetensors``: drafter weights ``model.<name>`` (float32, the names of
            :data:`~eagle_assets.drafter.export.WEIGHT_KEYS`), AdamW state ``optim.<param index>.<key>`` (``step``
            float32 scalar, ``exp_avg`` and ``exp_avg_sq`` float32 shaped like the parameter; index = position in
            ``model.parameters()``) and the torch CPU RNG state ``rng.torch`` (uint8).
        ``steps.jsonl``: one :class:`StepMetrics` per line, appended; only the first ``step`` lines are valid.
        ``.lock``: ``flock``-ed while a run uses the directory.

    Save protocol: the tensors file is written under a temporary name, fsynced and renamed; the new metrics lines
    are appended and fsynced; then ``state.json`` is written the same way, and its rename is the commit. A save
    killed at any point leaves the previous ``state.json`` and the tensors file it names intact (older tensors
    files are deleted only after the commit; extra metrics lines are cut on load), so a half-written state is never
    loaded. Reading uses JSON and safetensors only (no ``torch.load``): a planted file cannot run code.
    """

    STATE = "state.json"
    STEPS = "steps.jsonl"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lines = 0  # metrics lines already in steps.jsonl that belong to the committed state

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an exclusive ``flock`` on ``.lock`` for the block.

        Raises:
            RuntimeError: another process holds it.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RuntimeError(
                        f"another training run is using the state directory {self.path} (its .lock is held); "
                        "wait for it to finish or pass a different state_dir"
                    ) from exc
                raise
            yield
        finally:
            os.close(fd)  # releases the lock

    def load(self, fingerprint: dict[str, Any]) -> tuple[_Snapshot | None, str | None]:
        """The committed state if it was written for ``fingerprint``.

        Returns:
            ``(snapshot, None)`` for a usable state, ``(None, None)`` when there is none, ``(None, reason)`` when
            there is one that must not be continued (other inputs, other format, unreadable).
        """
        path = self.path / self.STATE
        if not path.exists():
            self.clear()  # leftovers of a first save that died before its commit
            return None, None
        try:
            record = json.loads(path.read_text())
            version, step = record.get("version"), int(record["step"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            return None, f"its {self.STATE} is unreadable ({exc})"
        if version != STATE_VERSION:
            return None, f"it was written in state format {version}, this trainer writes format {STATE_VERSION}"
        diff = _fingerprint_diff(record.get("fingerprint"), fingerprint)
        if diff:
            return None, f"it was written for other inputs (differences: {diff})"
        tensors_path = self.path / str(record.get("tensors_file"))
        try:
            size = tensors_path.stat().st_size
            if size != record.get("tensors_bytes"):
                return None, f"{tensors_path.name} has {size} bytes, the state records {record.get('tensors_bytes')}"
            tensors = load_file(str(tensors_path))
        except (OSError, SafetensorError) as exc:
            return None, f"its tensors file is unreadable ({exc})"
        steps: list[StepMetrics] = []
        try:
            with open(self.path / self.STEPS) as fh:
                for line in fh:
                    if len(steps) == step:
                        break
                    steps.append(StepMetrics(**json.loads(line)))
        except (OSError, ValueError, TypeError) as exc:
            return None, f"its {self.STEPS} is unreadable ({exc})"
        if len(steps) != step:
            return None, f"its {self.STEPS} has {len(steps)} steps, the state records {step}"
        # Lines past the commit come from a save that died before its commit: drop them before appending.
        self._rewrite_steps(steps)
        return _Snapshot(step, record, tensors, steps), None

    def _rewrite_steps(self, steps: list[StepMetrics]) -> None:
        _atomic_write(
            self.path / self.STEPS,
            lambda tmp: tmp.write_text("".join(json.dumps(asdict(m)) + "\n" for m in steps)),
        )
        self._lines = len(steps)

    def clear(self) -> None:
        """Remove every state file (``state.json`` first: from then on nothing here is resumable)."""
        (self.path / self.STATE).unlink(missing_ok=True)
        _fsync_dir(self.path)
        for pattern in ("tensors-*.safetensors", self.STEPS, ".*.tmp-*"):
            for f in self.path.glob(pattern):
                f.unlink(missing_ok=True)
        self._lines = 0

    def save(
        self, step: int, tensors: dict[str, torch.Tensor], record: dict[str, Any], steps: list[StepMetrics]
    ) -> None:
        """Commit the state after ``step`` optimizer steps (``steps`` = the metrics of all of them)."""
        self.path.mkdir(parents=True, exist_ok=True)
        name = f"tensors-{step:09d}.safetensors"
        _atomic_write(self.path / name, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
        with open(self.path / self.STEPS, "a") as fh:
            fh.writelines(json.dumps(asdict(m)) + "\n" for m in steps[self._lines : step])
            fh.flush()
            os.fsync(fh.fileno())
        full = {**record, "version": STATE_VERSION, "step": step, "tensors_file": name,
                "tensors_bytes": (self.path / name).stat().st_size}
        _atomic_write(self.path / self.STATE, lambda tmp: tmp.write_text(json.dumps(full) + "\n"))
        self._lines = step
        for old in self.path.glob("tensors-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    for idx, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            out[f"optim.{idx}.{key}"] = torch.as_tensor(value).detach().to("cpu").contiguous()
    out["rng.torch"] = torch.get_rng_state()
    return out


def _restore_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], tensors: dict[str, torch.Tensor]
) -> str | None:
    """Load weights, optimizer state and RNG from a state's tensors; returns why not (nothing changed) or None."""
    weights = model.state_dict()
    model_part = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if set(model_part) != set(weights):
        return f"its weight names differ from the drafter's ({sorted(set(model_part) ^ set(weights))})"
    bad = [k for k, v in model_part.items() if v.shape != weights[k].shape or v.dtype != weights[k].dtype]
    optim: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            i = int(idx)
            if not 0 <= i < len(params) or (value.dim() and value.shape != params[i].shape):
                bad.append(name)
            optim.setdefault(i, {})[key] = value
    if bad or "rng.torch" not in tensors:
        return f"its tensors do not fit the drafter ({bad[:5] or 'no rng.torch'})"
    model.load_state_dict(model_part, strict=True)
    optimizer.load_state_dict({"state": optim, "param_groups": optimizer.state_dict()["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    return None


# ----------------------------------------------------------------------------------------------------------------


def _train(
    target_dir: str | Path | nn.Module,
    rows: Sequence[Row],
    draft_vocab: DraftVocab,
    config: TrainConfig,
    out_dir: Path,
    emit: Callable[[str], None],
    eval_rows: Sequence[Row] | None,
    state_dir: Path | None,
) -> TrainResult:
    _check_config(config)
    store = TrainState(state_dir) if state_dir is not None else None
    if store is not None and out_dir.resolve() in (store.path.resolve(), *store.path.resolve().parents):
        raise ValueError(f"state_dir {store.path} lies inside out_dir {out_dir}, which export replaces; move it out")
    with store.lock() if store is not None else nullcontext():
        return _train_locked(target_dir, rows, draft_vocab, config, out_dir, emit, eval_rows, store)


def _train_locked(
    target_dir: str | Path | nn.Module,
    rows: Sequence[Row],
    draft_vocab: DraftVocab,
    config: TrainConfig,
    out_dir: Path,
    emit: Callable[[str], None],
    eval_rows: Sequence[Row] | None,
    store: TrainState | None,
) -> TrainResult:
    target = load_target(target_dir)
    tconf = target.config
    _, layers, _, lm_head = decoder_parts(target)
    embed = target.get_input_embeddings().weight
    vocab_size = int(embed.shape[0])
    if draft_vocab.target_vocab_size != vocab_size:
        raise ValueError(
            f"the draft vocab was built for a vocab of {draft_vocab.target_vocab_size} ids but the target's "
            f"embedding has {vocab_size} rows; rebuild draft_vocab with target_vocab_size={vocab_size}"
        )
    capture = aux_layer_ids(len(layers), config.aux_layer_ids)
    prepared, reasons, truncated = _prepare_rows(rows, vocab_size, config.max_length)
    if not prepared:
        raise ValueError(
            f"no usable training row (skipped: {reasons or 'none given'}); rows need input_ids within the target "
            "vocab and at least one completion token after the first position"
        )
    notes = list(draft_vocab.notes)
    tokens_per_epoch = int(sum(r.ids.size for r in prepared))
    hidden = int(tconf.hidden_size)
    cache_bytes = tokens_per_epoch * 3 * hidden * 4 + sum(r.teacher.size for r in prepared) * (hidden * 4 + 8)
    use_cache = config.epochs > 1 and cache_bytes <= config.feature_cache_bytes
    emit(
        f"drafter: {len(prepared)} rows ({sum(reasons.values())} skipped {reasons or ''}, {truncated} truncated), "
        f"{tokens_per_epoch} tokens/epoch, aux capture ids {capture} (config layer ids "
        f"{[c - 1 for c in capture]}), draft vocab {draft_vocab.draft_vocab_size}/{vocab_size}, "
        f"features {'cached' if use_cache else 'recomputed per batch'}"
    )

    dtype_name = config.export_dtype or _stored_dtype(target_dir, tconf)
    dconf = DrafterConfig.from_target(tconf, draft_vocab.draft_vocab_size, capture, config.intermediate_size)
    # The caller runs us inside torch.random.fork_rng: seeding here neither reads nor disturbs its generator.
    torch.manual_seed(config.seed)
    model = Eagle3DraftModel(
        dconf, embed_weight=embed.float(), draft_token_ids=torch.from_numpy(draft_vocab.draft_token_ids)
    )
    model.train()
    draft_ids = torch.from_numpy(draft_vocab.draft_token_ids)
    teacher_w = lm_head.weight.detach()[draft_ids].float()
    teacher_b = lm_head.bias.detach()[draft_ids].float() if getattr(lm_head, "bias", None) is not None else None
    in_draft = torch.from_numpy(draft_vocab.t2d)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    batches = _make_batches(prepared, config.batch_tokens)
    n_batches = len(batches)
    total_steps = n_batches * config.epochs
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, round(0.05 * total_steps))
    k = config.ttt_steps
    weights = [config.step_weight**i for i in range(k)]

    progress = _Progress.fresh(k)
    fingerprint: dict[str, Any] = {}
    if store is not None:
        t_hash = time.perf_counter()
        fingerprint = _fingerprint(config, dconf, prepared, draft_vocab, target, warmup, total_steps)
        snapshot, why_not = store.load(fingerprint)
        if snapshot is not None:
            why_not = _restore_tensors(model, optimizer, params, snapshot.tensors)
        if snapshot is not None and why_not is None:
            progress = _Progress.from_record(snapshot.step, snapshot.record, snapshot.steps)
            epoch, batch_no = divmod(progress.step, n_batches)
            emit(
                f"resuming from {store.path}: {progress.step}/{total_steps} steps done (epoch {epoch + 1}, batch "
                f"{batch_no}); inputs checked in {time.perf_counter() - t_hash:.1f}s"
                + ("; training is complete, exporting the saved weights" if progress.step == total_steps else "")
            )
        elif why_not is not None:
            line = f"training state in {store.path} not resumed, training from scratch: {why_not}"
            emit(line)
            notes.append(line)
            store.clear()

    t0 = time.perf_counter()
    features = _Features(target, capture, prepared, use_cache and progress.step < total_steps, config.batch_tokens)
    feature_seconds = time.perf_counter() - t0 if features.cache is not None else 0.0

    def save_state() -> None:
        store.save(
            progress.step, _state_tensors(model, optimizer), {"fingerprint": fingerprint, **progress.record()},
            progress.steps,
        )

    resumed_from = progress.step
    state_seconds = 0.0
    seconds_before = progress.train_seconds
    order_of: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))
    t_train = time.perf_counter()
    for step_no in range(progress.step, total_steps):
        epoch, batch_no = divmod(step_no, n_batches)
        if batch_no == 0:
            progress.new_epoch(k)
        if order_of[0] != epoch:
            order_of = (epoch, epoch_order(config.seed, epoch, n_batches))
        t_step = time.perf_counter()
        batch = batches[int(order_of[1][batch_no])]
        feats = features.get(batch)
        ids = _pad([prepared[i].ids for i in batch])
        aux = torch.nn.utils.rnn.pad_sequence([f[0] for f in feats], batch_first=True)
        sup = _supervision(batch, feats, prepared, in_draft, teacher_w, teacher_b)
        if epoch == 0:
            progress.out_of_draft += sup.out_of_draft
        lr = lr_at(step_no, total_steps, warmup, config.lr, config.min_lr_ratio, config.schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total, per_step = _ttt_loss(model, aux, ids, sup, weights, draft_ids)
        s_loss = [ce / n if n else None for n, ce, _ in per_step]
        s_acc = [c / n if n else None for n, _, c in per_step]
        s_n = [n for n, _, _ in per_step]
        for i, (n, ce, correct) in enumerate(per_step):
            progress.loss_sum[i] += ce
            progress.correct[i] += correct
            progress.count[i] += n
        optimizer.zero_grad(set_to_none=True)
        if total.requires_grad:
            total.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
        n_tok = int(sum(prepared[i].ids.size for i in batch))
        progress.tokens_done += n_tok
        dt = time.perf_counter() - t_step
        metrics = StepMetrics(step_no, epoch, float(total.detach()), s_loss, s_acc, s_n, lr, n_tok, dt)
        progress.steps.append(metrics)
        progress.step = step_no + 1
        progress.loss_total += metrics.loss
        emit(
            f"step {step_no + 1}/{total_steps} epoch {epoch + 1} loss {metrics.loss:.4f} "
            f"ce@ttt [{_fmt(s_loss)}] acc@ttt [{_fmt(s_acc, 2)}] lr {lr:.2e} {n_tok / max(dt, 1e-9):.0f} tok/s"
        )
        epoch_end = batch_no == n_batches - 1
        if epoch_end:
            summary = {
                "epoch": epoch,
                "loss": progress.loss_total / n_batches,
                "step_loss": [float(s / c) if c else None for s, c in zip(progress.loss_sum, progress.count)],
                "step_acc": [float(s / c) if c else None for s, c in zip(progress.correct, progress.count)],
                "supervised": [int(c) for c in progress.count],
            }
            progress.epochs.append(summary)
            emit(f"epoch {epoch + 1}: mean loss {summary['loss']:.4f} acc@ttt [{_fmt(summary['step_acc'], 3)}]")
        every = config.save_every_steps
        if store is not None and (epoch_end or (every and progress.step % every == 0)):
            t_save = time.perf_counter()
            progress.train_seconds = seconds_before + (t_save - t_train) - state_seconds
            save_state()
            state_seconds += time.perf_counter() - t_save
    if progress.step > resumed_from:
        progress.train_seconds = seconds_before + (time.perf_counter() - t_train) - state_seconds
    train_seconds = progress.train_seconds
    tokens_per_s = progress.tokens_done / max(train_seconds, 1e-9)
    if progress.out_of_draft:
        notes.append(
            f"{progress.out_of_draft} teacher positions had a target argmax outside the draft vocab (not trained)"
        )

    model.eval()
    report = export_checkpoint(model, tconf, draft_vocab, capture, out_dir, dtype=dtype_name)
    emit(f"exported {out_dir} ({dtype_name}); training {train_seconds:.1f}s, {tokens_per_s:.0f} tok/s")

    acceptance = None
    if eval_rows:
        acceptance = simulate_acceptance(
            target, model, draft_vocab, eval_rows, k=config.acceptance_k, max_positions=config.acceptance_max_positions
        )
        emit(
            f"simulated acceptance (k={acceptance.k}, {acceptance.n_verifications} verifications): "
            f"tau {acceptance.tau:.3f}, per position [{_fmt(acceptance.per_position_acceptance, 3)}]"
        )

    result = TrainResult(
        checkpoint_dir=out_dir,
        checkpoint=report,
        steps=progress.steps,
        epochs=progress.epochs,
        rows_used=len(prepared),
        rows_skipped=sum(reasons.values()),
        skip_reasons=reasons,
        rows_truncated=truncated,
        tokens_per_epoch=tokens_per_epoch,
        out_of_draft_positions=progress.out_of_draft,
        feature_seconds=feature_seconds,
        train_seconds=train_seconds,
        tokens_per_s=tokens_per_s,
        aux_capture_ids=capture,
        drafter_config=dconf,
        config=config,
        acceptance=acceptance,
        notes=notes,
        resumed_from_step=resumed_from,
        state_dir=store.path if store is not None else None,
        state_seconds=state_seconds,
    )
    (out_dir / "training_metrics.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return result


def _stored_dtype(target_dir: str | Path | nn.Module, tconf: Any) -> str:
    """The dtype the target's weights are stored in (its config.json), which SGLang will serve it in."""
    raw: dict[str, Any] = {}
    if not isinstance(target_dir, nn.Module):
        path = Path(target_dir) / "config.json"
        if path.is_file():
            raw = json.loads(path.read_text())
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _fmt(values: Sequence[float | None], digits: int = 3) -> str:
    return ",".join("-" if v is None else f"{v:.{digits}f}" for v in values)
