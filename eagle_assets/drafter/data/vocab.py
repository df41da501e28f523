"""Draft vocabulary: the subset of target ids the EAGLE-3 drafter predicts over.

Format (SGLang ``python/sglang/srt/models/llama_eagle3.py``, ``LlamaForCausalLMEagle3.load_weights``):

- ``d2t``: int64 ``[draft_vocab_size]``; ``d2t[i]`` is the target id of draft id ``i`` MINUS ``i`` (an offset). SGLang
  reads it as ``hot_token_id = d2t + arange(draft_vocab_size)``.
- ``t2d``: bool ``[target_vocab_size]``; True for the target ids that are in the draft vocab. SGLang skips it, but
  trainers that build teacher distributions with ``logits[..., t2d]`` (SpecForge) read the draft order from it.

A boolean mask can only describe ascending target order, so the draft ids are ordered by ascending target id
(as SpecForge's ``process_token_dict_to_mappings`` does): ``nonzero(t2d) == d2t + arange(draft_vocab_size)``.
Frequency decides WHICH ids enter (most frequent first, ties by lower id), not their order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import numpy as np


@dataclass(frozen=True)
class DraftVocab:
    """A validated draft vocabulary.

    Attributes:
        d2t: int64 ``[draft_vocab_size]`` offsets: target id of draft id ``i`` is ``i + d2t[i]``.
        t2d: bool ``[target_vocab_size]`` membership mask of the draft ids in the target vocab.
        counts: int64 ``[target_vocab_size]`` token counts the vocab was built from (zeros when unknown).
        notes: human-readable remarks made while building (clamping, filling); empty when nothing was adjusted.
    """

    d2t: np.ndarray
    t2d: np.ndarray
    counts: np.ndarray
    notes: tuple[str, ...] = field(default=())

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def draft_token_ids(self) -> np.ndarray:
        """int64 ``[draft_vocab_size]``: target id of every draft id, ascending."""
        return self.d2t + np.arange(self.d2t.shape[0], dtype=np.int64)

    def coverage(self) -> float:
        """Share (0..1) of the counted tokens whose id is in the draft vocab; 1.0 when nothing was counted."""
        total = int(self.counts.sum())
        if total == 0:
            return 1.0
        return float(self.counts[self.t2d].sum()) / total


def build_draft_vocab(
    token_counts: Mapping[int, int] | np.ndarray,
    target_vocab_size: int,
    draft_vocab_size: int,
) -> DraftVocab:
    """Pick the ``draft_vocab_size`` most frequent target ids and encode them as ``d2t``/``t2d``.

    Args:
        token_counts: counts of target ids over the loss-masked completion tokens, either a mapping
            ``{token_id: count}`` or an integer array of length ``target_vocab_size`` indexed by token id.
        target_vocab_size: the target model's vocab size (``config.vocab_size``; the embedding's row count).
        draft_vocab_size: requested draft vocab size (EAGLE-3 default 32,000).

    Returns:
        DraftVocab with ids chosen by count (descending, ties by lower id) and stored in ascending id order.
        When fewer distinct ids were counted than requested, the remainder is filled with the lowest unused ids
        (deterministic, never a crash). A request larger than the target vocab is clamped to it. Both adjustments
        are recorded in ``DraftVocab.notes``.

    Raises:
        ValueError: negative counts, ids outside ``[0, target_vocab_size)``, a wrong-length count array, or a
            non-positive size; the message says which.
    """
    if int(target_vocab_size) <= 0:
        raise ValueError(f"target_vocab_size must be positive, got {target_vocab_size}")
    if int(draft_vocab_size) <= 0:
        raise ValueError(f"draft_vocab_size must be positive, got {draft_vocab_size}; use e.g. 32000")
    vocab = int(target_vocab_size)
    counts = _counts_array(token_counts, vocab)
    notes: list[str] = []

    size = int(draft_vocab_size)
    if size > vocab:
        notes.append(
            f"draft_vocab_size {size} exceeds the target vocab ({vocab}); clamped to {vocab} "
            "(the draft vocab is then the whole target vocab)"
        )
        size = vocab

    # Stable sort on -count keeps ties in ascending id order.
    order = np.argsort(-counts, kind="stable")
    seen = order[counts[order] > 0]
    if seen.shape[0] >= size:
        chosen = seen[:size]
    else:
        missing = size - seen.shape[0]
        unused = np.ones(vocab, dtype=bool)
        unused[seen] = False
        filler = np.flatnonzero(unused)[:missing]
        notes.append(
            f"only {seen.shape[0]} distinct tokens were counted for a draft vocab of {size}; "
            f"filled {missing} slots with the lowest unused ids ({int(filler[0])}..{int(filler[-1])})"
        )
        chosen = np.concatenate([seen, filler])

    ids = np.sort(chosen.astype(np.int64))
    d2t = ids - np.arange(size, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[ids] = True
    validate_draft_vocab(d2t, t2d, vocab)
    return DraftVocab(d2t=d2t, t2d=t2d, counts=counts, notes=tuple(notes))


def count_completion_tokens(
    rows: Iterable[tuple[np.ndarray, np.ndarray]], target_vocab_size: int
) -> np.ndarray:
    """Count target ids over loss-masked (completion) tokens of training rows.

    Args:
        rows: ``(input_ids, loss_mask)`` pairs; int ``[T]`` ids and 0/1 ``[T]`` masks (1 = completion token).
        target_vocab_size: the target vocab size.

    Returns:
        int64 ``[target_vocab_size]`` counts.

    Raises:
        ValueError: a row whose ids and mask differ in length, or an id outside the vocab (names the row index).
    """
    counts = np.zeros(int(target_vocab_size), dtype=np.int64)
    for i, (ids, mask) in enumerate(rows):
        ids = np.asarray(ids)
        mask = np.asarray(mask)
        if ids.shape != mask.shape:
            raise ValueError(f"row {i}: input_ids has shape {ids.shape} but loss_mask has {mask.shape}")
        sel = ids[mask.astype(bool)].astype(np.int64)
        if sel.size and (sel.min() < 0 or sel.max() >= target_vocab_size):
            raise ValueError(f"row {i}: token id outside [0, {target_vocab_size})")
        counts += np.bincount(sel, minlength=int(target_vocab_size))
    return counts


def count_completion_tokens_in_shards(
    paths: Iterable, target_vocab_size: int, include: Callable[[list[str]], np.ndarray] | None = None,
    batch_rows: int = 4096,
) -> tuple[np.ndarray, int]:
    """``count_completion_tokens`` by a streaming pass over QC shards (``qc.qc_pass.QC_SCHEMA`` Parquet files):
    one record batch of ``batch_rows`` rows in memory at a time, counted over the flat ``input_ids`` / ``loss_mask``
    arrays (no per-row Python).

    Args:
        paths: the shard files, in order.
        target_vocab_size: the target vocab size.
        include: sample ids of a batch -> bool array, True for the rows to count (e.g. the training split); None
            counts every row.
    Returns: (int64 ``[target_vocab_size]`` counts, rows counted).
    Raises: ValueError for a row whose ids and mask differ in length or an id outside the vocab (names the shard).
    """
    import pyarrow.parquet as pq

    vocab = int(target_vocab_size)
    counts = np.zeros(vocab, dtype=np.int64)
    n_rows = 0
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows,
                                                      columns=["sample_id", "input_ids", "loss_mask"]):
            ids_col, mask_col = batch.column(1), batch.column(2)
            ids_off = ids_col.offsets.to_numpy()
            mask_off = mask_col.offsets.to_numpy()
            if not np.array_equal(ids_off - ids_off[0], mask_off - mask_off[0]):
                raise ValueError(f"{path}: a row whose input_ids and loss_mask differ in length")
            ids = ids_col.values.to_numpy()[ids_off[0]:ids_off[-1]]
            mask = mask_col.values.to_numpy()[mask_off[0]:mask_off[-1]].astype(bool)
            if include is not None:
                rows = np.asarray(include(batch.column(0).to_pylist()), dtype=bool)
                mask &= np.repeat(rows, np.diff(ids_off))
                n_rows += int(rows.sum())
            else:
                n_rows += batch.num_rows
            sel = ids[mask]
            if sel.size and (sel.min() < 0 or sel.max() >= vocab):
                raise ValueError(f"{path}: token id outside [0, {vocab})")
            counts += np.bincount(sel, minlength=vocab)
    return counts, n_rows


def draft_vocab_from_arrays(d2t: np.ndarray, t2d: np.ndarray, counts: np.ndarray | None = None) -> DraftVocab:
    """Wrap stored ``d2t``/``t2d`` arrays (e.g. read back from a checkpoint) after validating them.

    Raises:
        ValueError: as :func:`validate_draft_vocab`.
    """
    d2t = np.asarray(d2t)
    t2d = np.asarray(t2d)
    validate_draft_vocab(d2t, t2d, int(t2d.shape[0]) if t2d.ndim == 1 else -1)
    if counts is None:
        counts = np.zeros(t2d.shape[0], dtype=np.int64)
    return DraftVocab(d2t=d2t.astype(np.int64), t2d=t2d.astype(bool), counts=np.asarray(counts, dtype=np.int64))


def validate_draft_vocab(d2t: np.ndarray, t2d: np.ndarray, vocab_size: int) -> None:
    """Check ``d2t``/``t2d`` against the SGLang/SpecForge contract (see module docstring).

    Args:
        d2t: int64 ``[draft]`` offsets.
        t2d: bool ``[vocab_size]`` mask.
        vocab_size: the target vocab size.

    Raises:
        ValueError: naming the first broken rule: dtype (d2t int64, t2d bool), rank, t2d length vs vocab size, mapped
            ids outside ``[0, vocab_size)``, duplicate or descending ids, or ``nonzero(t2d) != d2t + arange``.
    """
    d2t = np.asarray(d2t)
    t2d = np.asarray(t2d)
    if d2t.dtype != np.int64:
        raise ValueError(f"d2t must be int64 (SGLang adds it to arange(int64)); got {d2t.dtype}")
    if t2d.dtype != np.bool_:
        raise ValueError(f"t2d must be bool; got {t2d.dtype}")
    if d2t.ndim != 1 or t2d.ndim != 1:
        raise ValueError(f"d2t and t2d must be 1-D; got shapes {d2t.shape} and {t2d.shape}")
    if t2d.shape[0] != vocab_size:
        raise ValueError(f"t2d has length {t2d.shape[0]} but the target vocab size is {vocab_size}")
    if d2t.shape[0] == 0:
        raise ValueError("d2t is empty: a draft vocab needs at least one id")
    if d2t.shape[0] > vocab_size:
        raise ValueError(f"draft vocab ({d2t.shape[0]}) is larger than the target vocab ({vocab_size})")
    ids = d2t + np.arange(d2t.shape[0], dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"d2t maps draft id {i} to target id {int(ids[i])}, outside [0, {vocab_size}); "
            "d2t must hold offsets (target id minus draft id), not target ids"
        )
    if ids.shape[0] > 1 and not np.all(np.diff(ids) > 0):
        i = int(np.flatnonzero(np.diff(ids) <= 0)[0])
        raise ValueError(
            f"draft ids {i} and {i + 1} map to target ids {int(ids[i])} and {int(ids[i + 1])}: target ids must be "
            "unique and ascending so that nonzero(t2d) lists them in draft order"
        )
    if int(t2d.sum()) != d2t.shape[0]:
        raise ValueError(f"t2d marks {int(t2d.sum())} ids but d2t has {d2t.shape[0]} entries")
    if not np.array_equal(np.flatnonzero(t2d), ids):
        raise ValueError("t2d and d2t disagree: nonzero(t2d) must equal d2t + arange(draft_vocab_size)")


def _counts_array(token_counts: Mapping[int, int] | np.ndarray, vocab: int) -> np.ndarray:
    if isinstance(token_counts, np.ndarray):
        arr = np.asarray(token_counts)
        if arr.ndim != 1 or arr.shape[0] != vocab:
            raise ValueError(
                f"a count array must be 1-D with one entry per target id ({vocab}); got shape {arr.shape}"
            )
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token counts must be integers; got dtype {arr.dtype}")
        counts = arr.astype(np.int64)
    else:
        counts = np.zeros(vocab, dtype=np.int64)
        for key, value in token_counts.items():
            tid = int(key)
            if not 0 <= tid < vocab:
                raise ValueError(
                    f"token id {tid} in the counts is outside the target vocab [0, {vocab}); "
                    "were the counts made with another tokenizer?"
                )
            counts[tid] += int(value)
    if (counts < 0).any():
        raise ValueError(f"token counts must be non-negative; id {int(np.flatnonzero(counts < 0)[0])} is negative")
    return counts
