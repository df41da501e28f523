"""The target model as every stage sees it: tokenizer, family profile, vocab size, control ids and blank ids, loaded
once per (directory, profile overrides) by :func:`load_target_setup`.

Generation, multi-turn rollout and QC hold rows to the same rules, so they must agree on these facts; building
them in one place is what makes the client refuse exactly what QC would drop.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from eagle_assets.target_model.profile import FamilyProfile, detect_profile, target_vocab_size
from eagle_assets.target_model.render import control_token_ids
from eagle_assets.target_model.tokenizer import load_tokenizer


def blank_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids whose decoded text is only whitespace and that are not special (an answer made of them is empty)."""
    special = set(tokenizer.all_special_ids)
    return frozenset(idx for tok, idx in tokenizer.get_vocab().items()
                     if idx not in special and tokenizer.convert_tokens_to_string([tok]).strip() == "")


@dataclass(frozen=True, eq=False)
class TargetSetup:
    """One target model's facts.

    Attributes:
        model_dir: the local Hugging Face directory.
        tokenizer: ``load_tokenizer(model_dir)``.
        profile: ``detect_profile(tokenizer, overrides)`` (think / tool-call / end-of-turn ids, stop ids).
        vocab_size: ids the target can emit, ``[0, vocab_size)`` (``profile.target_vocab_size``).
        control_ids: the tokenizer's special and added ids (``render.control_token_ids``).
        blank_ids: ids that decode to whitespace only; computed on first use (a scan of the whole vocab, about a
            second for a 150k vocab), so a finished partition that sends nothing never pays it.
    """

    model_dir: Path
    tokenizer: Any = field(repr=False)
    profile: FamilyProfile
    vocab_size: int
    control_ids: frozenset[int] = field(repr=False)

    @cached_property
    def blank_ids(self) -> frozenset[int]:
        return blank_token_ids(self.tokenizer)


_CACHE: dict[tuple[str, str], TargetSetup] = {}  # a few targets per process at most
_LOCK = threading.Lock()


def load_target_setup(model_dir: str | Path, profile_overrides: dict[str, Any] | None = None) -> TargetSetup:
    """The :class:`TargetSetup` of ``model_dir`` under the catalog's ``target.profile`` overrides, built once per
    process and reused (a Dagster step or a test session loads the tokenizer once).

    Raises:
        TokenizerLoadError: no loadable tokenizer at ``model_dir``.
        ValueError: overrides that do not fit the tokenizer (``detect_profile``).
    """
    root = Path(str(model_dir)).resolve()
    # the files' versions are part of the key: a directory whose tokenizer or config changed is loaded again
    files = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in root.iterdir()
                   if p.is_file() and not p.name.endswith((".safetensors", ".bin"))) if root.is_dir() else []
    key = (str(root), json.dumps([profile_overrides or {}, files], sort_keys=True, default=str))
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    tokenizer = load_tokenizer(model_dir)
    setup = TargetSetup(model_dir=Path(str(model_dir)), tokenizer=tokenizer,
                        profile=detect_profile(tokenizer, profile_overrides or None),
                        vocab_size=target_vocab_size(model_dir, tokenizer), control_ids=control_token_ids(tokenizer))
    with _LOCK:
        return _CACHE.setdefault(key, setup)
