"""DSpark: the DFlash block backbone with a Markov head (and a confidence head), served by SGLang 0.5.23 as
``--speculative-algorithm DSPARK`` (``sglang/srt/models/dspark.py::DSparkDraftModel`` = ``DSparkDraftMixin`` +
``DFlashDraftModel``; worker ``speculative/dspark_components/``) and trained by SpecForge 0.2.0
(``specforge/modeling/draft/dspark.py``, ``algorithms/common/dflash_family_model.py::OnlineDSparkModel``).

What DSpark changes (the backbone, its names, the context before the anchor and the bidirectional block are
DFlash's, :mod:`eagle_assets.drafter.dflash.model`):

- **Slots.** SGLang's default ``sample_from_anchor: true`` layout: the block is ``[anchor, mask x (g - 1)]`` at
  positions ``p .. p + g - 1`` and slot ``k`` (0 .. g-1, the anchor's row included) proposes the token at
  ``p + k + 1``: ``g`` drafts per verification (DFlash: slot ``k`` the token AT ``p + k``, slot 0 unused). SpecForge
  trains this layout (labels ``input_ids[a + k + 1]``); a draft read in the other layout accepts about one token.
- **Markov head** (vanilla): ``z_k = lm_head(h_k) + markov_w2(markov_w1(prev_k))``, a rank-``r`` bigram bias from
  the previous token: the anchor for slot 0, then the previous draft (greedy: argmax of ``z``); in training the
  ground truth (teacher forcing).
- **Confidence head**: ``sigmoid(proj([h_k ; markov_w1(prev_k)]))``, trained on the detached T=1 acceptance
  ``1 - |softmax(z) - softmax(target)|_1 / 2``; SGLang builds it only in its ragged verify modes (it never stops
  drafting early), and then needs it in the checkpoint.
- **Objective** (SpecForge's defaults): ``(0.1 CE(z, y) + 0.9 |softmax(z) - softmax(t)|_1 + 1.0 BCE(conf))``
  weighted by a cumulative mask (the first unsupervised label ends the block) over its sum, ``t`` the target's own
  logits at ``a + k`` (its post-norm final hidden through its LM head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eagle_assets.drafter.dflash.model import DFlashConfig, DFlashDraftModel

ARCHITECTURE = "DSparkDraftModel"
DEFAULT_GAMMA = 7  # SGLang 0.5.23's DEFAULT_DSPARK_GAMMA
DEFAULT_MARKOV_RANK = 64
#: SpecForge 0.2.0's loss weights (dspark_ce_loss_alpha, dspark_l1_loss_alpha, dspark_confidence_head_alpha)
CE_ALPHA, L1_ALPHA, CONFIDENCE_ALPHA = 0.1, 0.9, 1.0
# the keys SGLang's module builders read at the top level of config.json and SpecForge inside dflash_config
HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
             "sample_from_anchor")


@dataclass
class DSparkConfig(DFlashConfig):
    """DFlash's shape plus the heads. ``block_size`` is ``g``: the drafts per verification (the anchor's row
    included). ``markov_rank``: the bigram bias's rank; ``enable_confidence_head``: train and export the head."""

    block_size: int = DEFAULT_GAMMA
    markov_rank: int = DEFAULT_MARKOV_RANK
    enable_confidence_head: bool = True

    architecture = ARCHITECTURE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1 (SGLang's DSpark requires a Markov head), got "
                             f"{self.markov_rank}")

    def describe(self) -> str:
        return (f"dspark: {self.num_hidden_layers} layer(s), {self.block_size} drafts, target layers "
                f"{self.target_layer_ids}, mask id {self.mask_token_id}, markov rank {self.markov_rank}"
                + (", confidence head" if self.enable_confidence_head else ""))

    def build(self, *args, **kwargs) -> "DSparkDraftModel":
        return DSparkDraftModel(self, *args, **kwargs)

    def heads(self) -> dict[str, Any]:
        return {"markov_rank": self.markov_rank, "markov_head_type": "vanilla",
                "enable_confidence_head": self.enable_confidence_head, "confidence_head_with_markov": True,
                "sample_from_anchor": True}

    def to_json(self) -> dict[str, Any]:
        """DFlash's config plus the heads' keys, at the top level (SGLang's builders read them there only) and in
        ``dflash_config`` (SpecForge reads them there only)."""
        cfg = super().to_json()
        cfg.update(self.heads())
        cfg["dflash_config"] = {**cfg["dflash_config"], **self.heads()}
        return cfg

    @classmethod
    def json_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        fields = super().json_fields(cfg)
        fields.update(markov_rank=int(cfg["markov_rank"]), enable_confidence_head=bool(cfg["enable_confidence_head"]))
        return fields


class MarkovHead(nn.Module):
    """The vanilla Markov head: ``markov_w2(markov_w1(prev))``, float32 ``[..., V]`` (SGLang's ``VanillaMarkov``)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)


class DSparkDraftModel(DFlashDraftModel):
    """The DSpark draft: DFlash's modules plus ``markov_head.*`` and ``confidence_head.proj`` (SGLang's names)."""

    def __init__(self, config: DSparkConfig, embed_weight: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None):
        super().__init__(config, embed_weight, lm_head_weight)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        self.confidence_head = ConfidenceHead(config.hidden_size, config.markov_rank) \
            if config.enable_confidence_head else None

    def step_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Markov-corrected logits ``[..., V]`` of slot outputs ``[..., H]`` after the tokens ``prev`` ``[...]``."""
        return self.logits(hidden) + self.markov_head(prev)

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.confidence_head.proj(torch.cat([hidden, self.markov_head.markov_w1(prev)], -1)).squeeze(-1)

    @torch.no_grad()
    def draft_chain(self, aux: torch.Tensor, ids: torch.Tensor, k: int) -> np.ndarray:
        """int64 ``[T, k]``: after every position ``p``, the greedy Markov chain of the block anchored at
        ``ids[p + 1]`` (context = features of positions ``<= p``): slot ``j`` proposes the token at ``p + j + 2``,
        its bias from the anchor (``j = 0``) or the previous draft, as SGLang's ``draft_markov_block`` at
        temperature 0; the last row (no anchor) is -1, and so are slots past the block (``k > block_size``: SGLang
        verifies at most ``block_size`` drafts, so a walk at a larger ``k`` measures the block's own).

        Raises:
            ValueError: ``k < 1``.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        t = ids.shape[-1]
        out = np.full((t, k), -1, dtype=np.int64)
        ids = ids.view(1, t).long()
        for start in range(0, t - 1, 64):
            anchors = torch.arange(start + 1, min(t, start + 65)).unsqueeze(0)
            hidden = self.blocks(aux, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))[0]  # [N, g, H]
            prev = ids[0, anchors[0]]
            for j in range(min(k, self.config.block_size)):
                prev = self.step_logits(hidden[:, j], prev).argmax(-1)
                out[start:start + anchors.shape[1], j] = prev.numpy()
        return out


def dspark_loss(model: DSparkDraftModel, aux: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor,
                anchors: torch.Tensor, keep: torch.Tensor, target_hidden: torch.Tensor
                ) -> tuple[torch.Tensor, list[tuple[int, float, int]]]:
    """SpecForge 0.2.0's DSpark objective on one batch (module docstring; ``OnlineDSparkModel`` defaults).

    Args:
        aux / ids / anchors / keep: as :meth:`DFlashDraftModel.blocks`; ``loss_mask``: ``[b, S]`` 0/1.
        target_hidden: float32 ``[b, S, H]`` the target's post-norm final hidden (its LM head's input) at least
            at every position whose next token is supervised (other positions are never read).
    Returns:
        ``(loss, per slot k = 0..g-1: (weighted positions, summed weighted CE, correct argmaxes))``.
    """
    b, s = ids.shape
    g = model.config.block_size
    hidden = model.blocks(aux, ids, anchors, keep)  # [b, N, g, H]
    label_pos = anchors.unsqueeze(-1) + torch.arange(g) + 1  # [b, N, g]
    inside = label_pos < s
    flat = label_pos.clamp(max=s - 1).view(b, -1)
    labels = ids.gather(1, flat).view(label_pos.shape)
    ok = inside & loss_mask.bool().gather(1, flat).view(label_pos.shape) & keep.unsqueeze(-1)
    w = ok.long().cumprod(-1).float()  # the first unsupervised label ends the block
    prev = torch.cat([ids.gather(1, anchors.clamp(max=s - 1)).unsqueeze(-1), labels[..., :-1]], -1)
    z = model.step_logits(hidden, prev)
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), reduction="none").view(w.shape)
    with torch.no_grad():
        teacher_at = (label_pos - 1).clamp(max=s - 1).view(b, -1)
        t_hidden = target_hidden.gather(1, teacher_at.unsqueeze(-1).expand(-1, -1, target_hidden.shape[-1]))
        p_target = torch.softmax(model.logits(t_hidden.view(*w.shape, -1)).float(), -1)
    l1 = (torch.softmax(z.float(), -1) - p_target).abs().sum(-1)
    terms = CE_ALPHA * ce + L1_ALPHA * l1
    if model.confidence_head is not None:
        accept = (1 - 0.5 * l1).clamp(0, 1).detach()
        terms = terms + CONFIDENCE_ALPHA * F.binary_cross_entropy_with_logits(
            model.confidence_logit(hidden, prev), accept, reduction="none")
    total = (terms * w).sum() / w.sum().clamp(min=1e-12)
    correct = (z.argmax(-1) == labels) & (w > 0)
    ce_w = (ce * w).detach()
    per_slot = [(int((w[..., k] > 0).sum()), float(ce_w[..., k].sum()), int(correct[..., k].sum()))
                for k in range(g)]
    return total, per_slot
