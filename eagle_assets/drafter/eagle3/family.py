"""The EAGLE-3 family's entry in the registry (``drafter.family.FAMILIES``)."""

from __future__ import annotations

from eagle_assets.drafter.eagle3.export import export_checkpoint, load_drafter, serve_flags, validate_checkpoint
from eagle_assets.drafter.eagle3.model import DrafterConfig, Eagle3DraftModel, auto_choice
from eagle_assets.drafter.eagle3.ttt_loss import ttt_loss
from eagle_assets.drafter.family import DraftFamily, TrainBatch
from eagle_assets.drafter.features.local_capture import aux_layer_ids


def build_model(config: DrafterConfig, embed_weight, draft_token_ids, lm_head_weight=None) -> Eagle3DraftModel:
    """A fresh drafter of ``config`` over the target's input embedding ``embed_weight`` ``[V, H]`` float32 and the
    draft vocab's target ids ``draft_token_ids`` int64 ``[D]`` (its own LM head: ``lm_head_weight`` is unused)."""
    return Eagle3DraftModel(config, embed_weight=embed_weight, draft_token_ids=draft_token_ids)


def ttt_counts(batch: TrainBatch, steps: int) -> list[int]:
    """Per TTT step ``i`` the teacher positions ``q > i`` of ``batch`` (the rows step ``i`` trains): what
    :func:`~eagle_assets.drafter.eagle3.ttt_loss.ttt_loss` divides step ``i``'s summed cross-entropy by."""
    position = batch.supervision.position
    return [int((position > i).sum()) for i in range(steps)]


def batch_loss(model: Eagle3DraftModel, batch: TrainBatch, weights, normalizer=None):
    """The TTT loss of a batch (:func:`~eagle_assets.drafter.eagle3.ttt_loss.ttt_loss`)."""
    return ttt_loss(model, batch.aux, batch.ids, batch.supervision, weights, batch.draft_token_ids,
                    normalizer=normalizer)


FAMILY = DraftFamily(
    name="eagle3",
    architectures=("auto", "llama", "mla"),
    checkpoint_architectures=("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"),
    capture_ids=lambda layers, requested, _arch: aux_layer_ids(layers, requested),
    config_from_target=DrafterConfig.from_target,
    build_model=build_model,
    loss_steps=lambda _config, ttt_steps: ttt_steps,  # the recipe's TTT unroll
    batch_loss=batch_loss,
    export=export_checkpoint,
    validate=validate_checkpoint,
    load=load_drafter,
    serve_flags=serve_flags,
    loss_counts=ttt_counts,
    auto_reason=lambda target_config: auto_choice(target_config)[1],
)
