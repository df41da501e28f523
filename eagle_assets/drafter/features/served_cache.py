"""Served features as the trainer uses them: :func:`served_features` (streamed, or kept in verified shards by
:class:`ShardedFeatures`), the :class:`ServedFeatureCache` (shaped like ``local_cache.FeatureCache``) and the
batch :class:`~eagle_assets.drafter.ttt_loss.Supervision` built from served teachers (:func:`served_supervision`).
Fetching one row and parsing its reply (the shape and finite checks) is
:mod:`eagle_assets.drafter.features.served_client`."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from eagle_assets.drafter.features.served_client import RefusedRow, Row, ServedFeatureSource, row_arrays
from eagle_assets.drafter.features.shard_format import (
    FeatureShardError,
    RowFeatures,
    ShardIndex,
    plan_shards,
    read_rows,
    row_key,
    shard_name,
    verify_shard,
    write_shard,
)
from eagle_assets.drafter.features.teacher import Supervision


def served_features(
    rows: Sequence[Row],
    source: ServedFeatureSource,
    *,
    row_ids: Sequence[str] | None = None,
    cache_dir: str | Path | None = None,
    worker: int = 0,
    workers: int = 1,
) -> Iterator[RowFeatures | RefusedRow]:
    """Served features of ``rows``, in order: the integration point for the trainer.

    Args:
        rows: ``(input_ids, loss_mask)`` pairs (int ``[T]``, 0/1 ``[T]``) or ``PreparedRow`` objects, already cut
            to the trainer's ``max_length`` (features of a prefix do not depend on what follows, so cut first).
        source: a :class:`ServedFeatureSource` (server URL(s), teacher, capture ids).
        row_ids: ids for the rows (default their positions, as strings).
        cache_dir: None = stream (nothing stored); a directory = verified shards there, fetched only when absent
            or refused (refusals are counted in ``source.stats.shards_refused`` and the file is replaced).
        worker / workers: with ``cache_dir``, handle only shards ``worker, worker + workers, ..`` of the plan, so
            ``workers`` processes fill one cache together (parsing JSON holds the GIL: one process parses about
            one core's worth, see docs/served_features.md); a later call with the defaults reads them all.

    Yields:
        :class:`RowFeatures` (aux float32 ``[T, W]``, teacher ids/logprobs ``[N, K]``, greedy ``[N]``) or a
        :class:`RefusedRow` (the row is left out; never fatal). At most one shard plus ``concurrency`` replies per
        server are held at once.

    Raises:
        ServedFeaturesError: the server cannot give features at all.
    """
    arrays = [row_arrays(r) for r in rows]
    ids = [str(i) for i in range(len(arrays))] if row_ids is None else [str(r) for r in row_ids]
    if len(ids) != len(arrays):
        raise ValueError(f"{len(ids)} row_ids for {len(arrays)} rows")
    if cache_dir is None:
        yield from source.fetch((rid, a, m) for rid, (a, m) in zip(ids, arrays))
        return
    if not 0 <= worker < workers:
        raise ValueError(f"worker must be in [0, {workers}), got {worker}")
    store = ShardedFeatures(cache_dir, source)
    for rng in store.plan([a.size for a, _ in arrays])[worker::workers]:
        yield from store.shard(rng, ids, arrays)


class ShardedFeatures:
    """A directory of verified feature shards for one :class:`ServedFeatureSource` (see :func:`served_features`).

    A shard's file name is derived from the spec and the rows'
    :func:`~eagle_assets.drafter.features.shard_format.row_key` values, so a rerun over the same rows reuses it and
    any change of rows or spec fetches anew.
    """

    def __init__(self, cache_dir: str | Path, source: ServedFeatureSource):
        self.dir = Path(cache_dir)
        self.source = source
        self.index_at: dict[int, ShardIndex] = {}  # first row of a planned range -> its verified shard

    def plan(self, lengths: Sequence[int]) -> list[range]:
        return plan_shards(lengths, self.source.spec.width, int(self.source.settings.shard_mb * (1 << 20)))

    def shard(self, rng: range, ids: Sequence[str], arrays: Sequence[tuple[np.ndarray, np.ndarray]]
              ) -> Iterator[RowFeatures | RefusedRow]:
        """The rows of ``rng``: read from their shard when it verifies, else fetched and written."""
        keys = [row_key(*arrays[i]) for i in rng]
        path = self.dir / shard_name(self.source.spec, keys)
        stats = self.source.stats
        if path.exists():
            try:
                index = verify_shard(path, self.source.spec)
                if set(index.row_keys) | set(index.quarantined) != set(keys):
                    raise FeatureShardError(f"feature shard {path} holds other rows than its name says")
                stats.shards_reused += 1
                self.index_at[rng.start] = index
                by_key = dict(zip(index.row_keys, read_rows(index)))
                for i, key in zip(rng, keys):
                    if key in by_key:
                        stats.rows_ok += 1
                        feats = by_key[key]
                        feats.row_id = ids[i]
                        yield feats
                    else:
                        reason = index.quarantined[key]
                        stats.refused[reason.split(":")[0]] += 1
                        yield RefusedRow(ids[i], reason.split(":")[0], reason)
                return
            except FeatureShardError as exc:
                reason = str(exc)
                stats.shards_refused[_shard_reason(reason)] += 1
                stats.notes.append(reason)
                self.source.log(f"served features: {reason}")
        got: list[RowFeatures] = []
        masks: list[np.ndarray] = []
        quarantined: dict[str, str] = {}
        for i, key, feats in zip(rng, keys, self.source.fetch((ids[i], *arrays[i]) for i in rng)):
            if isinstance(feats, RefusedRow):
                quarantined[key] = f"{feats.reason}: {feats.detail}"
            else:
                got.append(feats)
                masks.append(arrays[i][1])
            yield feats
        if got or quarantined:
            write_shard(path, self.source.spec, got, masks, quarantined)
            stats.shards_written += 1
            self.index_at[rng.start] = verify_shard(path, self.source.spec)


def _shard_reason(message: str) -> str:
    for needle, reason in (("hash mismatch", "hash_mismatch"), ("non-finite", "non_finite"),
                           ("capture layers", "layer_ids"), ("different feature spec", "spec"),
                           ("cannot be read", "unreadable"), ("format", "format")):
        if needle in message:
            return reason
    return "invalid"


# --------------------------------------------------------------------------------------- what the trainer calls
def target_to_draft_index(draft_token_ids: np.ndarray, target_vocab_size: int) -> torch.Tensor:
    """int64 ``[V]``: the draft id of each target id, -1 outside the draft vocab."""
    index = np.full(int(target_vocab_size), -1, dtype=np.int64)
    index[np.asarray(draft_token_ids, dtype=np.int64)] = np.arange(len(draft_token_ids), dtype=np.int64)
    return torch.from_numpy(index)


def served_supervision(teachers: Sequence[np.ndarray], feats: Sequence[RowFeatures], in_draft: torch.Tensor,
                       draft_index: torch.Tensor) -> Supervision:
    """The :class:`~eagle_assets.drafter.ttt_loss.Supervision` of a batch from served teachers: the same object
    ``ttt_loss.supervision`` builds from the target's lm_head, so ``ttt_loss`` runs unchanged.

    ``teacher_p`` is the teacher's probability mass on the draft vocab, renormalized: for ``topk`` the
    ``exp(logprob)`` of the top-K ids that are in the draft vocab (with K >= vocab this is exactly the local
    ``softmax(lm_head[draft rows] @ h)``); for ``hard`` a one-hot on the row's token. Positions whose ``greedy`` id
    is outside the draft vocab are dropped and counted, as in the local path.

    Args:
        teachers: per row of the batch, its teacher positions int64 ``[N_b]`` (``PreparedRow.teacher``); they must
            equal the features' ``teacher_positions`` (same rows, same cut).
        feats: per row, its :class:`RowFeatures`.
        in_draft: bool ``[V]`` (``DraftVocab.t2d``); draft_index: :func:`target_to_draft_index`.

    Raises:
        ValueError: teacher positions that differ from the features' (features of another row or another cut).
    """
    rows, positions, probs, greedy = [], [], [], []
    dropped = 0
    n_draft = int(in_draft.sum())
    for b, (teacher, f) in enumerate(zip(teachers, feats)):
        if not np.array_equal(np.asarray(teacher), f.teacher_positions):
            raise ValueError(f"row {f.row_id}: the trainer's teacher positions differ from its served features'")
        keep = in_draft[f.greedy]
        dropped += int((~keep).sum())
        ids = f.teacher_ids[keep]
        p = torch.exp(f.teacher_logprobs[keep].double())
        slot = draft_index[ids]
        dense = torch.zeros((ids.shape[0], n_draft), dtype=torch.float64)
        dense.scatter_add_(1, slot.clamp(min=0), torch.where(slot >= 0, p, torch.zeros_like(p)))
        dense /= dense.sum(dim=1, keepdim=True)
        probs.append(dense.float())
        q = torch.from_numpy(np.asarray(teacher, dtype=np.int64))[keep]
        rows.append(torch.full_like(q, b))
        positions.append(q)
        greedy.append(f.greedy[keep])
    return Supervision(torch.cat(rows), torch.cat(positions), torch.cat(probs), torch.cat(greedy), dropped)


class ServedFeatureCache:
    """The trainer's view of served features, shaped like ``local_cache.FeatureCache``: ``get(batch)`` gives per
    row ``(aux [T, W], RowFeatures, greedy [N])`` and :meth:`supervision` replaces ``ttt_loss.supervision``.

    Args:
        rows: the trainer's prepared rows (``.ids``, ``.mask``, ``.teacher``), already cut.
        source: the :class:`ServedFeatureSource`.
        cache: ``disk`` (shards under ``cache_dir``, rows read back one by one: bounded memory), ``memory`` (all
            rows held) or ``none`` (every :meth:`get` fetches its rows: nothing stored).
        draft_token_ids / target_vocab_size: the draft vocab (``DraftVocab.draft_token_ids``, ``.target_vocab_size``).

    Rows the server's replies were refused for are listed in :attr:`refused` (index -> reason); the trainer must
    leave them out of its batches (:meth:`usable`).
    """

    #: where ``FeatureCache`` keeps what the trainer computed: nothing here (fetch time is ``source.stats.seconds``)
    cache = None

    def __init__(self, rows: Sequence[Row], source: ServedFeatureSource, cache: str, draft_token_ids: np.ndarray,
                 target_vocab_size: int, cache_dir: str | Path | None = None):
        if cache not in ("disk", "memory", "none"):
            raise ValueError(f"cache must be disk, memory or none, got {cache!r}")
        if cache == "disk" and cache_dir is None:
            raise ValueError("cache='disk' needs a cache_dir")
        self.rows = rows
        self.source = source
        self.mode = cache
        self.draft_index = target_to_draft_index(draft_token_ids, target_vocab_size)
        self.refused: dict[int, str] = {}
        self._memory: dict[int, RowFeatures] = {}
        self._where: dict[int, tuple[ShardIndex, int]] = {}
        self._arrays = [row_arrays(r) for r in rows]
        if cache == "none":
            return
        ids = [str(i) for i in range(len(rows))]
        if cache == "memory":
            for i, got in enumerate(served_features(rows, source)):
                self._keep(i, got)
            return
        self.store = ShardedFeatures(cache_dir, source)
        for rng in self.store.plan([a.size for a, _ in self._arrays]):
            for got in self.store.shard(rng, ids, self._arrays):
                if isinstance(got, RefusedRow):
                    self.refused[int(got.row_id)] = got.reason
                del got  # only the shard's index is kept; rows are read back when trained on
            index = self.store.index_at.get(rng.start)
            if index is None:
                continue
            pos_of = {key: pos for pos, key in enumerate(index.row_keys)}
            for i in rng:
                key = row_key(*self._arrays[i])
                if key in pos_of:
                    self._where[i] = (index, pos_of[key])

    def _keep(self, i: int, got: RowFeatures | RefusedRow) -> None:
        if isinstance(got, RefusedRow):
            self.refused[i] = got.reason
        else:
            self._memory[i] = got

    def usable(self) -> list[int]:
        """Indices of the rows that have features."""
        return [i for i in range(len(self.rows)) if i not in self.refused]

    def subset(self, indices: Sequence[int]) -> "ServedFeatureCache":
        """A view on rows ``indices`` (e.g. :meth:`usable`), renumbered ``0..len - 1``, sharing the fetched
        features: build the trainer's batches over ``[rows[i] for i in indices]`` and ask this view."""
        view = object.__new__(ServedFeatureCache)
        view.rows = [self.rows[i] for i in indices]
        view.source, view.mode, view.draft_index = self.source, self.mode, self.draft_index
        view._arrays = [self._arrays[i] for i in indices]
        view.refused = {n: self.refused[i] for n, i in enumerate(indices) if i in self.refused}
        view._memory = {n: self._memory[i] for n, i in enumerate(indices) if i in self._memory}
        view._where = {n: self._where[i] for n, i in enumerate(indices) if i in self._where}
        return view

    def get(self, batch: Sequence[int]) -> list[tuple[torch.Tensor, RowFeatures, torch.Tensor]]:
        """Features of the rows ``batch`` (indices into ``rows``), in that order.

        Raises:
            KeyError: a refused row was asked for.
        """
        refused = [i for i in batch if i in self.refused]
        if refused:
            raise KeyError(f"rows {refused} have no served features ({[self.refused[i] for i in refused]})")
        if self.mode == "memory":
            feats = [self._memory[i] for i in batch]
        elif self.mode == "disk":
            by_shard: dict[int, list[int]] = {}
            for i in batch:
                by_shard.setdefault(id(self._where[i][0]), []).append(i)
            got: dict[int, RowFeatures] = {}
            for members in by_shard.values():  # one open per shard the batch touches
                index = self._where[members[0]][0]
                for i, f in zip(members, read_rows(index, [self._where[i][1] for i in members])):
                    got[i] = f
            feats = [got[i] for i in batch]
        else:
            feats = []
            for i, got in zip(batch, self.source.fetch((str(i), *self._arrays[i]) for i in batch)):
                if isinstance(got, RefusedRow):
                    self.refused[i] = got.reason
                    raise KeyError(f"row {i} has no served features ({got.reason}: {got.detail})")
                feats.append(got)
        return [(f.aux_hidden, f, f.greedy) for f in feats]

    def supervision(self, teachers: Sequence[np.ndarray], feats: Sequence[tuple[torch.Tensor, RowFeatures,
                    torch.Tensor]], in_draft: torch.Tensor) -> Supervision:
        """``ttt_loss.supervision`` for served features (see :func:`served_supervision`)."""
        return served_supervision(teachers, [f[1] for f in feats], in_draft, self.draft_index)
