"""EAGLE-3 drafter: draft vocab, target features, model + TTT training, SGLang export/validation, simulated tau.

Domain code only (no Dagster). Formats follow SGLang ``python/sglang/srt/models/llama_eagle3.py`` (and
``kimi_k25_eagle3.py`` for MLA drafts; docs/drafters.md) and the EAGLE-3
paper (arXiv 2503.01840); training follows SpecForge's TTT recipe (``specforge/algorithms/eagle3/model.py``).
"""

from importlib import import_module

# Each public name -> its module, imported on first use (PEP 562): the Dagster code server, the run workers and the
# CLI import this package for its torch-free modules (splits, stage, vocab), and importing torch with it cost each
# of those processes 1.0-1.4 s of CPU.
_EXPORTS = {
    "AcceptanceResult": "acceptance",
    "aux_layer_ids": "features.local_capture",
    "build_draft_vocab": "vocab",
    "capture_to_layer_output_ids": "features.local_capture",
    "CheckpointError": "export",
    "CheckpointReport": "export",
    "count_completion_tokens": "vocab",
    "draft_vocab_from_arrays": "vocab",
    "DraftArchitecture": "model",
    "drafter_config_json": "export",
    "drafter_rows": "train",
    "DrafterConfig": "model",
    "DraftVocab": "vocab",
    "Eagle3DraftModel": "model",
    "EXPECTED_KEYS": "export",
    "export_checkpoint": "export",
    "layer_output_to_capture_ids": "features.local_capture",
    "load_drafter": "export",
    "run_target": "features.local_capture",
    "serve_flags": "export",
    "simulate_acceptance": "acceptance",
    "StepMetrics": "train",
    "target_features": "features.local_capture",
    "teacher_positions": "train",
    "train_drafter": "train",
    "TrainConfig": "train",
    "TrainResult": "train",
    "validate_checkpoint": "export",
    "validate_draft_vocab": "vocab",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
