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

from eagle_assets.drafter.dflash.model import DFlashConfig, DFlashDraftModel, objective_chunks

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

    def sample_drafts(self, aux: torch.Tensor, ids: torch.Tensor, k: int, temperature: float, top_k: int,
                      samples: int, generator: torch.Generator) -> tuple[np.ndarray, np.ndarray] | None:
        """``drafter.family.DraftModel.sample_drafts``: ``samples`` blocks per position drawn as SGLang 0.5.23's
        default DSPARK draft draws them (``drafter.dspark.sampling.draw_blocks``: ``q_j = softmax(z_j / T)``,
        the request's top_k / top_p not applied), or None when SGLang drafts this request by argmax (``top_k ==
        1``: ``dspark_draft.resolve_draft_params``' greedy rows; :meth:`draft_chain` is then the draft)."""
        if top_k == 1:
            return None
        from eagle_assets.drafter.dspark.sampling import draw_blocks

        return draw_blocks(self, aux, ids, k, temperature, samples, generator)


class _ChunkedDSparkHead(torch.autograd.Function):
    """The vocab-sized part of the objective over chunks of blocks: ``z = hidden @ head.T + m1 @ w2.T`` (the LM head
    plus the Markov bias, ``m1 = markov_w1(prev)``), ``sum(w * (CE_ALPHA CE(z, y) + L1_ALPHA |softmax(z) - p_t|_1))``
    with ``p_t`` the softmax of the target's logits (``t_hidden @ head.T``), and the gradients for ``hidden``,
    ``m1`` and ``w2`` computed in the forward, chunk by chunk: no ``[slots, V]`` tensor outlives its chunk and none
    is recomputed in the backward. ``d/dz``: ``w (CE_ALPHA (p - onehot) + L1_ALPHA p (sgn - <sgn, p>))``,
    ``sgn = sign(p - p_t)``. Also returns, detached, each slot's CE, L1 and whether its argmax is the label."""

    @staticmethod
    def forward(ctx, hidden, m1, w2, head, t_hidden, labels, w, chunks, want_grad):
        m, g, h = hidden.shape
        ce, l1 = hidden.new_empty(m, g), hidden.new_empty(m, g)
        correct = torch.empty(m, g, dtype=torch.bool)
        grads = (torch.empty_like(hidden), torch.empty_like(m1), torch.zeros_like(w2)) if want_grad else None
        for c in chunks:
            z = torch.addmm(m1[c].reshape(-1, m1.shape[-1]) @ w2.T, hidden[c].reshape(-1, h), head.T)
            lab = labels[c].reshape(-1, 1)
            correct[c] = (z.argmax(-1, keepdim=True) == lab).view(-1, g)
            p = z.softmax(-1)
            ce[c] = (z.logsumexp(-1, keepdim=True) - z.gather(1, lab)).view(-1, g)
            del z
            diff = p - (t_hidden[c].reshape(-1, h) @ head.T).softmax(-1)
            l1[c] = diff.abs().sum(-1).view(-1, g)
            if want_grad:
                sgn = diff.sign_()
                gz = sgn.sub_((sgn * p).sum(-1, keepdim=True)).mul_(p).mul_(L1_ALPHA)
                gz.add_(p, alpha=CE_ALPHA).scatter_add_(1, lab, gz.new_full(lab.shape, -CE_ALPHA))
                gz.mul_(w[c].reshape(-1, 1))
                grads[0][c] = (gz @ head).view(-1, g, h)
                grads[1][c] = (gz @ w2).view(-1, g, w2.shape[1])
                grads[2].addmm_(gz.T, m1[c].reshape(-1, m1.shape[-1]))
            del p, diff
        ctx.save_for_backward(*(grads or ()))
        ctx.mark_non_differentiable(ce, l1, correct)
        return ((CE_ALPHA * ce + L1_ALPHA * l1) * w).sum(), ce, l1, correct

    @staticmethod
    def backward(ctx, grad_total, *_):
        return (*(x * grad_total for x in ctx.saved_tensors), None, None, None, None, None, None)


def dspark_loss(model: DSparkDraftModel, aux: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor,
                anchors: torch.Tensor, keep: torch.Tensor, target_hidden: torch.Tensor,
                chunk_blocks: int | None = None) -> tuple[torch.Tensor, list[tuple[int, float, int]]]:
    """SpecForge 0.2.0's DSpark objective on one batch (module docstring; ``OnlineDSparkModel`` defaults).

    The blocks' draft forward runs once over every anchor; the vocab-sized part (logits, CE, L1 and their
    gradients) runs over chunks of blocks (:class:`_ChunkedDSparkHead`), so its memory does not grow with the
    anchors; the confidence head's term is plain autograd.

    Args:
        aux / ids / anchors / keep: as :meth:`DFlashDraftModel.blocks`; ``loss_mask``: ``[b, S]`` 0/1.
        target_hidden: float32 ``[b, S, H]`` the target's post-norm final hidden (its LM head's input) at least
            at every position whose next token is supervised (other positions are never read).
        chunk_blocks: blocks per chunk of the objective; None = as many as fit
            :data:`~eagle_assets.drafter.dflash.model.OBJECTIVE_CHUNK_ELEMENTS` logits. The loss and gradients do
            not depend on it (up to float rounding).
    Returns:
        ``(loss, per slot k = 0..g-1: (weighted positions, summed weighted CE, correct argmaxes))``.
    """
    b, s = ids.shape
    g, n = model.config.block_size, anchors.shape[1]
    hidden = model.blocks(aux, ids, anchors, keep)  # [b, N, g, H]
    label_pos = anchors.unsqueeze(-1) + torch.arange(g) + 1  # [b, N, g]
    inside = label_pos < s
    flat = label_pos.clamp(max=s - 1).view(b, -1)
    labels = ids.gather(1, flat).view(label_pos.shape)
    ok = inside & loss_mask.bool().gather(1, flat).view(label_pos.shape) & keep.unsqueeze(-1)
    w = ok.long().cumprod(-1).float()  # the first unsupervised label ends the block
    scale = w / w.sum().clamp(min=1e-12)
    prev = torch.cat([ids.gather(1, anchors.clamp(max=s - 1)).unsqueeze(-1), labels[..., :-1]], -1)
    teacher_at = (label_pos - 1).clamp(max=s - 1).view(b, -1)
    t_hidden = target_hidden.gather(1, teacher_at.unsqueeze(-1).expand(-1, -1, target_hidden.shape[-1]))
    m1 = model.markov_head.markov_w1(prev)
    total, ce, l1, correct = _ChunkedDSparkHead.apply(
        hidden.reshape(b * n, g, -1), m1.reshape(b * n, g, -1), model.markov_head.markov_w2.weight,
        model.lm_head_weight, t_hidden.detach().reshape(b * n, g, -1), labels.reshape(b * n, g),
        scale.reshape(b * n, g), objective_chunks(b * n, g, model.config.vocab_size, chunk_blocks),
        torch.is_grad_enabled() and (hidden.requires_grad or m1.requires_grad))
    ce, l1, correct = ce.view(w.shape), l1.view(w.shape), correct.view(w.shape)
    if model.confidence_head is not None:
        accept = (1 - 0.5 * l1).clamp(0, 1)
        total = total + CONFIDENCE_ALPHA * (F.binary_cross_entropy_with_logits(
            model.confidence_logit(hidden, prev), accept, reduction="none")
            * scale).sum()
    correct = correct & (w > 0)
    ce_w = ce * w
    per_slot = [(int((w[..., k] > 0).sum()), float(ce_w[..., k].sum()), int(correct[..., k].sum()))
                for k in range(g)]
    return total, per_slot
