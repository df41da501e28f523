"""The teacher signal a drafter learns from, whatever its family: which positions teach (alignment), the target's
distribution over the draft vocab there, and the soft cross-entropy against it.

Alignment (explicit because SpecForge issue 885 shows how easily it slips by one): the target's logits at position
``q`` are its prediction of token ``q + 1``. A teacher position is a ``q`` whose NEXT token is a completion token
(``loss_mask[q + 1] == 1``), so the first answer token ``x[a]`` (a = prompt length) is supervised through the
teacher at ``q = a - 1``. Teacher positions whose target argmax lies outside the draft vocab are left out (the
drafter cannot propose that token; SpecForge's ``position_mask`` does the same) and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F


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
class Supervision:
    """Teacher positions of one batch.

    Attributes:
        row: int64 ``[N]`` row of each position within the batch.
        position: int64 ``[N]`` teacher position ``q`` (see :func:`teacher_positions`).
        teacher_p: float32 ``[N, D]`` the target's softmax over the draft vocab at ``q``.
        greedy: int64 ``[N]`` the target's full-vocab greedy id at ``q``.
        out_of_draft: teacher positions dropped because that greedy id is not in the draft vocab.
    """

    row: torch.Tensor
    position: torch.Tensor
    teacher_p: torch.Tensor
    greedy: torch.Tensor
    out_of_draft: int


def supervision(
    teachers: Sequence[np.ndarray],
    feats: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    in_draft: torch.Tensor,
    teacher_w: torch.Tensor,
    teacher_b: torch.Tensor | None,
) -> Supervision:
    """The :class:`Supervision` of a batch.

    Args:
        teachers: per row of the batch, its teacher positions int64 ``[N_b]``.
        feats: per row, ``(aux [T, 3H], final-normed hidden at the teacher positions [N_b, H], greedy ids [N_b])``
            (:class:`~eagle_assets.drafter.features.local_cache.FeatureCache`).
        in_draft: bool ``[V]`` (``DraftVocab.t2d``).
        teacher_w, teacher_b: the target's lm_head rows of the draft vocab ``[D, H]`` (and bias ``[D]`` or None).
    """
    rows, positions, hidden, greedy = [], [], [], []
    dropped = 0
    for b, (teacher, (_aux, teacher_hidden, teacher_greedy)) in enumerate(zip(teachers, feats)):
        keep = in_draft[teacher_greedy]
        dropped += int((~keep).sum())
        q = torch.from_numpy(teacher)[keep]
        rows.append(torch.full_like(q, b))
        positions.append(q)
        hidden.append(teacher_hidden[keep])
        greedy.append(teacher_greedy[keep])
    with torch.no_grad():
        teacher_p = torch.softmax(F.linear(torch.cat(hidden), teacher_w, teacher_b), dim=-1)
    return Supervision(torch.cat(rows), torch.cat(positions), teacher_p, torch.cat(greedy), dropped)
