"""The training-time-test (TTT) loss of an EAGLE-3 drafter: per-step rows and weights over the teacher signal of
``features.teacher`` (teacher positions, the target's distribution, soft cross-entropy).

A teacher position ``q`` teaches token ``q + 1`` (``features.teacher.teacher_positions``). TTT step ``i`` trains
drafter row ``p = q - i - 1`` (inputs: aux of ``p``, embeddings of ``x[p+1..p+i+1]``) against that teacher; rows
``p < 0`` do not exist.

Loss per step ``i``: soft cross-entropy (forward KL up to the teacher's entropy) of the drafter's draft-vocab
distribution against the target's softmax restricted to the draft vocab, averaged over that step's supervised rows
(a per-token mean, as speculators' ``loss_function`` divides by ``loss_mask.sum()``; SpecForge's ``_compute_loss``
divides by every position of the padded batch instead, so its gradient shrinks with the share of prompt and
padding tokens); total = sum_i ``step_weight``^i * loss_i (0.8^i: EAGLE-3 / SpecForge ``ploss_decay``). Accuracy
per step: the drafter's argmax (mapped to a
target id) equals the target's argmax.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from eagle_assets.drafter.eagle3.model import Eagle3DraftModel
from eagle_assets.drafter.features.teacher import Supervision, soft_cross_entropy


def drafter_rows(teacher: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Drafter rows trained at TTT ``step`` and the teacher positions they learn from.

    Returns:
        ``(rows, teachers)``: ``rows = teachers - step - 1``, keeping only ``rows >= 0``.
    """
    rows = np.asarray(teacher, dtype=np.int64) - step - 1
    keep = rows >= 0
    return rows[keep], np.asarray(teacher, dtype=np.int64)[keep]


def ttt_loss(
    model: Eagle3DraftModel,
    aux: torch.Tensor,
    ids: torch.Tensor,
    sup: Supervision,
    weights: Sequence[float],
    draft_ids: torch.Tensor,
    normalizer: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[tuple[int, float, int]]]:
    """Weighted TTT loss of one batch and, per step, ``(supervised rows, summed soft CE, correct argmaxes)``.

    Args:
        aux: float32 ``[B, T, 3H]`` right-padded aux hidden states; ids: int64 ``[B, T]`` the rows' tokens.
        weights: per TTT step its loss weight (``len(weights)`` steps are unrolled).
        draft_ids: int64 ``[D]`` target id of each draft id.
        normalizer: per TTT step, the count its summed soft CE is divided by; None = this batch's own supervised
            rows (the mean). A data-parallel rank passes the global batch's counts, so that the ranks' losses add
            up to the loss of the whole batch (:mod:`~eagle_assets.drafter.training.distributed`).

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
        total = total + weights[i] * (ce.mean() if normalizer is None else ce.sum() / normalizer[i])
        with torch.no_grad():
            want = sup.greedy if everyone else sup.greedy[valid]
            per_step.append((n, float(ce.sum()), int((draft_ids[logits.argmax(-1)] == want).sum())))
    return total, per_step
