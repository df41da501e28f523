"""The DFlash family's entry in the registry (``drafter.family.FAMILIES``)."""

from __future__ import annotations

from eagle_assets.drafter.dflash.export import export_checkpoint, load_drafter, serve_flags, validate_checkpoint
from eagle_assets.drafter.dflash.model import ARCHITECTURE, DFlashDraftModel, block_loss, config_from_target
from eagle_assets.drafter.family import DraftFamily

FAMILY = DraftFamily(
    name="dflash",
    architectures=("dflash",),
    checkpoint_architectures=(ARCHITECTURE,),
    config_from_target=config_from_target,
    build_model=DFlashDraftModel,
    batch_loss=block_loss,
    export=export_checkpoint,
    validate=validate_checkpoint,
    load=load_drafter,
    serve_flags=serve_flags,
)
