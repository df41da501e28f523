"""EAGLE-3 drafter: draft vocab, target features, model + TTT training, SGLang export/validation, simulated tau.

Domain code only (no Dagster). Formats follow SGLang ``python/sglang/srt/models/llama_eagle3.py`` (and
``kimi_k25_eagle3.py`` for MLA drafts; docs/drafters.md) and the EAGLE-3
paper (arXiv 2503.01840); training follows SpecForge's TTT recipe (``specforge/algorithms/eagle3/model.py``).
"""

from eagle_assets.drafter.acceptance import AcceptanceResult, simulate_acceptance
from eagle_assets.drafter.export import (
    EXPECTED_KEYS,
    CheckpointError,
    CheckpointReport,
    drafter_config_json,
    export_checkpoint,
    load_drafter,
    serve_flags,
    validate_checkpoint,
)
from eagle_assets.drafter.features.local_capture import (
    aux_layer_ids,
    capture_to_layer_output_ids,
    layer_output_to_capture_ids,
    run_target,
    target_features,
)
from eagle_assets.drafter.model import DraftArchitecture, DrafterConfig, Eagle3DraftModel
from eagle_assets.drafter.train import (
    StepMetrics,
    TrainConfig,
    TrainResult,
    drafter_rows,
    teacher_positions,
    train_drafter,
)
from eagle_assets.drafter.vocab import (
    DraftVocab,
    build_draft_vocab,
    count_completion_tokens,
    draft_vocab_from_arrays,
    validate_draft_vocab,
)

__all__ = [
    "AcceptanceResult",
    "CheckpointError",
    "CheckpointReport",
    "DraftArchitecture",
    "DraftVocab",
    "DrafterConfig",
    "EXPECTED_KEYS",
    "Eagle3DraftModel",
    "StepMetrics",
    "TrainConfig",
    "TrainResult",
    "aux_layer_ids",
    "build_draft_vocab",
    "capture_to_layer_output_ids",
    "count_completion_tokens",
    "draft_vocab_from_arrays",
    "drafter_config_json",
    "drafter_rows",
    "export_checkpoint",
    "layer_output_to_capture_ids",
    "load_drafter",
    "run_target",
    "serve_flags",
    "simulate_acceptance",
    "target_features",
    "teacher_positions",
    "train_drafter",
    "validate_checkpoint",
    "validate_draft_vocab",
]
