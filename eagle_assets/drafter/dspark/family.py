"""The DSpark family's entry in the registry (``drafter.family.FAMILIES``): DFlash's capture ids, mask-token rule
and checkpoint code with DSpark's config, model and objective."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eagle_assets.drafter.dflash.export import export_checkpoint, load_drafter, validate_checkpoint
from eagle_assets.drafter.dflash.family import batch_blocks, capture_ids, draw_anchors, rank_share
from eagle_assets.drafter.dflash.family import draft_config as dflash_draft_config
from eagle_assets.drafter.dspark.model import ARCHITECTURE, DEFAULT_GAMMA, DSparkConfig, DSparkDraftModel, dspark_loss
from eagle_assets.drafter.family import DraftArchitecture, DraftFamily, TrainBatch


def draft_config(target_config: Any, draft_vocab_size: int, capture: list[int], intermediate_size: int | None,
                 arch: DraftArchitecture) -> DSparkConfig:
    """DFlash's shape (target layers, mask token) with ``block_size`` drafts (None = SGLang's 7) and the heads."""
    base = dflash_draft_config(target_config, draft_vocab_size, capture, intermediate_size, arch)
    fields = asdict(base)
    fields["block_size"] = arch.block_size or DEFAULT_GAMMA
    return DSparkConfig(**fields)


def build_model(config: DSparkConfig, embed_weight, _draft_token_ids, lm_head_weight) -> DSparkDraftModel:
    return DSparkDraftModel(config, embed_weight, lm_head_weight)


def label_counts(batch: TrainBatch, steps: int) -> list[int]:
    """Per slot ``k = 0 .. steps - 1`` (``steps = g``) the blocks of ``batch`` whose labels up to ``anchor + k + 1``
    are all supervised: the cumulative 0/1 weights of :func:`~eagle_assets.drafter.dspark.model.dspark_loss`,
    whose sum it divides by.

    Raises:
        ValueError: ``batch.anchors`` is None and no row has an anchor.
    """
    mask, anchors, keep = batch_blocks(batch)
    s = mask.shape[1]
    pos = anchors.unsqueeze(-1) + torch.arange(steps) + 1  # [b, N, g]
    ok = keep.unsqueeze(-1) & (pos < s) & mask.gather(1, pos.clamp(max=s - 1).flatten(1)).view(pos.shape).bool()
    return [int(c) for c in ok.long().cumprod(-1).sum((0, 1))]


def batch_loss(model: DSparkDraftModel, batch: TrainBatch, _weights, normalizer=None):
    """SpecForge 0.2.0's DSpark objective (:func:`~eagle_assets.drafter.dspark.model.dspark_loss`) over
    ``batch.anchors`` (else every anchor of each row, or ``NUM_ANCHORS`` drawn when a row has more); its L1 teacher
    is the target's final hidden state ``batch.target_hidden`` through the target's LM head.

    Args:
        normalizer: per slot the global batch's weighted blocks (:func:`label_counts` summed over the
            data-parallel ranks); None = this batch's own (see ``dflash.family.batch_loss``).
    """
    mask, anchors, keep = batch_blocks(batch)
    total, per_slot = dspark_loss(model, batch.aux, batch.ids, mask, anchors, keep, batch.target_hidden)
    return rank_share(total, per_slot, normalizer), per_slot


def serve_flags(checkpoint: str | Path, k: int) -> list[str]:
    """SGLang 0.5.23 ``launch_server`` flags that serve the draft at ``checkpoint`` (its ``block_size`` drafts per
    verification; ``k`` is unused)."""
    import json

    gamma = json.loads((Path(checkpoint) / "config.json").read_text())["block_size"]
    return ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(checkpoint),
            "--speculative-dspark-block-size", str(int(gamma))]


FAMILY = DraftFamily(
    name="dspark",
    architectures=("dspark",),
    checkpoint_architectures=(ARCHITECTURE,),
    capture_ids=capture_ids,
    config_from_target=draft_config,
    build_model=build_model,
    loss_steps=lambda config, _ttt_steps: config.block_size,
    batch_loss=batch_loss,
    export=export_checkpoint,
    validate=partial(validate_checkpoint, config_cls=DSparkConfig),
    load=partial(load_drafter, config_cls=DSparkConfig),
    serve_flags=serve_flags,
    wants_target_hidden=True,
    loss_counts=label_counts,
    draw_anchors=draw_anchors,
)

