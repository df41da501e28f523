"""The draft vocab and the training mix as the pipeline builds them, without Dagster: each reads the passing
datasets' QC shards under the storage layout, writes its folder, and returns the figures the ``assets`` layer
reports. Their inputs are the datasets ``qc.status.passing_datasets`` names. Every file is written atomically (a
temp file renamed into place); the ``assets`` layer calls each while holding its folder's lock
(``storage.shards.Layout.lock``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from eagle_assets.catalog import Catalog
from eagle_assets.drafter.data.mix import MixResult
from eagle_assets.drafter.data.splits import dataset_splits, mix_candidates
from eagle_assets.drafter.data.vocab import (
    DraftVocab,
    build_draft_vocab,
    count_completion_tokens_in_shards,
    draft_vocab_from_arrays,
    validate_draft_vocab,
)
from eagle_assets.storage.shards import (
    Layout,
    write_bytes_atomic,
    write_json_atomic,
    write_npy_atomic,
    write_parquet_atomic,
)

MIX_SCHEMA = pa.schema([("order", pa.int32()), ("partition", pa.string()), ("sample_id", pa.string()),
                        ("tokens", pa.int32())])


@dataclass
class VocabStageResult:
    """The draft vocab built (``vocab``), where (``out``), the completion tokens counted per dataset, how many
    distinct ids were seen and the share of counted tokens the draft vocab covers."""

    out: Path
    vocab: DraftVocab
    tokens_per_partition: dict[str, int]
    distinct: int
    coverage: float


def draft_vocab_stage(layout: Layout, catalog: Catalog, keys: list[str], excluded: dict[str, str],
                      vocab_size: int) -> VocabStageResult:
    """``d2t``/``t2d`` from token counts over the loss-masked completion tokens of the training split of ``keys``
    (a streaming pass over the shards: memory does not grow with the partition), written to ``draft_vocab/``
    (``d2t.npy``, ``t2d.npy``, ``token_counts.npy``, ``summary.json``). ``vocab_size``: the target config's.

    Every file is written to a temp file and renamed into place, the three arrays together once all are written
    (``storage.shards.write_npy_atomic``), then ``summary.json``: a failed or killed write leaves the previous
    vocab whole, never one array of each run."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    per_partition: Counter = Counter()
    for key in keys:
        paths, splits = dataset_splits(layout, catalog, key)
        part, _ = count_completion_tokens_in_shards(
            paths, vocab_size, include=lambda sids, sp=splits: np.array([sp[s] == "train" for s in sids], bool))
        counts += part
        per_partition[key] += int(part.sum())
    vocab = build_draft_vocab(counts, vocab_size, catalog.training.draft_vocab_size)
    validate_draft_vocab(vocab.d2t, vocab.t2d, vocab_size)
    out = layout.stage_dir("draft_vocab")
    write_npy_atomic({out / "d2t.npy": vocab.d2t, out / "t2d.npy": vocab.t2d, out / "token_counts.npy": counts})
    distinct = int((counts > 0).sum())
    covered = float(counts[vocab.t2d].sum() / max(counts.sum(), 1))
    write_json_atomic({"partitions": keys, "excluded": excluded, "draft_vocab_size": int(vocab.d2t.shape[0]),
                       "distinct_tokens": distinct, "coverage": covered}, out / "summary.json")
    return VocabStageResult(out, vocab, dict(per_partition), distinct, covered)


def stored_draft_vocab(layout: Layout) -> tuple[list[str], DraftVocab, Path]:
    """The datasets the stored draft vocab was built over, the vocab, and its folder (``draft_vocab/``)."""
    import json

    folder = layout.base / "draft_vocab"
    keys = json.loads((folder / "summary.json").read_text())["partitions"]
    vocab = draft_vocab_from_arrays(np.load(folder / "d2t.npy"), np.load(folder / "t2d.npy"),
                                    np.load(folder / "token_counts.npy"))
    return keys, vocab, folder


@dataclass
class MixStageResult:
    """The training mix chosen (``result``: rows, buckets before / after, notes), its folder and plot."""

    out: Path | None
    result: MixResult
    png: bytes


def training_mix_stage(layout: Layout, catalog: Catalog, keys: list[str], excluded: dict[str, str]) -> MixStageResult:
    """The rows the drafter trains on: a token budget split by partition weights, with caps on short-row buckets
    (``training.mix``; ``all_turns`` datasets mixed by turn, ``drafter.data.turn_mix``), written to ``training_mix/``
    (``mix.parquet``, ``summary.json``, ``mix.png``). An empty mix writes nothing (``out`` None)."""
    from eagle_assets.drafter.data.mix import mix_png
    from eagle_assets.drafter.data.turn_mix import build_turn_mix
    from eagle_assets.generations.rollout import turn_numbers

    spec = catalog.training.mix
    turn_of = {(k, rid): t for k in keys for part in catalog.dataset_partition_keys(k)
               for rid, t in turn_numbers(layout.base / "generations" / part).items()}
    result = build_turn_mix(mix_candidates(layout, catalog, keys), spec, keys, turn_of)
    if not result.selected:
        return MixStageResult(None, result, b"")
    out = layout.stage_dir("training_mix")
    write_parquet_atomic(pa.Table.from_pylist(
        [{"order": i, "partition": c.partition, "sample_id": c.sample_id, "tokens": c.tokens}
         for i, c in enumerate(result.selected)], schema=MIX_SCHEMA), out / "mix.parquet")
    write_json_atomic({"mode": spec.mode, "budget": result.budget, "tokens": result.tokens,
                       "rows": len(result.selected), "partitions": keys, "excluded": excluded,
                       "buckets": result.buckets, "before": result.before, "after": result.after,
                       "notes": result.notes}, out / "summary.json")
    png = mix_png(result)
    write_bytes_atomic(png, out / "mix.png")
    return MixStageResult(out, result, png)
