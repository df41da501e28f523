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
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
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
        seed: seeds initialization and batch order; same seed + same rows + same threads = same losses.
        aux_layer_ids: target CAPTURE ids (None = SGLang default ``[2, L//2, L-3]``).
        warmup_steps: linear warm-up steps; None = 5% of all steps (at least 1).
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
    """

    lr: float = 3e-4
    epochs: int = 2
    max_length: int = 2048
    batch_tokens: int = 4096
    ttt_steps: int = 7
    seed: int = 0
    aux_layer_ids: tuple[int, ...] | None = None
    warmup_steps: int | None = None
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
        log: called with one human-readable line per optimizer step and a few summary lines.
        eval_rows: optional held-out rows for :func:`simulate_acceptance` after training.

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: the draft vocab does not match the target vocab, no row has a supervised position, or the aux
            ids do not fit the target (the message says what to change).
    """
    emit = log or (lambda _line: None)
    previous_threads = torch.get_num_threads()
    if config.num_threads:
        torch.set_num_threads(int(config.num_threads))
    try:
        return _train(target_dir, rows, draft_vocab, config, Path(out_dir), emit, eval_rows)
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


def _lr_at(step: int, total: int, warmup: int, lr: float, floor: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _train(
    target_dir: str | Path | nn.Module,
    rows: Sequence[Row],
    draft_vocab: DraftVocab,
    config: TrainConfig,
    out_dir: Path,
    emit: Callable[[str], None],
    eval_rows: Sequence[Row] | None,
) -> TrainResult:
    if config.ttt_steps < 1 or config.epochs < 1 or config.batch_tokens < 1 or config.max_length < 2:
        raise ValueError(
            "ttt_steps, epochs and batch_tokens must be >= 1 and max_length >= 2; "
            f"got {config.ttt_steps}, {config.epochs}, {config.batch_tokens}, {config.max_length}"
        )
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

    t0 = time.perf_counter()
    features = _Features(target, capture, prepared, use_cache, config.batch_tokens)
    feature_seconds = time.perf_counter() - t0 if use_cache else 0.0

    dtype_name = config.export_dtype or _stored_dtype(target_dir, tconf)
    dconf = DrafterConfig.from_target(tconf, draft_vocab.draft_vocab_size, capture, config.intermediate_size)
    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's global RNG
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
    total_steps = len(batches) * config.epochs
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, round(0.05 * total_steps))
    k = config.ttt_steps
    weights = [config.step_weight**i for i in range(k)]

    steps: list[StepMetrics] = []
    epochs: list[dict[str, Any]] = []
    out_of_draft = 0
    step_no = 0
    tokens_done = 0
    t_train = time.perf_counter()
    for epoch in range(config.epochs):
        rng = np.random.default_rng(config.seed + epoch)
        order = rng.permutation(len(batches))
        ep_loss_sum = np.zeros(k)
        ep_correct = np.zeros(k)
        ep_count = np.zeros(k)
        ep_total = 0.0
        for bi in order:
            t_step = time.perf_counter()
            batch = batches[int(bi)]
            feats = features.get(batch)
            ids = _pad([prepared[i].ids for i in batch])
            aux = torch.nn.utils.rnn.pad_sequence([f[0] for f in feats], batch_first=True)
            sup = _supervision(batch, feats, prepared, in_draft, teacher_w, teacher_b)
            if epoch == 0:
                out_of_draft += sup.out_of_draft
            lr = _lr_at(step_no, total_steps, warmup, config.lr, config.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            total, per_step = _ttt_loss(model, aux, ids, sup, weights, draft_ids)
            s_loss = [ce / n if n else None for n, ce, _ in per_step]
            s_acc = [c / n if n else None for n, _, c in per_step]
            s_n = [n for n, _, _ in per_step]
            for i, (n, ce, correct) in enumerate(per_step):
                ep_loss_sum[i] += ce
                ep_correct[i] += correct
                ep_count[i] += n
            optimizer.zero_grad(set_to_none=True)
            if total.requires_grad:
                total.backward()
                if config.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
                optimizer.step()
            n_tok = int(sum(prepared[i].ids.size for i in batch))
            tokens_done += n_tok
            dt = time.perf_counter() - t_step
            metrics = StepMetrics(step_no, epoch, float(total.detach()), s_loss, s_acc, s_n, lr, n_tok, dt)
            steps.append(metrics)
            ep_total += metrics.loss
            emit(
                f"step {step_no + 1}/{total_steps} epoch {epoch + 1} loss {metrics.loss:.4f} "
                f"ce@ttt [{_fmt(s_loss)}] acc@ttt [{_fmt(s_acc, 2)}] lr {lr:.2e} {n_tok / max(dt, 1e-9):.0f} tok/s"
            )
            step_no += 1
        summary = {
            "epoch": epoch,
            "loss": ep_total / max(1, len(batches)),
            "step_loss": [float(s / c) if c else None for s, c in zip(ep_loss_sum, ep_count)],
            "step_acc": [float(s / c) if c else None for s, c in zip(ep_correct, ep_count)],
            "supervised": [int(c) for c in ep_count],
        }
        epochs.append(summary)
        emit(
            f"epoch {epoch + 1}: mean loss {summary['loss']:.4f} acc@ttt [{_fmt(summary['step_acc'], 3)}]"
        )
    train_seconds = time.perf_counter() - t_train
    tokens_per_s = tokens_done / max(train_seconds, 1e-9)
    if out_of_draft:
        notes.append(f"{out_of_draft} teacher positions had a target argmax outside the draft vocab (not trained)")

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
        steps=steps,
        epochs=epochs,
        rows_used=len(prepared),
        rows_skipped=sum(reasons.values()),
        skip_reasons=reasons,
        rows_truncated=truncated,
        tokens_per_epoch=tokens_per_epoch,
        out_of_draft_positions=out_of_draft,
        feature_seconds=feature_seconds,
        train_seconds=train_seconds,
        tokens_per_s=tokens_per_s,
        aux_capture_ids=capture,
        drafter_config=dconf,
        config=config,
        acceptance=acceptance,
        notes=notes,
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
