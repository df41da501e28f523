"""Training rows as the trainer holds them: checked and cut rows, length-sorted batches, and the target features
of every row computed once (the target is frozen, so its aux hidden states, final hidden states and greedy ids at
the teacher positions never change between epochs).

Where the time goes (demo target, 2 cores): one target forward per row costs about as much as a drafter TTT step
over it, so recomputing features every epoch would nearly double the run; cached, the extraction is paid once
(``TrainResult.feature_seconds``) and a step holds only the drafter's forward, backward and AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.drafter.features.local_capture import head_argmax, run_target
from eagle_assets.drafter.features.teacher import teacher_positions

Row = tuple[np.ndarray, np.ndarray]


@dataclass
class PreparedRow:
    """One usable row: ``ids`` int64 ``[T]``, ``mask`` bool ``[T]`` (completion tokens), ``teacher`` int64 ``[N]``."""

    ids: np.ndarray
    mask: np.ndarray
    teacher: np.ndarray


def prepare_rows(
    rows: Sequence[Row], vocab_size: int, max_length: int
) -> tuple[list[PreparedRow], dict[str, int], int]:
    """Check and cut ``(input_ids, loss_mask)`` rows; a malformed row is skipped and counted, never fatal.

    Returns:
        ``(rows, skip reason -> count, rows cut to max_length)``. Reasons: ``not_a_pair``, ``shape_mismatch``,
        ``too_short``, ``id_out_of_vocab``, ``mask_not_binary``, ``no_completion_tokens``.
    """
    prepared: list[PreparedRow] = []
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
        prepared.append(PreparedRow(ids.astype(np.int64), mask.astype(bool), teacher))
    return prepared, reasons, truncated


def make_batches(rows: Sequence[PreparedRow], batch_tokens: int) -> list[list[int]]:
    """Row indices per batch: rows sorted by length (longest first), a batch holds rows while
    ``rows x longest <= batch_tokens`` (a row longer than ``batch_tokens`` forms a batch of its own)."""
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


def pad(arrays: Sequence[np.ndarray], value: int = 0) -> torch.Tensor:
    """Right-pad 1-D int arrays into int64 ``[B, max T]``."""
    t = max(a.size for a in arrays)
    out = np.full((len(arrays), t), value, dtype=np.int64)
    for b, a in enumerate(arrays):
        out[b, : a.size] = a
    return torch.from_numpy(out)


def cache_bytes(rows: Sequence[PreparedRow], hidden: int) -> int:
    """Bytes :class:`FeatureCache` holds for ``rows`` (float32 aux ``[T, 3H]``, teacher hidden ``[N, H]``, ids)."""
    return sum(r.ids.size * 3 * hidden * 4 + r.teacher.size * (hidden * 4 + 8) for r in rows)


Features = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class FeatureCache:
    """Target features per row: aux ``[T, 3H]``, final-normed hidden at the teacher positions ``[N, H]`` and the
    target's greedy ids there ``[N]`` (float32 / int64).

    Args:
        target: the frozen target; capture: its capture ids.
        rows: the rows features are asked for by index.
        cache: compute every row's features now (in batches of ``batch_tokens``) and keep them; False = compute
            them on every :meth:`get` (for data too large to hold).
        only: with ``cache``, the indices of the rows to compute and keep (None = all): a data-parallel rank's
            own rows (:meth:`~eagle_assets.drafter.distributed.DataParallel.owned_rows`); :meth:`get` of another
            row then computes it.
    """

    def __init__(self, target: nn.Module, capture: list[int], rows: Sequence[PreparedRow], cache: bool,
                 batch_tokens: int, only: Sequence[int] | None = None):
        self.target = target
        self.capture = capture
        self.rows = rows
        self.cache: dict[int, Features] | None = None
        if cache:
            self.cache = {}
            index = list(range(len(rows))) if only is None else sorted(only)
            for batch in make_batches([rows[i] for i in index], batch_tokens):
                batch = [index[j] for j in batch]
                for i, feats in zip(batch, self._compute(batch)):
                    self.cache[i] = feats

    def _compute(self, batch: list[int]) -> list[Features]:
        ids = pad([self.rows[i].ids for i in batch])
        aux, final = run_target(self.target, ids, self.capture)
        out = []
        for b, i in enumerate(batch):
            row = self.rows[i]
            t = row.ids.size
            teacher_hidden = final[b, torch.from_numpy(row.teacher)]
            greedy = head_argmax(self.target, teacher_hidden)
            out.append((aux[b, :t].contiguous(), teacher_hidden.contiguous(), greedy))
        return out

    def get(self, batch: list[int]) -> list[Features]:
        """Features of the rows ``batch`` (indices into ``rows``), in that order."""
        if self.cache is not None and all(i in self.cache for i in batch):
            return [self.cache[i] for i in batch]
        return self._compute(batch)
