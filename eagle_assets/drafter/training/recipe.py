"""The drafter's training recipe: :class:`TrainConfig`, how many optimizer steps a run takes, the learning rate of
each step, and the recommended settings per target class.

How long to train
-----------------
A run is sized by the data, not by a fixed epoch count: rows are packed into length-sorted batches of about
``batch_tokens`` tokens, and the run takes enough optimizer steps to process ``train_tokens`` tokens, capped at
``epochs`` passes (whichever is reached first; either may be None). So a small dataset gets many passes, a large
one a fraction of a pass, and both get a number of steps that fits the token budget (:func:`plan_steps`). Held-out
validation rows are scored every ``eval_every_tokens`` tokens (TTT loss and simulated tau); with
``patience`` > 0 the run stops after that many evaluations without a tau gain of ``min_delta`` and keeps the best
weights seen (early stopping on the held-out signal, never on the rows it reports).

Why the demo default differs from the old one (2 epochs, ``batch_tokens`` 4096): on the demo data that was 22-36
optimizer steps, and the drafter ended as a frequency guesser (tau 1.34 at k = 7); the same trainer reached 6.6
after 24 epochs. The step count, not the model or its wiring, was the limit.

What SpecForge and speculators do per step, and why we differ
-------------------------------------------------------------
- Batch: SpecForge trains one row per GPU per step (``training.batch_size: 1``, global batch = data-parallel
  ranks, typically 8); speculators packs rows into one sequence of ``--total-seq-len 8192`` tokens with a
  block-diagonal mask. We batch whole rows of similar length up to ``batch_tokens`` (right-padded, causal, so no
  mask): like packing, a step holds about the same number of tokens whatever the row lengths, so short tool-call
  rows are not each a full noisy step; unlike packing, no attention mask is needed, and the padding of
  length-sorted batches is small. On CPU, small batches are cheap (the drafter is one layer), and the demo data is
  small (~47 training rows), so the demo default is SpecForge's one row per step (``batch_tokens: 1``): many small
  steps are what the demo drafter needed (measured, ``bench/bench_drafter_quality.py``: one-row steps over 120k
  tokens reach held-out tau 5.7 at k = 7 where 2 epochs of 4096-token batches reached 1.3).
- TTT length: SpecForge unrolls 7 steps (``ttt_length``), speculators 3 (``--ttt-steps``). More steps teach the
  later draft positions what they will see when serving, at a cost linear in the steps; ``ttt_steps`` is a
  catalog setting, and the acceptance check always drafts ``acceptance_k`` tokens (SGLang's
  ``--speculative-num-steps``) whatever the training unroll was.
- Loss normalisation: SpecForge's ``_compute_loss`` takes ``-sum(p * log q)`` at masked positions divided by
  every position of the padded ``[B, T]`` batch; speculators divides by the number of supervised positions. We
  divide by the supervised positions (speculators), so a step's gradient does not shrink with the share of prompt
  and padding tokens in its rows. Steps are weighted ``0.8^i`` (SpecForge's ``ploss_decay``; speculators' default
  ``--ttt-step-loss-decay`` is 1.0).
- Optimizer and learning rate: SpecForge uses AdamW (betas 0.9/0.999, no weight decay), lr 1e-4 (8B) / 5e-5
  (DeepSeek-V3 671B), cosine to 0 after 1.5% warm-up, grad-norm clip 0.5; speculators lr 1e-4 (3e-5 in several
  examples) with Muon on the matrices. We use AdamW with betas 0.9/0.95 (a shorter memory of the second moment
  suits short runs), cosine to 10% of lr after 5% warm-up, clip 1.0. The demo target is 32x narrower than an 8B
  model (hidden 128), and a narrow layer tolerates a proportionally larger step (Yang et al., muP, arXiv
  2203.03466: Adam's lr scales as 1 / width), hence 3e-3 there.

Recommended settings per target class (catalog ``training:`` section)
--------------------------------------------------------------------
======================  ==========  ============  ===========  ==========  ============================
target                  lr          batch_tokens  ttt_steps    epochs      train_tokens
======================  ==========  ============  ===========  ==========  ============================
embedded demo (h=128)   3e-3        1 (1 row)     7            40          120000 (~6.6 x the rows)
8B class (h=4096)       1e-4        16384         7            10          null (all 10 epochs)
1T class (h=7168, MoE)  5e-5        16384         7            10          null, or a budget in tokens
======================  ==========  ============  ===========  ==========  ============================

8B class (Llama-3.1-8B, Qwen3-8B): SpecForge's examples (``examples/configs/llama3.1-8b-eagle3-online.yaml``,
``qwen3-8b-eagle3-offline.yaml``) train lr 1e-4, one row of up to 4096 tokens per GPU on 8 GPUs, 10 epochs;
16384 tokens per step is the same number of tokens per optimizer step. 1T class (Kimi-K2, DeepSeek-V3):
SpecForge's ``deepseek-v3-671b-eagle3-online.yaml`` halves the lr (5e-5) at the same batch; the drafter's hidden
size follows the target (7168), and the target forward dominates the cost, so features are best captured once
(offline) and ``train_tokens`` bounds the run. ``draft_vocab_size`` 32000 for both (EAGLE-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from eagle_assets.drafter.family import DraftArchitecture

#: learning-rate schedules :func:`lr_at` knows.
SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of :func:`~eagle_assets.drafter.train.train_drafter` (see the module docstring).

    Attributes:
        lr: peak AdamW learning rate.
        epochs: at most this many passes over the rows (may be fractional; None = no cap).
        train_tokens: at most this many row tokens (prompt + completion, after truncation) through the optimizer
            (None = no cap). At least one of ``epochs`` and ``train_tokens`` must be set; the run takes the
            number of steps of the smaller (:func:`plan_steps`).
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
        acceptance_k: drafts per verification in every simulated acceptance (validation and ``eval_rows``).
        acceptance_max_positions: verification cap for the final simulation on ``eval_rows`` (None = all).
        eval_every_tokens: with validation rows, they are scored every this many training tokens and at the end
            (the learning curve); 0 = at the end only.
        patience: early stopping: stop after this many evaluations in a row without a validation tau gain of at
            least ``min_delta`` over the best so far (0 = never stop early).
        min_delta: see ``patience``.
        keep_best: export the weights of the best validation tau (True) or the last step's (False).
        save_every_steps: with a ``state_dir``, a training state is written every this many optimizer steps and at
            the end of every epoch and evaluation (0 = at those points only). Ignored without a ``state_dir``.
        drafter: which drafter to build (:class:`~eagle_assets.drafter.family.DraftArchitecture`; resolved against
            the target, it is part of the drafter config every saved state is fingerprinted with).
    """

    lr: float = 3e-4
    epochs: float | None = 10.0
    train_tokens: int | None = None
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
    eval_every_tokens: int = 0
    patience: int = 0
    min_delta: float = 0.0
    keep_best: bool = True
    save_every_steps: int = 50
    drafter: DraftArchitecture = field(default_factory=DraftArchitecture)

    def __post_init__(self) -> None:
        if isinstance(self.drafter, dict):  # read back from JSON (train_command, training_metrics.json)
            object.__setattr__(self, "drafter", DraftArchitecture(**self.drafter))


#: TrainConfig fields that change the sequence of weights (or, through early stopping, where it ends); a saved
#: state only resumes a run that agrees on all of them (num_threads, feature_cache_bytes, export settings,
#: acceptance_max_positions and save_every_steps do not change it).
TRAJECTORY_FIELDS = (
    "lr", "epochs", "train_tokens", "max_length", "batch_tokens", "ttt_steps", "seed", "aux_layer_ids",
    "warmup_steps", "schedule", "min_lr_ratio", "weight_decay", "grad_clip", "step_weight", "intermediate_size",
    "acceptance_k", "eval_every_tokens", "patience", "min_delta", "keep_best",
)


@dataclass(frozen=True)
class StepPlan:
    """How a run is laid out over its batches.

    Attributes:
        batches_per_epoch: batches in one pass over the rows.
        total_steps: optimizer steps of the whole run (step ``s`` is batch ``s % batches_per_epoch`` of epoch
            ``s // batches_per_epoch``; the last epoch may be partial).
        warmup_steps: linear warm-up steps.
        eval_every_steps: steps between validation evaluations (0 = at the end only).
        tokens_per_epoch: row tokens of one pass.
        limited_by: ``"epochs"`` or ``"train_tokens"``: which cap set ``total_steps``.
    """

    batches_per_epoch: int
    total_steps: int
    warmup_steps: int
    eval_every_steps: int
    tokens_per_epoch: int
    limited_by: str

    @property
    def epochs(self) -> float:
        """Passes over the rows the run makes (``total_steps / batches_per_epoch``)."""
        return self.total_steps / self.batches_per_epoch


def config_from_catalog(training: Any, **overrides: Any) -> TrainConfig:
    """The :class:`TrainConfig` of a catalog ``training`` section (``eagle_assets.catalog.TrainingSpec``), with
    ``overrides`` (TrainConfig field names) applied."""
    t = training
    fields = dict(lr=t.lr, epochs=t.epochs, train_tokens=t.train_tokens, max_length=t.max_length,
                  batch_tokens=t.batch_tokens, ttt_steps=t.ttt_steps, seed=t.seed,
                  aux_layer_ids=tuple(t.aux_layer_ids) if t.aux_layer_ids is not None else None,
                  warmup_steps=t.warmup_steps, schedule=t.schedule, acceptance_k=t.acceptance_k,
                  acceptance_max_positions=t.acceptance_max_positions, eval_every_tokens=t.eval_every_tokens,
                  patience=t.patience, min_delta=t.min_delta, save_every_steps=t.save_every_steps,
                  num_threads=t.threads, drafter=DraftArchitecture(**t.drafter.model_dump()))
    fields.update(overrides)
    return TrainConfig(**fields)


def plan_steps(batch_tokens: Sequence[int], config: TrainConfig) -> StepPlan:
    """The step plan of a run whose epoch is ``batch_tokens`` (row tokens of each batch, in batch order).

    Steps: ``min(ceil(epochs * B), ceil(train_tokens / mean tokens per batch))`` (over the caps that are set),
    at least 1, where ``B = len(batch_tokens)``. Warm-up: ``config.warmup_steps`` or 5% of the steps (at least 1).
    Evaluations every ``round(eval_every_tokens / mean tokens per batch)`` steps (at least 1) when
    ``eval_every_tokens`` is set.

    Raises:
        ValueError: no batch, or neither ``epochs`` nor ``train_tokens`` is set.
    """
    n = len(batch_tokens)
    if n == 0:
        raise ValueError("no batch to plan")
    per_epoch = int(sum(batch_tokens))
    per_batch = per_epoch / n
    caps: dict[str, int] = {}
    if config.epochs is not None:
        caps["epochs"] = math.ceil(config.epochs * n - 1e-9)
    if config.train_tokens is not None:
        caps["train_tokens"] = math.ceil(config.train_tokens / per_batch - 1e-9)
    if not caps:
        raise ValueError("set training.epochs or training.train_tokens (or both: the run stops at the first)")
    limited_by = min(caps, key=lambda k: (caps[k], k))
    total = max(1, caps[limited_by])
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, round(0.05 * total))
    every = max(1, round(config.eval_every_tokens / per_batch)) if config.eval_every_tokens else 0
    return StepPlan(n, total, warmup, every, per_epoch, limited_by)


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


def check_config(config: TrainConfig) -> None:
    """Raise ``ValueError("invalid TrainConfig: ...")`` naming every out-of-range field."""
    problems = []
    if config.ttt_steps < 1 or config.batch_tokens < 1 or config.acceptance_k < 1:
        problems.append(
            f"ttt_steps, batch_tokens and acceptance_k must be >= 1 (got {config.ttt_steps}, "
            f"{config.batch_tokens}, {config.acceptance_k})"
        )
    if config.epochs is None and config.train_tokens is None:
        problems.append("set epochs or train_tokens (or both: the run stops at the first)")
    if config.epochs is not None and not config.epochs > 0:
        problems.append(f"epochs must be > 0 or None (got {config.epochs})")
    if config.train_tokens is not None and config.train_tokens < 1:
        problems.append(f"train_tokens must be >= 1 or None (got {config.train_tokens})")
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
    if config.eval_every_tokens < 0 or config.patience < 0 or config.min_delta < 0:
        problems.append(
            f"eval_every_tokens, patience and min_delta must be >= 0 (got {config.eval_every_tokens}, "
            f"{config.patience}, {config.min_delta})"
        )
    if problems:
        raise ValueError("invalid TrainConfig: " + "; ".join(problems))
