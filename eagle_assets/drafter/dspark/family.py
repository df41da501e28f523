"""The DSpark family's entry in the registry (``drafter.family.FAMILIES``): DFlash's capture ids, mask-token rule
and checkpoint code with DSpark's config, model and objective."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from eagle_assets.drafter.dflash.export import export_checkpoint, load_drafter, validate_checkpoint
from eagle_assets.drafter.dflash.family import capture_ids
from eagle_assets.drafter.dflash.family import draft_config as dflash_draft_config
from eagle_assets.drafter.dflash.model import NUM_ANCHORS, anchors_of
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


def batch_loss(model: DSparkDraftModel, batch: TrainBatch, _weights, normalizer=None):
    """SpecForge 0.2.0's DSpark objective: every anchor of each row, or ``NUM_ANCHORS`` drawn when a row has more.

    Raises:
        ValueError: ``normalizer`` given (DSpark trains in one process: the catalog refuses torchrun).
    """
    if normalizer is not None:
        raise ValueError("DSpark training runs in one process (training.launcher: inline)")
    mask = batch.loss_mask.long()
    anchors, keep = anchors_of(mask, NUM_ANCHORS)
    return dspark_loss(model, batch.aux, batch.ids, mask, anchors, keep, batch.target_hidden)


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
)

