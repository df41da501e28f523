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
from typing import Any, Callable, Protocol

import numpy as np

# family name -> the module that defines its FAMILY
FAMILIES: dict[str, str] = {
    "eagle3": "eagle_assets.drafter.eagle3.family",
    "dflash": "eagle_assets.drafter.dflash.family",
}


class DraftModel(Protocol):
    """What the evaluation walks need of a trained drafter, whatever its family.

    Attributes:
        config: the family's drafter config; the walks read ``aux_capture_ids`` (the target layers whose hidden
            states feed the drafter, capture numbering) and ``vocab_size`` (the target's).
        draft_token_ids: int64 ``[D]`` target ids of the draft vocab (``d2t`` applied), checked against the vocab.
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

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...


@dataclass(frozen=True)
class DraftFamily:
    """One drafter family: what the training loop, the export check and the evaluation call.

    Attributes:
        name: the registry key (``eagle3``).
        architectures: the catalog's ``training.drafter.architecture`` values it trains (``auto`` resolves among
            them against the target).
        checkpoint_architectures: the ``architectures`` names of its exported ``config.json`` (SGLang's classes).
        config_from_target: ``(target_config, draft_vocab_size, aux_capture_ids, intermediate_size, architecture)``
            -> the family's drafter config.
        build_model: ``(config, embed_weight, draft_token_ids)`` -> a fresh ``nn.Module`` :class:`DraftModel`.
        batch_loss: ``(model, aux, ids, supervision, step_weights, draft_token_ids, normalizer=None)`` ->
            ``(loss, [(positions, summed soft CE, correct argmaxes) per step])``.
        export: ``(model, target_config, draft_vocab, aux_capture_ids, out_dir, ...)`` -> the checkpoint report.
        validate: ``(checkpoint_dir, target_config=None)`` -> the checkpoint report; raises on a broken export.
        load: ``(checkpoint_dir, target=None)`` -> ``(DraftModel in eval mode, DraftVocab)``.
        serve_flags: ``(checkpoint_dir, k)`` -> the SGLang ``launch_server`` flags that serve it.
    """

    name: str
    architectures: tuple[str, ...]
    checkpoint_architectures: tuple[str, ...]
    config_from_target: Callable[..., Any]
    build_model: Callable[..., Any]
    batch_loss: Callable[..., Any]
    export: Callable[..., Any]
    validate: Callable[..., Any]
    load: Callable[..., Any]
    serve_flags: Callable[..., list[str]]


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
