"""Train a drafter on prompt + completion rows, on CPU or GPU: the loop any drafter family plugs into.

The family (``drafter.family.DraftFamily``, chosen by ``training.drafter.architecture``; EAGLE-3 today) gives the
model, the loss of a batch (EAGLE-3: training-time test, :mod:`~eagle_assets.drafter.eagle3.ttt_loss`) and the
export. The pieces live beside it: the recipe and step plan in :mod:`~eagle_assets.drafter.training.recipe`, rows,
batches and cached target features in :mod:`~eagle_assets.drafter.features.local_cache`, the learning curve and early
stopping in :mod:`~eagle_assets.drafter.training.learning_curve`, the crash-safe resumable state in
:mod:`~eagle_assets.drafter.training.state`.

One run: check and cut the rows, pack them into batches, plan the steps (:func:`~eagle_assets.drafter.training.
recipe.plan_steps`), compute the target features once, then per optimizer step: the batch's teacher distributions, the
TTT unroll and loss, backward, clip, AdamW. Every ``eval_every_tokens`` tokens and at the end, the validation rows
are scored (TTT loss and simulated tau: a point of the learning curve); with ``patience`` the run stops when tau
stops improving and keeps the best weights. Resumable runs (``state_dir``) write their whole state every
``save_every_steps`` steps, at every epoch end and after every evaluation, and when started again on the same
inputs continue from the last one and end with the weights of an unbroken run (bitwise on CPU with the same
thread count).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.drafter.data.vocab import DraftVocab
from eagle_assets.drafter.evaluation.acceptance import AcceptanceResult, simulate_acceptance
from eagle_assets.drafter.family import TrainBatch, block_rows, family_for
from eagle_assets.drafter.features.local_cache import PreparedRow, cache_bytes, make_batches, pad, prepare_rows
from eagle_assets.drafter.features.source import feature_source
from eagle_assets.drafter.training.distributed import DataParallel
from eagle_assets.drafter.training.learning_curve import CurvePoint, EarlyStopping, StepMetrics
from eagle_assets.drafter.training.recipe import (
    SCHEDULES,
    TRAJECTORY_FIELDS,
    StepPlan,
    TrainConfig,
    check_config,
    lr_at,
    plan_steps,
)
from eagle_assets.drafter.training.state import (
    STATE_VERSION,
    Progress,
    TrainState,
    fingerprint,
    restore_tensors,
    state_tensors,
)
from eagle_assets.storage.shards import write_text_atomic
from eagle_assets.target_model.config import optional_json_config

Row = tuple[np.ndarray, np.ndarray]

__all__ = [
    "SCHEDULES", "STATE_VERSION", "TRAJECTORY_FIELDS", "StepMetrics", "TrainConfig", "TrainResult", "TrainState",
    "epoch_order", "load_target", "lr_at", "train_drafter",
]


@dataclass
class TrainResult:
    """Outcome of :func:`train_drafter`.

    Attributes:
        checkpoint_dir: the exported SGLang directory.
        checkpoint: its validation report.
        steps: per-step metrics.
        epochs: per-epoch means (``loss``, ``step_loss``, ``step_acc`` token-weighted over the epoch), completed
            epochs only.
        rows_used / rows_skipped: rows trained on / left out, with ``skip_reasons`` counts.
        rows_truncated: rows cut to ``max_length``.
        tokens_per_epoch: tokens of the used rows (after truncation).
        out_of_draft_positions: teacher positions dropped because the target argmax is not in the draft vocab.
        feature_seconds / train_seconds: time spent extracting cached target features / in the optimization loop.
        eval_seconds: time spent scoring the validation rows (the learning curve), not part of ``train_seconds``.
        tokens_per_s: training throughput (tokens processed by the loop per second, all epochs).
        aux_capture_ids: target capture ids used.
        drafter_config: the drafter's shape.
        plan: the step plan (steps, warm-up, evaluation interval, what limited the run).
        curve: the learning curve (one :class:`CurvePoint` per evaluation; empty without validation rows).
        best_step: the step whose weights were exported when ``keep_best`` (else the last step); -1 = last.
        stopped_early: the run ended before ``plan.total_steps`` because validation tau stopped improving.
        validation_rows: validation rows used.
        acceptance: simulated acceptance on ``eval_rows`` (None when none were given).
        resumed_from_step: optimizer steps restored from a saved state (0 = trained from scratch); ``steps`` still
            lists every step of the run, the restored ones read back from the state.
        state_dir: where the training state was kept (None = not kept).
        state_seconds: time spent writing training states (not part of ``train_seconds``).
    """

    checkpoint_dir: Path
    checkpoint: Any  # the family's checkpoint report (EAGLE-3: eagle3.export.CheckpointReport)
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
    drafter_config: Any  # the family's drafter config (EAGLE-3: eagle3.model.DrafterConfig)
    config: TrainConfig
    plan: StepPlan | None = None
    curve: list[CurvePoint] = field(default_factory=list)
    best_step: int = -1
    stopped_early: bool = False
    validation_rows: int = 0
    eval_seconds: float = 0.0
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
            "eval_seconds": self.eval_seconds,
            "tokens_per_s": self.tokens_per_s,
            "aux_capture_ids": self.aux_capture_ids,
            "drafter_config": self.drafter_config.to_dict(),
            "config": asdict(self.config),
            "plan": {**asdict(self.plan), "epochs": self.plan.epochs} if self.plan else None,
            "curve": [p.to_dict() for p in self.curve],
            "best_step": self.best_step,
            "stopped_early": self.stopped_early,
            "validation_rows": self.validation_rows,
            "acceptance": self.acceptance.to_dict() if self.acceptance else None,
            "notes": self.notes,
            "resumed_from_step": self.resumed_from_step,
            "state_dir": str(self.state_dir) if self.state_dir else None,
            "state_seconds": self.state_seconds,
        }


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


def epoch_order(seed: int, epoch: int, n_batches: int) -> np.ndarray:
    """Batch order of ``epoch``: int64 ``[n_batches]``, a permutation drawn from ``SeedSequence([seed, epoch])``.

    Depends on nothing else (not on earlier epochs or on how many batches a crashed run had consumed), so a run
    resumed mid-epoch continues the same order.
    """
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n_batches)


def train_drafter(
    target_dir: str | Path | nn.Module,
    rows: Sequence[Row],
    draft_vocab: DraftVocab,
    config: TrainConfig,
    out_dir: str | Path,
    log: Callable[[str], None] | None = None,
    eval_rows: Sequence[Row] | None = None,
    state_dir: str | Path | None = None,
    validation_rows: Sequence[Row] | None = None,
    parallel: DataParallel | None = None,
    features: Any = None,
) -> TrainResult | None:
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
            ``config``, same rows and validation rows after truncation, same draft vocab, same target weights,
            same :data:`STATE_VERSION`), training continues from it and ends with the weights an unbroken run would
            have (bitwise on CPU with the same thread count). A state for other inputs, or a damaged one, is never
            continued: it is deleted and training starts over, with a log line and a note in
            :attr:`TrainResult.notes` naming what differed. (Starting over rather than raising because the usual
            cause is an edited catalog or new data on a pipeline re-run, where the user wants the new run, not an
            error asking them to delete files.) A finished state is reused as is: the run only exports. The
            directory must lie outside ``out_dir``, which export replaces.
        validation_rows: rows (same form as ``rows``, never trained on) scored during training for the learning
            curve and early stopping; None or empty = no curve, no early stopping.
        parallel: this process's rank in a data-parallel run
            (:func:`~eagle_assets.drafter.distributed.from_environment`; every rank calls this function with the
            same arguments); None = one process. Rank 0 logs, holds the ``state_dir`` lock, saves and exports.
        features: where the target features come from (catalog ``training.features``, a ``FeaturesSpec``):
            None or ``source: local`` = the target loaded here (``target_dir``); ``served`` = an SGLang server in
            aux-capture mode (:mod:`~eagle_assets.drafter.features.source`; only ``config.json`` and the input
            embedding are read from ``target_dir``, and rows the server refuses are skipped as ``served_<reason>``).

    Returns:
        :class:`TrainResult` (None on the ranks other than 0 of a data-parallel run).

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
        check_config(config)
        store = TrainState(state_dir) if state_dir is not None else None
        out = Path(out_dir)
        if store is not None and out.resolve() in (store.path.resolve(), *store.path.resolve().parents):
            raise ValueError(f"state_dir {store.path} lies inside out_dir {out}, which export replaces; move it out")
        # Training draws from its own torch RNG stream (seeded with config.seed, saved in the state) so neither the
        # caller's generator nor earlier calls change the weights.
        parallel = parallel or DataParallel()
        locked = store is not None and parallel.is_main
        with torch.random.fork_rng(devices=[]), (store.lock() if locked else nullcontext()):
            run = _Run(target_dir, rows, validation_rows or [], draft_vocab, config, emit, store, parallel,
                       features)
            run.train()
            return run.finish(out, eval_rows) if parallel.is_main else None
    finally:
        torch.set_num_threads(previous_threads)


class _Run:
    """One training run: set up (rows, plan, model, resumed state, features), :meth:`train`, :meth:`finish`."""

    def __init__(self, target_dir, rows: Sequence[Row], validation: Sequence[Row], draft_vocab: DraftVocab,
                 config: TrainConfig, emit: Callable[[str], None], store: TrainState | None,
                 parallel: DataParallel | None = None, features: Any = None):
        self.config, self.emit, self.store, self.vocab = config, emit, store, draft_vocab
        self.parallel = parallel or DataParallel()
        self.source = feature_source(target_dir, features, load_target, emit)  # training.features: local | served
        self.target = self.source.target  # served: only the target's config and input embedding
        self.target_dir = target_dir
        embed = self.source.embedding
        vocab_size = int(embed.shape[0])
        if draft_vocab.target_vocab_size != vocab_size:
            raise ValueError(
                f"the draft vocab was built for a vocab of {draft_vocab.target_vocab_size} ids but the target's "
                f"embedding has {vocab_size} rows; rebuild draft_vocab with target_vocab_size={vocab_size}"
            )
        self.family = family_for(config.drafter.architecture)
        self.capture = self.family.capture_ids(self.source.num_layers, config.aux_layer_ids, config.drafter)
        self.rows, self.reasons, self.truncated = prepare_rows(rows, vocab_size, config.max_length)
        self.rows = self.source.admit(self.rows, self.reasons, "train", self.capture, draft_vocab,
                                      parallel=self.parallel, batch_tokens=config.batch_tokens)
        if not self.rows:
            raise ValueError(
                f"no usable training row (skipped: {self.reasons or 'none given'}); rows need input_ids within the "
                "target vocab and at least one completion token after the first position"
            )
        self.validation, _, _ = prepare_rows(validation, vocab_size, config.max_length)
        self.validation = self.source.admit(self.validation, {}, "validation", self.capture, draft_vocab,
                                            parallel=self.parallel)
        self.notes = list(draft_vocab.notes)
        self.batches = make_batches(self.rows, config.batch_tokens)
        self.plan = plan_steps([sum(self.rows[i].ids.size for i in b) for b in self.batches], config)
        hidden = int(self.target.config.hidden_size)
        use_cache = (self.plan.total_steps > len(self.batches)
                     and cache_bytes(self.rows, hidden) <= config.feature_cache_bytes)
        emit(
            f"drafter: {len(self.rows)} rows ({sum(self.reasons.values())} skipped {self.reasons or ''}, "
            f"{self.truncated} truncated), {self.plan.tokens_per_epoch} tokens/epoch in {len(self.batches)} batches, "
            f"{self.plan.total_steps} steps ({self.plan.epochs:.2f} epochs, limited by {self.plan.limited_by}), "
            f"{len(self.validation)} validation rows, aux capture ids {self.capture} (config layer ids "
            f"{[c - 1 for c in self.capture]}), draft vocab {draft_vocab.draft_vocab_size}/{vocab_size}, "
            f"features {self.source.describe(use_cache)}"
        )

        self.dtype_name = config.export_dtype or _stored_dtype(target_dir, self.target.config)
        self.dconf = self.family.config_from_target(self.target.config, draft_vocab.draft_vocab_size, self.capture,
                                                    config.intermediate_size, config.drafter)
        # The caller runs us inside torch.random.fork_rng: seeding here neither reads nor disturbs its generator.
        torch.manual_seed(config.seed)
        self.draft_ids = torch.from_numpy(draft_vocab.draft_token_ids)
        self.teacher_w, self.teacher_b = self.source.teacher(self.draft_ids)  # lm_head rows (None when served)
        self.model = self.family.build_model(self.dconf, embed.float(), self.draft_ids, self.source.lm_head_weight())
        self.model.train()
        self.in_draft = torch.from_numpy(draft_vocab.t2d)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay)
        self.n_steps = self.family.loss_steps(self.dconf, config.ttt_steps)  # per-step figures of the loss
        self.weights = [config.step_weight**i for i in range(self.n_steps)]
        self.progress = Progress.fresh(self.n_steps)
        self.stopping = EarlyStopping(config.patience, config.min_delta)
        self.best: dict[str, torch.Tensor] | None = None
        self.fingerprint: dict[str, Any] = {}
        if store is not None:
            # rank 0 loads (or clears) the shared state first; the other ranks then read what it settled
            self.parallel.main_first(self._resume)
            self.parallel.check_same("the resumed optimizer step", self.progress.step)
        self.resumed_from = self.progress.step
        self.objective = self.parallel.wrap(self.model)  # DDP over the TTT loss; None for one process

        t0 = time.perf_counter()
        todo = self.progress.step < self.plan.total_steps and not self.stopping.stop
        self.features = self.source.feature_cache(self.target, self.capture, self.rows, use_cache and todo,
                                                  config.batch_tokens,
                                     only=self.parallel.owned_rows(self.batches))
        self.feature_seconds = time.perf_counter() - t0 if self.features.cache is not None else 0.0
        self.val_features = self.source.feature_cache(self.target, self.capture, self.validation,
                                                      todo and self.parallel.is_main,
                                         config.batch_tokens)
        self.val_acceptance: dict[int, Any] = self.source.acceptance_features("validation")
        self.state_seconds = 0.0

    def _resume(self) -> None:
        t_hash = time.perf_counter()
        self.fingerprint = fingerprint(self.config, self.dconf, self.rows, self.validation, self.vocab, self.target,
                                       self.plan)
        self.fingerprint.update(self.source.fingerprint())  # served: layers, teacher, K
        snapshot, why_not = self.store.load(self.fingerprint)
        best = None
        if snapshot is not None:
            why_not, best = restore_tensors(self.model, self.optimizer, self.params, snapshot.tensors)
        if snapshot is not None and why_not is None:
            self.progress = Progress.from_record(snapshot.step, snapshot.record, snapshot.steps)
            if self.progress.stopping is not None:
                self.stopping = EarlyStopping.from_record(self.config.patience, self.config.min_delta,
                                                          self.progress.stopping)
            self.best = best
            epoch, batch_no = divmod(self.progress.step, self.plan.batches_per_epoch)
            done = self.progress.step == self.plan.total_steps or self.stopping.stop
            self.emit(
                f"resuming from {self.store.path}: {self.progress.step}/{self.plan.total_steps} steps done (epoch "
                f"{epoch + 1}, batch {batch_no}); inputs checked in {time.perf_counter() - t_hash:.1f}s"
                + ("; training is complete, exporting the saved weights" if done else "")
            )
        elif why_not is not None:
            line = f"training state in {self.store.path} not resumed, training from scratch: {why_not}"
            self.emit(line)
            self.notes.append(line)
            self.store.clear()

    # -- the loop ------------------------------------------------------------------------------------------------

    def train(self) -> None:
        """Run the remaining optimizer steps (or none, for a finished state)."""
        config, plan, progress = self.config, self.plan, self.progress
        k, n_batches = self.n_steps, plan.batches_per_epoch
        seconds_before = progress.train_seconds
        order: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))
        t_train = time.perf_counter()
        paused = 0.0  # seconds of evaluation and state saving inside this loop, not training
        for step_no in range(progress.step, plan.total_steps):
            if self.stopping.stop:
                break
            epoch, batch_no = divmod(step_no, n_batches)
            if batch_no == 0:
                progress.new_epoch(k)
            if order[0] != epoch:
                order = (epoch, epoch_order(config.seed, epoch, n_batches))
            self._step(step_no, epoch, self.batches[int(order[1][batch_no])])
            epoch_end = batch_no == n_batches - 1
            if epoch_end:
                self._close_epoch(epoch, n_batches)
            last = progress.step == plan.total_steps
            evaluate = bool(self.validation) and (last or (plan.eval_every_steps
                                                           and progress.step % plan.eval_every_steps == 0))
            if evaluate:
                t_eval = time.perf_counter()
                self._evaluate()
                paused += time.perf_counter() - t_eval
            every = config.save_every_steps
            if self.store is not None and (epoch_end or evaluate or (every and progress.step % every == 0)):
                t_save = time.perf_counter()
                progress.train_seconds = seconds_before + (t_save - t_train) - paused
                self._save()
                self.state_seconds += time.perf_counter() - t_save
                paused += time.perf_counter() - t_save
        if progress.step > self.resumed_from:
            progress.train_seconds = seconds_before + (time.perf_counter() - t_train) - paused
        if self.stopping.stop and progress.step < plan.total_steps:
            self.emit(f"early stop after step {progress.step}: validation tau did not improve by "
                      f"{config.min_delta} in {config.patience} evaluations (best {self.stopping.best_tau:.3f} at "
                      f"step {self.stopping.best_step})")

    def _batch(self, rows: list[PreparedRow], features: Any, index: list[int], anchors: Any = None) -> TrainBatch:
        """The family's view of ``rows[index]`` (right-padded), with their cached or fetched target features and,
        for a block family, the blocks ``anchors`` drawn for them (None: the family draws from their masks)."""
        feats = features.get(index)
        ids = pad([rows[i].ids for i in index])
        final = self.source.final_teacher([rows[i].teacher for i in index], feats, tuple(ids.shape)) \
            if self.family.wants_target_hidden else {}  # target_hidden (local) or target_logprobs (served)
        return TrainBatch(
            aux=torch.nn.utils.rnn.pad_sequence([f[0] for f in feats], batch_first=True),
            ids=ids, anchors=anchors, **final,
            loss_mask=pad([rows[i].mask.astype(np.int64) for i in index]).bool(),
            supervision=self.source.supervision([rows[i].teacher for i in index], feats, self.in_draft,
                                                self.teacher_w, self.teacher_b),
            draft_token_ids=self.draft_ids)

    def _anchors(self, rows: list[PreparedRow], batch: list[int], local: list[int],
                 generator: torch.Generator | None = None) -> Any:
        """A block family's blocks of this rank's rows ``local`` of the global ``batch``: drawn once over the whole
        global batch's masks (every rank draws the same, as one process does: torch's generator stays in step on
        every rank), then cut to ``local``. None for a family without ``draw_anchors`` or an empty shard."""
        if self.family.draw_anchors is None or not local:
            return None
        drawn = self.family.draw_anchors(pad([rows[i].mask.astype(np.int64) for i in batch]).bool(), generator)
        where = {row: n for n, row in enumerate(batch)}
        return block_rows(drawn, [where[i] for i in local])

    def _step(self, step_no: int, epoch: int, batch: list[int]) -> None:
        config, progress = self.config, self.progress
        t_step = time.perf_counter()
        local = self.parallel.shard(batch)  # this rank's rows of the global batch (all of them for one process)
        anchors = self._anchors(self.rows, batch, local)
        train_batch = self._batch(self.rows, self.features, local, anchors) if local else None
        lr = lr_at(step_no, self.plan.total_steps, self.plan.warmup_steps, config.lr, config.min_lr_ratio,
                   config.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total, loss, per_step, out_of_draft = self.parallel.batch_loss(self.family.batch_loss, self.model,
                                                                       self.objective, train_batch, self.weights,
                                                                       self.family.loss_counts)
        if epoch == 0:
            progress.out_of_draft += out_of_draft
        s_loss = [ce / n if n else None for n, ce, _ in per_step]
        s_acc = [c / n if n else None for n, _, c in per_step]
        for i, (n, ce, correct) in enumerate(per_step):
            progress.loss_sum[i] += ce
            progress.correct[i] += correct
            progress.count[i] += n
        self.optimizer.zero_grad(set_to_none=True)
        if total.requires_grad:
            total.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, config.grad_clip)
            self.optimizer.step()
        n_tok = int(sum(self.rows[i].ids.size for i in batch))
        progress.tokens_done += n_tok
        dt = time.perf_counter() - t_step
        metrics = StepMetrics(step_no, epoch, loss, s_loss, s_acc, [n for n, _, _ in per_step], lr, n_tok, dt)
        progress.steps.append(metrics)
        progress.step = step_no + 1
        progress.loss_total += metrics.loss
        progress.since_eval_loss += metrics.loss
        progress.since_eval_steps += 1
        self.emit(
            f"step {step_no + 1}/{self.plan.total_steps} epoch {epoch + 1} loss {metrics.loss:.4f} "
            f"ce@ttt [{_fmt(s_loss)}] acc@ttt [{_fmt(s_acc, 2)}] lr {lr:.2e} {n_tok / max(dt, 1e-9):.0f} tok/s"
        )

    def _close_epoch(self, epoch: int, n_batches: int) -> None:
        p = self.progress
        summary = {
            "epoch": epoch,
            "loss": p.loss_total / n_batches,
            "step_loss": [float(s / c) if c else None for s, c in zip(p.loss_sum, p.count)],
            "step_acc": [float(s / c) if c else None for s, c in zip(p.correct, p.count)],
            "supervised": [int(c) for c in p.count],
        }
        p.epochs.append(summary)
        self.emit(f"epoch {epoch + 1}: mean loss {summary['loss']:.4f} acc@ttt [{_fmt(summary['step_acc'], 3)}]")

    def _evaluate(self) -> None:
        """Score the validation rows: one point of the learning curve, and the early-stopping decision."""
        # rank 0 scores; every rank applies its point, so all take the same early-stopping decision
        point = CurvePoint(**self.parallel.from_main(lambda: self._score().to_dict()))
        p = self.progress
        p.curve.append(point)
        p.since_eval_loss, p.since_eval_steps = 0.0, 0
        p.eval_seconds += point.seconds
        if self.stopping.update(point) and self.config.keep_best:
            self.best = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        p.stopping = self.stopping.record()
        self.emit(
            f"eval at {p.tokens_done} tokens (step {p.step}): train loss {point.train_loss:.4f} val loss "
            f"{point.val_loss:.4f} val tau {point.val_tau:.3f} (best {self.stopping.best_tau:.3f} at step "
            f"{self.stopping.best_step}) in {point.seconds:.1f}s"
        )

    @torch.no_grad()
    def _score(self) -> CurvePoint:
        """The learning-curve point of the current weights on the validation rows."""
        t0 = time.perf_counter()
        p = self.progress
        self.model.eval()
        try:
            ce_sum = [0.0] * self.n_steps
            correct = [0] * self.n_steps
            count = [0] * self.n_steps
            # a block family's validation blocks come from a generator of their own, seeded the same at every
            # evaluation: the same blocks score every point of the curve, and training's generator (which rank 0
            # alone would advance here) is left alone
            blocks = torch.Generator().manual_seed(self.config.seed)
            for batch in make_batches(self.validation, self.config.batch_tokens):
                anchors = self._anchors(self.validation, batch, batch, blocks)
                _, per_step = self.family.batch_loss(self.model, self._batch(self.validation, self.val_features,
                                                                            batch, anchors), self.weights)
                for i, (n, ce, c) in enumerate(per_step):
                    ce_sum[i] += ce
                    correct[i] += c
                    count[i] += n
            acc = simulate_acceptance(self.target, self.model, self.vocab,
                                      [(r.ids, r.mask.astype(np.int8)) for r in self.validation],
                                      k=self.config.acceptance_k, max_positions=None, features=self.val_acceptance,
                                      greedy_next=self.source.greedy_next)
        finally:
            self.model.train()
        # on the training loss's scale: sum_i w_i * mean soft CE of TTT step i, pooled over the validation rows
        val_loss = sum(w * s / n for w, s, n in zip(self.weights, ce_sum, count) if n)
        return CurvePoint(
            step=p.step, tokens=p.tokens_done,
            train_loss=p.since_eval_loss / max(1, p.since_eval_steps),
            val_loss=float(val_loss), val_tau=float(acc.tau),
            val_acc=[c / n if n else None for c, n in zip(correct, count)],
            seconds=time.perf_counter() - t0,
        )

    def _save(self) -> None:
        if not self.parallel.is_main:
            return  # one state per run, written by rank 0 (the ranks' weights are the same)
        self.store.save(
            self.progress.step, state_tensors(self.model, self.optimizer, self.best),
            {"fingerprint": self.fingerprint, **self.progress.record()}, self.progress.steps,
        )

    # -- export ----------------------------------------------------------------------------------------------------

    def finish(self, out_dir: Path, eval_rows: Sequence[Row] | None) -> TrainResult:
        """Export the kept weights, simulate acceptance on ``eval_rows``, write ``training_metrics.json``."""
        p, config = self.progress, self.config
        train_seconds = p.train_seconds
        tokens_per_s = p.tokens_done / max(train_seconds, 1e-9)
        if p.out_of_draft:
            self.notes.append(
                f"{p.out_of_draft} teacher positions had a target argmax outside the draft vocab (not trained)"
            )
        best_step = -1
        if config.keep_best and self.best is not None and self.stopping.best_step != p.step:
            self.model.load_state_dict(self.best)
            best_step = self.stopping.best_step
            self.emit(f"exporting the weights of step {best_step} (best validation tau "
                      f"{self.stopping.best_tau:.3f}), not of the last step {p.step}")
        self.model.eval()
        report = self.family.export(self.model, self.target.config, self.vocab, self.capture, out_dir,
                                    dtype=self.dtype_name)
        self.emit(f"exported {out_dir} ({self.dtype_name}); training {train_seconds:.1f}s, {tokens_per_s:.0f} tok/s")
        acceptance = None
        if eval_rows:
            eval_rows, served = self.source.acceptance_rows(eval_rows, self.capture, self.vocab)
            acceptance = simulate_acceptance(self.target, self.model, self.vocab, eval_rows, k=config.acceptance_k,
                                             max_positions=config.acceptance_max_positions, **served)
            self.emit(
                f"simulated acceptance (k={acceptance.k}, {acceptance.n_verifications} verifications): "
                f"tau {acceptance.tau:.3f}, per position [{_fmt(acceptance.per_position_acceptance, 3)}]"
            )
        result = TrainResult(
            checkpoint_dir=out_dir,
            checkpoint=report,
            steps=p.steps,
            epochs=p.epochs,
            rows_used=len(self.rows),
            rows_skipped=sum(self.reasons.values()),
            skip_reasons=self.reasons,
            rows_truncated=self.truncated,
            tokens_per_epoch=self.plan.tokens_per_epoch,
            out_of_draft_positions=p.out_of_draft,
            feature_seconds=self.feature_seconds,
            train_seconds=train_seconds,
            tokens_per_s=tokens_per_s,
            aux_capture_ids=self.capture,
            drafter_config=self.dconf,
            config=config,
            plan=self.plan,
            curve=p.curve,
            best_step=best_step,
            stopped_early=self.stopping.stop and p.step < self.plan.total_steps,
            validation_rows=len(self.validation),
            eval_seconds=p.eval_seconds,
            acceptance=acceptance,
            notes=self.notes,
            resumed_from_step=self.resumed_from,
            state_dir=self.store.path if self.store is not None else None,
            state_seconds=self.state_seconds,
        )
        write_text_atomic(json.dumps(result.to_dict(), indent=1) + "\n", out_dir / "training_metrics.json")
        return result


def _stored_dtype(target_dir: str | Path | nn.Module, tconf: Any) -> str:
    """The dtype the target's weights are stored in (its config.json), which SGLang will serve it in."""
    raw = {} if isinstance(target_dir, nn.Module) else optional_json_config(target_dir)
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _fmt(values: Sequence[float | None], digits: int = 3) -> str:
    return ",".join("-" if v is None else f"{v:.{digits}f}" for v in values)
