"""The training rows: the held-out split of each partition's QC rows (by conversation, keyed hash), reading the
rows of one split shard by shard, and the rows ``training_mix`` chose. ``layout`` and ``catalog`` are the storage
layout and the loaded catalog (``storage.shards.Layout``, ``catalog.Catalog``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from eagle_assets.catalog import Catalog
from eagle_assets.qc.status import dataset_shard_paths
from eagle_assets.storage.shards import Layout


class MixError(RuntimeError):
    """The training mix is missing or names rows the QC shards no longer hold; the message says what to run."""


def _holdout_rank(sample_id: str, seed: int) -> float:
    """Keyed hash of a sample id in [0, 1): the held-out split's order (stable when rows are added)."""
    h = int.from_bytes(hashlib.sha256(f"holdout:{seed}:{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64


def is_holdout(sample_id: str, fraction: float, seed: int) -> bool:
    """Deterministic held-out split by a keyed hash of the sample id (stable when rows are added): the rule of
    ``training.holdout_fraction`` when ``training.holdout_rows`` is null."""
    return _holdout_rank(sample_id, seed) < fraction


#: the three splits of a partition's QC rows: trained on, steering training (learning curve, early stopping),
#: and the acceptance check's held-out test rows.
SPLITS = ("train", "validation", "test")


def row_splits(sample_ids: list[str], training) -> dict[str, str]:
    """``sample_id -> "train" | "validation" | "test"`` for one partition's QC rows.

    The unit of the split is the conversation (``tokenized_prompts.walk.conversation_id``): every turn row and both
    thinking modes of one conversation land in the same split, so a held-out turn never has its own prompt or
    earlier turns in the training rows; a single-turn row is its own conversation. Held out (never trained on):
    every conversation :func:`is_holdout` puts under ``training.holdout_fraction``, at most
    ``training.holdout_rows`` of them (lowest keyed hash first; null = no cap). So a large fraction with a cap gives
    the same count in every partition big enough (the default catalog: 34 of 48), and a small partition keeps its
    share of training rows. Of the held-out conversations, the ``validation_rows`` of highest hash (at most half of
    them) steer training; the rest are the acceptance check's test rows. The training rows are exactly those whose
    conversation :func:`is_holdout` leaves out, and validation never overlaps the test rows.
    """
    from eagle_assets.tokenized_prompts.walk import conversation_id

    conversation = {s: conversation_id(s) for s in sample_ids}
    ranked = sorted(set(conversation.values()), key=lambda c: (_holdout_rank(c, training.seed), c))
    held = [c for c in ranked if is_holdout(c, training.holdout_fraction, training.seed)]
    if training.holdout_rows is not None:
        held = held[: training.holdout_rows]
    n_val = min(training.validation_rows, len(held) // 2)
    split = {c: "test" for c in held[: len(held) - n_val]}
    split.update({c: "validation" for c in held[len(held) - n_val:]})
    return {s: split.get(conversation[s], "train") for s in sample_ids}


def dataset_splits(layout: Layout, catalog: Catalog, key: str) -> tuple[list[Path], dict[str, str]]:
    """The QC shards of dataset ``key`` (every chunk's, ``qc.status.dataset_shard_paths``) and the split of its
    rows (:func:`row_splits` over the sample ids of all of them: a chunked dataset splits as the unchunked one)."""
    import pyarrow as pa

    paths = dataset_shard_paths(layout, catalog, key)
    sids = pa.concat_tables([pq.read_table(p, columns=["sample_id"]) for p in paths]).column(0).to_pylist()
    return paths, row_splits(sids, catalog.training)


def load_split_rows(layout: Layout, catalog: Catalog, keys: list[str], split: str):
    """Rows (sample_id, input_ids int32 [T], loss_mask int8 [T], partition) of ``keys``' QC shards on one split
    (one of :data:`SPLITS`), in shard order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return list(iter_split_rows(layout, catalog, keys, split))


def iter_shard_rows(paths: list[Path], keep=None):
    """``(sample_id, input_ids int32 [T], loss_mask int8 [T])`` of QC shards ``paths`` in shard order, one record
    batch at a time, rows sliced from the batch's flat arrays (never a whole partition's ids as Python lists).
    ``keep``: a predicate on the sample id; rows it refuses are never sliced (None = every row)."""
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024,
                                                       columns=["sample_id", "input_ids", "loss_mask"]):
            ids_col, mask_col = batch.column(1), batch.column(2)
            ids_off, mask_off = ids_col.offsets.to_numpy(), mask_col.offsets.to_numpy()
            ids_flat = ids_col.values.to_numpy().astype(np.int32, copy=False)
            mask_flat = mask_col.values.to_numpy().astype(np.int8, copy=False)
            for i, sid in enumerate(batch.column(0).to_pylist()):
                if keep is None or keep(sid):
                    yield (sid, ids_flat[ids_off[i]:ids_off[i + 1]].copy(),
                           mask_flat[mask_off[i]:mask_off[i + 1]].copy())


def iter_split_rows(layout: Layout, catalog: Catalog, keys: list[str], split: str, wanted=None):
    """``load_split_rows`` lazily (:func:`iter_shard_rows` over each key's shards). ``wanted``: a collection of
    ``(partition, sample_id)`` to keep (None = every row of the split)."""
    for key in keys:
        paths, splits = dataset_splits(layout, catalog, key)
        keep = (lambda sid, sp=splits, k=key: sp[sid] == split and (wanted is None or (k, sid) in wanted))
        for sid, ids, mask in iter_shard_rows(paths, keep):
            yield sid, ids, mask, key


def mix_candidates(layout: Layout, catalog: Catalog, keys: list[str]):
    """Every training-split QC row of ``keys`` as a ``MixCandidate`` (completion tokens = loss tokens)."""
    import pyarrow.compute as pc

    from eagle_assets.drafter.data.mix import MixCandidate

    out = []
    for key in keys:
        paths, splits = dataset_splits(layout, catalog, key)
        for path in paths:  # one shard's ids at a time, only their lengths kept
            t = pq.read_table(path, columns=["sample_id", "input_ids", "n_prompt_tokens"])
            lengths = pc.subtract(pc.list_value_length(t.column("input_ids")), t.column("n_prompt_tokens")).to_pylist()
            for sid, n in zip(t.column("sample_id").to_pylist(), lengths):
                if splits[sid] == "train":
                    out.append(MixCandidate(key, sid, int(n)))
    return out


def mixed_training_rows(layout: Layout, catalog: Catalog, keys: list[str]):
    """The training rows the ``training_mix`` asset chose, in its order (partitions of ``keys`` only).

    Raises:
        MixError: the mix is missing or names rows the QC shards no longer hold (re-materialize ``training_mix``).
    """
    mix_file = layout.base / "training_mix" / "mix.parquet"
    if not mix_file.exists():
        raise MixError(f"{mix_file} does not exist: materialize training_mix first (training_job does)")
    mix = pq.read_table(mix_file, columns=["partition", "sample_id"]).to_pylist()
    chosen = [(m["partition"], m["sample_id"]) for m in mix if m["partition"] in keys]
    # only the chosen rows are read out of the shards (iter_split_rows), not every training row first
    by_id = {(k, sid): (sid, ids, mask, k)
             for sid, ids, mask, k in iter_split_rows(layout, catalog, keys, "train", wanted=set(chosen))}
    missing = [c for c in chosen if c not in by_id]
    if missing:
        raise MixError(f"training_mix names {len(missing)} rows that the QC shards no longer hold "
                       f"(e.g. {missing[:3]}): re-materialize training_mix after qc_shards changed")
    return [by_id[c] for c in chosen]
