"""The DFlash family's entry in the registry (``drafter.family.FAMILIES``), and the choices the catalog leaves to it:
the target layers read and the mask token."""

from __future__ import annotations

from typing import Any

import torch

from eagle_assets.drafter.dflash.export import export_checkpoint, load_drafter, serve_flags, validate_checkpoint
from eagle_assets.drafter.dflash.model import (
    ARCHITECTURE,
    DEFAULT_BLOCK_SIZE,
    NUM_ANCHORS,
    DFlashConfig,
    DFlashDraftModel,
    anchors_of,
    block_loss,
    build_target_layer_ids,
    config_from_target,
)
from eagle_assets.drafter.family import DraftArchitecture, DraftFamily, TrainBatch

#: the mask token SGLang 0.5.23 looks up when a config names no id (``dflash_utils.DEFAULT_DFLASH_MASK_TOKEN``)
MASK_TOKEN = "<|MASK|>"


def capture_ids(target_layers: int, requested: list[int] | None, arch: DraftArchitecture) -> list[int]:
    """The catalog's ``aux_layer_ids`` (capture numbering), else SGLang's default target layers for the draft's
    depth (:func:`~eagle_assets.drafter.dflash.model.build_target_layer_ids`) as capture ids (``k + 1``)."""
    if requested:
        return sorted(set(int(c) for c in requested))
    return [k + 1 for k in build_target_layer_ids(target_layers, arch.num_hidden_layers)]


def mask_token_id(target_config: Any) -> int:
    """The mask token of a target whose catalog names none, by SpecForge 0.2.0's order
    (``training/model_utils.py::resolve_mask_token_id``) after SGLang's own lookup: the tokenizer's ``<|MASK|>``
    (SGLang refuses a config id that differs from it), its ``mask_token_id``, its first unused embedding row
    (``len(tokenizer)`` when below ``vocab_size``: padded vocabs such as Qwen3's have one), then pad, eos, unk.
    The id is written to ``dflash_config.mask_token_id``, where SGLang reads it; its embedding row is the target's.

    Raises:
        ValueError: no candidate lies in ``[0, vocab_size)`` (set ``training.drafter.mask_token_id``).
    """
    get = (target_config.get if isinstance(target_config, dict) else
           lambda name, default=None: getattr(target_config, name, default))
    vocab = int(get("vocab_size"))
    candidates: list[Any] = []
    path = get("_name_or_path", None) or get("name_or_path", None)
    if path:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tok = None
        if tok is not None:
            candidates += [tok.get_vocab().get(MASK_TOKEN), tok.mask_token_id, len(tok)]
    candidates += [get("pad_token_id", None), get("eos_token_id", None), get("unk_token_id", None)]
    for c in candidates:
        c = c[0] if isinstance(c, (list, tuple)) and c else c
        if isinstance(c, int) and not isinstance(c, bool) and 0 <= c < vocab:
            return c
    raise ValueError(f"no mask token id in [0, {vocab}) for this target: set training.drafter.mask_token_id")


def draft_config(target_config: Any, _draft_vocab_size: int, capture: list[int], intermediate_size: int | None,
                 arch: DraftArchitecture) -> DFlashConfig:
    """The family interface's ``config_from_target``: target layers ``capture - 1``, the catalog's block size and
    mask token (or 16 and :func:`mask_token_id`), ``num_hidden_layers`` draft layers."""
    mask = arch.mask_token_id if arch.mask_token_id is not None else mask_token_id(target_config)
    return config_from_target(target_config, mask, num_hidden_layers=arch.num_hidden_layers,
                              block_size=arch.block_size or DEFAULT_BLOCK_SIZE,
                              target_layer_ids=[c - 1 for c in capture], intermediate_size=intermediate_size)


def build_model(config: DFlashConfig, embed_weight, _draft_token_ids, lm_head_weight) -> DFlashDraftModel:
    """A fresh draft over the target's embedding and LM head (the draft vocab is not used: a DFlash draft proposes
    over the whole target vocab)."""
    return DFlashDraftModel(config, embed_weight, lm_head_weight)


def draw_anchors(loss_mask: torch.Tensor, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks a step trains: every anchor of each row, or ``NUM_ANCHORS`` of them drawn (``generator``; None =
    torch's global generator, which the training state saves) when some row has more, as SpecForge's
    ``num_anchors`` (:func:`~eagle_assets.drafter.dflash.model.anchors_of`).

    Args:
        loss_mask: bool or 0/1 ``[B, S]``: the whole global batch's rows, right-padded (the loop calls this once per
            step on every rank, then hands each rank its rows: ``drafter.family.block_rows``).
    Returns:
        ``(anchors int64 [B, N], keep bool [B, N])``.
    Raises:
        ValueError: no row has an anchor.
    """
    return anchors_of(loss_mask.long(), NUM_ANCHORS, generator)


def batch_blocks(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss_mask int64 [b, T], anchors int64 [b, N], keep bool [b, N])`` of a batch: the anchors the loop drew
    over the global batch (``batch.anchors``), else :func:`draw_anchors` of its own rows."""
    mask = batch.loss_mask.long()
    anchors, keep = batch.anchors if batch.anchors is not None else draw_anchors(mask)
    return mask, anchors, keep


def slot_counts(batch: TrainBatch, steps: int) -> list[int]:
    """Per slot ``k = 1 .. steps`` (``steps = B - 1``, the family's ``loss_steps``) the blocks of ``batch`` whose
    token at ``anchor + k`` is supervised: the weights of :func:`~eagle_assets.drafter.dflash.model.block_loss`
    (0/1 without ``gamma``), whose sum it divides by.

    Raises:
        ValueError: ``batch.anchors`` is None and no row has an anchor.
    """
    mask, anchors, keep = batch_blocks(batch)
    s = mask.shape[1]
    pos = anchors.unsqueeze(-1) + torch.arange(1, steps + 1)  # [b, N, B - 1]
    w = keep.unsqueeze(-1) & (pos < s) & mask.gather(1, pos.clamp(max=s - 1).flatten(1)).view(pos.shape).bool()
    return [int(c) for c in w.sum((0, 1))]


def batch_loss(model: DFlashDraftModel, batch: TrainBatch, _weights, normalizer=None):
    """SpecForge 0.2.0's DFlash objective on the batch (:func:`~eagle_assets.drafter.dflash.model.block_loss`) over
    ``batch.anchors`` (else :func:`draw_anchors` of its own rows).

    Args:
        normalizer: per slot ``k = 1 .. B-1`` the global batch's supervised slots (:func:`slot_counts` summed
            over the data-parallel ranks); None = this batch's own. Given, the loss is this batch's weighted
            cross-entropy sum over their total, so the ranks' losses add up to the one-process loss.
    Returns:
        ``(loss, per slot (weighted positions, summed weighted CE, correct argmaxes))``.
    """
    mask, anchors, keep = batch_blocks(batch)
    total, per_slot = block_loss(model, batch.aux, batch.ids, mask, anchors, keep)
    return rank_share(total, per_slot, normalizer), per_slot


def rank_share(total: torch.Tensor, per_slot: list[tuple[int, float, int]], normalizer) -> torch.Tensor:
    """``total`` (a weighted mean over this batch's 0/1-weighted slots) as a share of the global batch's mean:
    times this batch's weight sum over the global one (``sum(normalizer)``)."""
    if normalizer is None:
        return total
    return total * (sum(n for n, _, _ in per_slot) / max(1, sum(int(n) for n in normalizer)))


FAMILY = DraftFamily(
    name="dflash",
    architectures=("dflash",),
    checkpoint_architectures=(ARCHITECTURE,),
    capture_ids=capture_ids,
    config_from_target=draft_config,
    build_model=build_model,
    loss_steps=lambda config, _ttt_steps: config.block_size - 1,
    batch_loss=batch_loss,
    export=export_checkpoint,
    validate=validate_checkpoint,
    load=load_drafter,
    serve_flags=serve_flags,
    loss_counts=slot_counts,
    draw_anchors=draw_anchors,
)
