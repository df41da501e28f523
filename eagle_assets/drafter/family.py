"""What a drafter family gives the training loop and the evaluation, and the registry of families.

A family is one folder under ``drafter/`` (``eagle3/`` today) whose ``family`` module defines ``FAMILY``, a
:class:`DraftFamily`, and one entry in :data:`FAMILIES`. The training loop (``drafter.training``) and the evaluation
(``drafter.evaluation``, the ``evaluation`` and ``drafter_checkpoint`` assets, the CLI) reach a family's code only
through it, so a new family (the block drafters DFlash and DSpark) plugs in without a branch in either. The layout
follows SpecForge 0.2.0 (``specforge/modeling/draft/<family>.py`` and its ``registry.py``), without its provider
classes: a family here is a record of functions.

Families are imported when asked for (``importlib``): this module and its callers stay free of torch until a run
trains or measures a drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

# family name -> the module that defines its FAMILY
FAMILIES: dict[str, str] = {
    "eagle3": "eagle_assets.drafter.eagle3.family",
    "dflash": "eagle_assets.drafter.dflash.family",
    "dspark": "eagle_assets.drafter.dspark.family",
}


@dataclass(frozen=True)
class DraftArchitecture:
    """Which drafter to build (catalog ``training.drafter``), before it is resolved against a target: the family
    (:func:`family_for` of ``architecture``) reads the fields it knows.

    Attributes:
        architecture: ``llama`` (SGLang ``LlamaForCausalLMEagle3``), ``mla`` (``Eagle3DeepseekV2ForCausalLM``),
            the block drafters ``dflash`` (``DFlashDraftModel``) and ``dspark`` (``DSparkDraftModel``), or ``auto``
            (EAGLE-3: ``mla`` for a target with multi-latent attention, its config has ``kv_lora_rank``:
            DeepSeek-V3/R1, Kimi-K2.x; else ``llama``; ``eagle3.model.auto_choice`` says why).
        fc_norm / norm_output: the EAGLE-3.1 switches; None = on for ``mla`` (the public Kimi MLA drafts,
            ``lightseekorg/kimi-k2.6-eagle3.1-mla``), off for ``llama`` (today's EAGLE-3 drafts and their acceptance).
        norm_before_fc: one RMSNorm over the concatenated ``3H`` features before ``fc`` (llama only).
        num_hidden_layers: decoder layers (llama, dflash: any >= 1; SGLang's MLA class takes exactly 1).
        window: sliding attention window (tokens), None = full attention.
        q_lora_rank ... v_head_dim: MLA shape; None = the target's own (``eagle3.model.MLA_DIMS``).
        block_size: DFlash's block (``B - 1`` drafts per verification; None = 16), DSpark's drafts (None = 7).
        mask_token_id: the block drafters' mask token; None = the rule of ``dflash.family.mask_token_id``.
    """

    architecture: str = "auto"
    fc_norm: bool | None = None
    norm_output: bool | None = None
    norm_before_fc: bool = False
    num_hidden_layers: int = 1
    window: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    block_size: int | None = None
    mask_token_id: int | None = None


class DraftModel(Protocol):
    """What the evaluation walks need of a trained drafter, whatever its family.

    Attributes:
        config: the family's drafter config; the walks read ``aux_capture_ids`` (the target layers whose hidden
            states feed the drafter, capture numbering) and ``vocab_size`` (the target's).
        draft_token_ids: int64 ``[D]`` target ids of the draft vocab (``d2t`` applied), checked against the vocab;
            None for a draft that proposes over the target's whole vocab (DFlash).
        embed_weight: the target's input embedding the drafter uses (empty until attached).
    """

    config: Any
    draft_token_ids: Any
    embed_weight: Any
    training: bool

    def attach_embedding(self, weight: Any) -> None: ...

    def draft_chain(self, aux: Any, ids: Any, k: int) -> np.ndarray:
        """int64 ``[T, k]``: the drafts proposed after every position of one row, from the target's aux states
        ``[1, T, A]`` and the row's ids ``[T]`` (row ``p`` drafts tokens ``p + 2 .. p + k + 1``)."""

    def sample_drafts(self, aux: Any, ids: Any, k: int, temperature: float, top_k: int, samples: int,
                      generator: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """OPTIONAL (the evaluation looks it up with ``getattr``): the drafts SGLang proposes for a request sampled
        at ``temperature`` > 0 when they are not the argmax chain. ``samples`` blocks drawn after every position
        with the CPU ``generator``: ``(tokens int64 [T, samples, k], q float64 [T, samples, k])``, row ``p`` as in
        :meth:`draft_chain` (-1 where nothing is drafted), ``q`` the draft probability of each drafted token (what
        SGLang's rejection sampling divides by). None, or no such method, means the drafts are point masses at
        this sampling (:meth:`draft_chain` at every temperature: EAGLE-3 at ``--speculative-eagle-topk 1``,
        DFlash) and are verified with the target's probability of each draft. DSpark defines it."""

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...


@dataclass
class TrainBatch:
    """One training step's rows on this rank, right-padded; every family reads what its loss needs.

    Attributes:
        aux: float32 ``[b, T, A]`` the target features at the family's capture ids (``A`` = ids x hidden).
        ids: int64 ``[b, T]``; loss_mask: bool ``[b, T]`` (completion tokens; padding False).
        supervision: the teacher of the batch (``features.teacher.Supervision``: the target's distribution over the
            draft vocab at the teacher positions).
        draft_token_ids: int64 ``[D]`` the draft vocab's target ids.
        target_hidden: float32 ``[b, T, H]`` the target's post-norm final hidden (its LM head's input) at every
            teacher position (a position whose next token is supervised), zeros elsewhere.
        anchors: block families: ``(anchors int64 [b, N], keep bool [b, N])`` of these rows, drawn once over the
            whole global batch by the family's ``draw_anchors`` (so a data-parallel rank trains its rows on the
            blocks one process would); None = the family draws them from ``loss_mask`` itself.
    """

    aux: Any
    ids: Any
    loss_mask: Any
    supervision: Any
    draft_token_ids: Any
    target_hidden: Any = None
    anchors: Any = None


@dataclass(frozen=True)
class DraftFamily:
    """One drafter family: what the training loop, the export check and the evaluation call.

    Attributes:
        name: the registry key (``eagle3``).
        architectures: the catalog's ``training.drafter.architecture`` values it trains (``auto`` resolves among
            them against the target).
        checkpoint_architectures: the ``architectures`` names of its exported ``config.json`` (SGLang's classes).
        capture_ids: ``(target_layers, catalog aux_layer_ids or None, DraftArchitecture)`` -> the target features
            the draft reads, in capture numbering (HF ``hidden_states`` index: ``c`` = the output of layer
            ``c - 1``).
        config_from_target: ``(target_config, draft_vocab_size, capture_ids, intermediate_size, DraftArchitecture)``
            -> the family's drafter config.
        build_model: ``(config, embed_weight, draft_token_ids, lm_head_weight)`` -> a fresh ``nn.Module``
            :class:`DraftModel` (the target's float32 ``[V, H]`` embedding and LM head).
        loss_steps: ``(config, ttt_steps)`` -> how many per-step figures ``batch_loss`` reports (EAGLE-3: the
            recipe's ``ttt_steps``; DFlash: block slots 1..B-1).
        batch_loss: ``(model, TrainBatch, step_weights, normalizer=None)`` ->
            ``(loss, [(positions, summed CE, correct argmaxes) per step])``; ``normalizer``: per step the global
            batch's count from ``loss_counts`` summed over the ranks (a data-parallel rank's loss is then its share
            of the one-process loss of the global batch).
        export: ``(model, target_config, draft_vocab, aux_capture_ids, out_dir, dtype=...)`` -> the checkpoint
            report.
        validate: ``(checkpoint_dir, target_config=None)`` -> the checkpoint report; raises on a broken export.
        load: ``(checkpoint_dir, target=None)`` -> ``(DraftModel in eval mode, DraftVocab)``.
        serve_flags: ``(checkpoint_dir, k)`` -> the SGLang ``launch_server`` flags that serve it.
        wants_target_hidden: its loss reads ``TrainBatch.target_hidden`` (built only then: a ``[b, T, H]`` tensor
            per step; local features only: a served target sends no final hidden state).
        loss_counts: ``(TrainBatch, steps)`` -> per step the positions this batch's loss is normalized by, which a
            data-parallel run sums over the ranks into ``batch_loss``'s ``normalizer`` (EAGLE-3: the teacher
            positions ``q > i`` at TTT step ``i``; a block family: its weighted slots).
        draw_anchors: block families: ``(loss_mask bool [B, S], generator=None)`` -> ``(anchors, keep)``
            ``[B, N]``; the training loop calls it once per step over the whole global batch (every rank, the same
            draw from torch's global generator) and hands each rank its rows (``TrainBatch.anchors``).
        auto_reason: ``(target_config)`` -> why ``architecture: auto`` trains what it does for that target (the
            family that lists ``auto`` only).
    """

    name: str
    architectures: tuple[str, ...]
    checkpoint_architectures: tuple[str, ...]
    capture_ids: Callable[..., list[int]]
    config_from_target: Callable[..., Any]
    build_model: Callable[..., Any]
    loss_steps: Callable[[Any, int], int]
    batch_loss: Callable[..., Any]
    export: Callable[..., Any]
    validate: Callable[..., Any]
    load: Callable[..., Any]
    serve_flags: Callable[..., list[str]]
    loss_counts: Callable[[TrainBatch, int], list[int]]
    wants_target_hidden: bool = False
    draw_anchors: Callable[..., Any] | None = None
    auto_reason: Callable[[Any], str] | None = None


def block_rows(anchors: tuple[Any, Any], rows: Sequence[int]) -> tuple[Any, Any]:
    """The blocks of ``rows`` (indices into the batch a family's ``draw_anchors`` drew for): ``(anchors int64
    [b, N'], keep bool [b, N'])``, without the columns none of them keeps (a dropped block is padding: its output
    and weight are zero; with every row of the batch no column is dropped)."""
    import torch

    anchors_all, keep_all = anchors
    index = torch.as_tensor(list(rows), dtype=torch.long)
    a, keep = anchors_all[index], keep_all[index]
    used = keep.any(0)
    return (a[:, used], keep[:, used]) if bool(used.any()) else (a[:, :1], keep[:, :1])


class UnknownFamilyError(ValueError):
    """No registered family trains an architecture, or claims a checkpoint."""


def family_named(name: str) -> DraftFamily:
    """The registered family ``name``.

    Raises:
        UnknownFamilyError: ``name`` is not in :data:`FAMILIES` (the message lists them).
    """
    if name not in FAMILIES:
        raise UnknownFamilyError(f"no drafter family {name!r}; registered: {sorted(FAMILIES)}")
    return import_module(FAMILIES[name]).FAMILY


def family_for(architecture: str) -> DraftFamily:
    """The family that trains the catalog's ``training.drafter.architecture`` (``auto`` included).

    Raises:
        UnknownFamilyError: no registered family lists it (the message names each family's architectures).
    """
    families = [family_named(name) for name in FAMILIES]
    for family in families:
        if architecture in family.architectures or architecture == "auto" and "auto" in family.architectures:
            return family
    known = {f.name: list(f.architectures) for f in families}
    raise UnknownFamilyError(f"no drafter family trains architecture {architecture!r}; known: {known}")


def family_of_checkpoint(checkpoint_dir: str | Path) -> DraftFamily:
    """The family whose export ``checkpoint_dir`` is (its ``config.json`` ``architectures``).

    Raises:
        UnknownFamilyError: no readable ``config.json``, or no family claims its architectures (the message says
            which were found and which are known).
    """
    path = Path(checkpoint_dir) / "config.json"
    try:
        found = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise UnknownFamilyError(f"{path} is not a readable drafter config ({exc}); export the drafter again") \
            from None
    families = [family_named(name) for name in FAMILIES]
    for family in families:
        if set(found) & set(family.checkpoint_architectures):
            return family
    known = {f.name: list(f.checkpoint_architectures) for f in families}
    raise UnknownFamilyError(f"{path} names architectures {found}, which no drafter family exports; known: {known}")
