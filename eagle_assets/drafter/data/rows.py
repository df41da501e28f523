"""A training or test row's token structure as the acceptance walk reads it: completion segments, and whether a row
can be walked at all (no torch)."""

from __future__ import annotations

import numpy as np


def completion_segments(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of ``loss_mask == 1``."""
    m = np.asarray(loss_mask).astype(bool).astype(np.int8)
    edges = np.diff(np.concatenate([[0], m, [0]]))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), ends.tolist()))


def walkable(row, vocab_size: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]] | str:
    """``(input_ids int64 [T], loss_mask [T], completion segments)`` of a row :func:`simulate_acceptance` walks, or
    why it does not: a reason for a malformed row, ``""`` for a well-formed one without a segment to draft in (a
    completion run of >= 2 tokens after the first position). Feature sources that fetch rows ahead of the walk
    (``features.source.ServedAcceptanceFeatures``) use it to ask only for rows the walk will read."""
    try:
        ids_np = np.asarray(row[0], dtype=np.int64)
        mask_np = np.asarray(row[1])
        malformed = len(row) != 2 or ids_np.ndim != 1 or ids_np.shape != mask_np.shape or ids_np.size < 3
    except (TypeError, ValueError, IndexError, KeyError):
        malformed = True
    if malformed:
        return "need (input_ids, loss_mask), 1-D, equal length, >= 3 tokens"
    if ids_np.min() < 0 or ids_np.max() >= vocab_size:
        return f"token id outside [0, {vocab_size})"
    segments = [(s, e) for s, e in completion_segments(mask_np) if s >= 1 and e - s >= 2]
    return (ids_np, mask_np, segments) if segments else ""
