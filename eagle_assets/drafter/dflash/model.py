"""DFlash: a block drafter that drafts ``block_size - 1`` tokens in one forward, served by SGLang 0.5.23 as
``--speculative-algorithm DFLASH`` (``sglang/srt/models/dflash.py::DFlashDraftModel``, worker
``speculative/dflash_worker_v2.py``) and trained by SpecForge 0.2.0 (``specforge/modeling/draft/dflash.py``,
``algorithms/common/dflash_family_model.py``).

The draft (every name is SGLang's checkpoint name; it has no embedding and no LM head: it borrows the target's):

- context: the target's hidden states at the ``target_layer_ids`` (id ``k`` = the OUTPUT of target decoder layer
  ``k``, HF ``hidden_states[k + 1]``, concatenated in ascending layer order), ``c_j = hidden_norm(fc(f_j))``;
- block: ``[anchor, mask x (B - 1)]`` at positions ``p .. p + B - 1``, embedded with the target's embedding;
- each layer: ``q = q_norm(W_q h)``, ``k = k_norm(W_k [c; h])``, ``v = W_v [c; h]`` (the context keys and values
  without ``input_layernorm``), rotary (rotate-half) at the context's own positions and the block's, softmax
  attention in which every block query sees the context strictly before the anchor and its whole block
  (bidirectional), ``o_proj``, residual, SiLU MLP, residual; then ``norm``;
- slot ``k`` (1 .. B-1) predicts the token AT position ``anchor + k`` through the target's LM head (slot 0 is the
  anchor and is never used): SGLang's worker takes ``argmax(lm_head(out[:, 1:]))`` and verifies draft ``k`` against
  the target's argmax of row ``k - 1``, and SpecForge trains slot ``k`` on ``input_ids[a + k]``.

Training objective (SpecForge's ``loss_type: dflash``, default options): anchors are the positions ``a`` with
``loss_mask[a] = loss_mask[a + 1] = 1`` (all of them here, or a seeded sample of ``num_anchors``); the weight of
slot ``k`` is ``[k > 0] * [a + k < S] * loss_mask[a + k]`` (per slot, not cumulative); the loss is the
weight-averaged hard cross-entropy ``sum(w * CE) / sum(w)`` of the target LM head's logits on the draft's output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16
# anchors per chunk of the block forward: the keys of a chunk are the row's context plus its blocks' tokens
ANCHOR_CHUNK = 64
# blocks trained per row and step (SpecForge 0.2.0's num_anchors): a step's attention grows with the blocks' tokens
# times the row's, so a long row draws this many of its anchors instead of taking every one
NUM_ANCHORS = 512


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers whose outputs feed the draft when none are given: ``[L // 2]`` for one draft layer, else
    ``num_draft_layers`` ids evenly spaced from 1 to ``L - 3`` (SGLang 0.5.23
    ``speculative/dflash_utils.py::build_target_layer_ids``, the same rule as SpecForge 0.2.0's).

    Raises:
        ValueError: fewer than 4 target layers for more than one draft layer, or counts below 1.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"layer counts must be >= 1, got {num_target_layers} target, {num_draft_layers} draft")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"{num_draft_layers} draft layers need a target of >= 4 layers, got {num_target_layers}")
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """The draft's shape, as written to the exported ``config.json`` (:meth:`to_json`).

    Attributes:
        hidden_size ... rms_norm_eps: copied from the target (the draft's width is the target's).
        num_hidden_layers: draft decoder layers.
        block_size: ``B``; the draft proposes ``B - 1`` tokens per verification.
        target_layer_ids: ascending target layer ids (``k`` = output of layer ``k``, each ``<= L - 2``).
        mask_token_id: the id whose target embedding fills the masked slots (``< vocab_size``).
        num_target_layers: the target's depth.
        vocab_size: the target's vocab (the LM head's rows).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_hidden_layers: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)  # target fields copied verbatim into config.json

    def __post_init__(self) -> None:
        ids = list(self.target_layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > self.num_target_layers - 2:
            raise ValueError(f"target_layer_ids must be distinct ascending ids in [0, {self.num_target_layers - 2}] "
                             f"(SGLang captures the output of layer k for k <= L - 2), got {ids}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocab [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def aux_capture_ids(self) -> list[int]:
        """The capture ids of the target features (this project's numbering: HF ``hidden_states`` index)."""
        return [k + 1 for k in self.target_layer_ids]

    #: the ``architectures`` name SGLang picks the class by
    architecture = ARCHITECTURE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"dflash: {self.num_hidden_layers} layer(s), block {self.block_size}, target layers "
                f"{self.target_layer_ids}, mask id {self.mask_token_id}")

    def build(self, *args, **kwargs) -> "DFlashDraftModel":
        """A fresh draft of this shape (arguments as :class:`DFlashDraftModel`'s after the config)."""
        return DFlashDraftModel(self, *args, **kwargs)

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` SGLang 0.5.23 reads (``dflash.export`` module docstring)."""
        dflash = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                  "block_size": self.block_size}
        return {
            **self.extra,
            "architectures": [self.architecture], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
            "vocab_size": self.vocab_size, "num_hidden_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers, "block_size": self.block_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers, "use_sliding_window": False,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": self.torch_dtype,
            "dflash_config": dflash,
        }

    @classmethod
    def json_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The constructor arguments stored in an exported ``config.json`` (``dflash_config`` first, then the top
        level, as SGLang reads them)."""
        d = cfg.get("dflash_config") or {}
        pick = (lambda name: d[name] if name in d else cfg[name])
        return dict(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
            max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
            num_target_layers=cfg["num_target_layers"], target_layer_ids=list(pick("target_layer_ids")),
            mask_token_id=int(pick("mask_token_id")), num_hidden_layers=cfg["num_hidden_layers"],
            block_size=int(pick("block_size")), torch_dtype=cfg.get("torch_dtype", "float32"))

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "DFlashConfig":
        """The config of an exported ``config.json``."""
        return cls(**cls.json_fields(cfg))


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in float32 (Qwen3's, as SGLang's ``RMSNorm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (neox) rotary embedding of ``x`` ``[..., T, heads, hd]`` at int64 ``positions`` ``[..., T]``."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv  # [..., T, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(-2)
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(-2)
    half = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return (x * cos + half * sin).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.theta = c.num_attention_heads, c.num_key_value_heads, c.head_dim, \
            c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """``h`` ``[b, Q, H]`` block tokens (normed), ``ctx`` ``[b, S, H]`` context; keys are ``[ctx; h]`` at
        ``kv_pos`` ``[b, S + Q]``; ``allowed`` bool ``[b, Q, S + Q]``. Rows with nothing allowed give zeros."""
        b, nq, _ = h.shape
        kv_in = torch.cat([ctx, h], 1)
        q = self.q_norm(self.q_proj(h).view(b, nq, self.heads, self.hd))
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], self.kv_heads, self.hd))
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], self.kv_heads, self.hd)
        q, k = rotate(q, q_pos, self.theta), rotate(k, kv_pos, self.theta)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=allowed.unsqueeze(1))
        out = torch.where(allowed.any(-1)[:, None, :, None], out, torch.zeros_like(out))  # a dropped block: zeros
        return self.o_proj(out.transpose(1, 2).reshape(b, nq, self.heads * self.hd))


class DFlashMLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DFlashMLP(c)

    def forward(self, x, ctx, q_pos, kv_pos, allowed):
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_pos, kv_pos, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The DFlash draft; ``state_dict()`` keys are SGLang's checkpoint names (``layers.N.*``, ``fc``,
    ``hidden_norm``, ``norm``). The target's input embedding and LM head are attached as non-persistent buffers
    (:meth:`attach_target`): never trained, never exported.

    Args:
        config: :class:`DFlashConfig`.
        embed_weight / lm_head_weight: the target's ``[V, H]`` float32 tensors (or None: attach later).
    """

    def __init__(self, config: DFlashConfig, embed_weight: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)
        self.draft_token_ids = None  # no draft vocab: proposals range over the target's whole vocab
        if embed_weight is not None:
            self.attach_target(embed_weight, lm_head_weight)

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None) -> None:
        """Borrow the target's input embedding and LM head (``[V, H]`` each; a tied target passes the embedding).

        Raises:
            ValueError: shapes other than ``[vocab_size, hidden_size]``.
        """
        want = (self.config.vocab_size, self.config.hidden_size)
        head = embed_weight if lm_head_weight is None else lm_head_weight
        for name, w in (("embedding", embed_weight), ("lm_head", head)):
            if tuple(w.shape) != want:
                raise ValueError(f"the target's {name} is {tuple(w.shape)}, the draft needs {want}")
        self.embed_weight = embed_weight.detach().float()
        self.lm_head_weight = head.detach().float()

    def attach_embedding(self, weight: torch.Tensor) -> None:
        """``drafter.family.DraftModel``: attach a tied target's embedding as both embedding and LM head."""
        self.attach_target(weight, None)

    def blocks(self, aux: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor
               ) -> torch.Tensor:
        """The draft's normed output of every block.

        Args:
            aux: float32 ``[b, S, K*H]`` target features (capture order = ascending ``target_layer_ids``).
            ids: int64 ``[b, S]`` the rows' tokens.
            anchors: int64 ``[b, N]`` anchor positions (ascending per row; any value where ``keep`` is False).
            keep: bool ``[b, N]``: the block is drafted (False: padding, its output is zeros).
        Returns:
            float32 ``[b, N, B, H]``.
        """
        c = self.config
        b, s, _ = aux.shape
        n, bs = anchors.shape[1], c.block_size
        slot = torch.arange(bs)
        block_ids = torch.full((b, n, bs), c.mask_token_id, dtype=torch.long)
        block_ids[:, :, 0] = torch.where(keep, ids.gather(1, anchors.clamp(0, ids.shape[1] - 1)), c.mask_token_id)
        x = F.embedding(block_ids.view(b, n * bs), self.embed_weight)
        q_pos = (anchors.unsqueeze(-1) + slot).view(b, n * bs)
        kv_pos = torch.cat([torch.arange(s).expand(b, s), q_pos], 1)
        block_of = torch.arange(n * bs) // bs  # [Q]
        ctx_ok = torch.arange(s)[None, None, :] < anchors.repeat_interleave(bs, 1)[:, :, None]  # [b, Q, S]
        own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [b, Q, Q]
        allowed = torch.cat([ctx_ok, own], -1) & keep.repeat_interleave(bs, 1)[:, :, None]
        ctx = self.hidden_norm(self.fc(aux))
        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, allowed)
        return self.norm(x).view(b, n, bs, c.hidden_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits ``[..., V]`` of draft outputs ``[..., H]`` (the target's LM head, no other norm)."""
        return hidden @ self.lm_head_weight.T

    @torch.no_grad()
    def draft_chain(self, aux: torch.Tensor, ids: torch.Tensor, k: int) -> np.ndarray:
        """int64 ``[T, k]``: after every position ``p`` of a row, the block drafted with anchor ``ids[p + 1]`` (the
        token the target just emitted; context = features of positions ``<= p``): row ``p`` drafts tokens
        ``p + 2 .. p + k + 1`` (slots 1..k), as SGLang's worker proposes them; the last row (no anchor) is -1, and so
        are drafts past the block (``k > block_size - 1``: SGLang verifies at most ``B - 1``, so a walk at a larger
        ``k`` measures the block's own).

        Raises:
            ValueError: ``k < 1``.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        t = ids.shape[-1]
        out = np.full((t, k), -1, dtype=np.int64)
        anchors_all = torch.arange(1, t)
        for start in range(0, t - 1, ANCHOR_CHUNK):
            anchors = anchors_all[start:start + ANCHOR_CHUNK].unsqueeze(0)
            hidden = self.blocks(aux, ids.view(1, t).long(), anchors, torch.ones_like(anchors, dtype=torch.bool))
            drafts = self.logits(hidden[0, :, 1:k + 1]).argmax(-1)  # [N, min(k, B - 1)]
            out[start:start + anchors.shape[1], :drafts.shape[1]] = drafts.numpy()
        return out


# the objective runs over chunks of blocks of about this many logits each ([slots, V] float32: 256 MiB), so its
# memory is bounded whatever the anchors per row (SpecForge 0.2.0 chunks its objective too: objective_chunk_blocks)
OBJECTIVE_CHUNK_ELEMENTS = 2 ** 26


def objective_chunks(blocks: int, block_size: int, vocab: int, chunk_blocks: int | None) -> list[slice]:
    """Slices of ``blocks`` flattened blocks: ``chunk_blocks`` at a time, or as many as fit
    :data:`OBJECTIVE_CHUNK_ELEMENTS` logits (at least one)."""
    step = chunk_blocks or max(1, OBJECTIVE_CHUNK_ELEMENTS // (block_size * vocab))
    return [slice(i, min(i + step, blocks)) for i in range(0, blocks, step)]


class _ChunkedHeadCE(torch.autograd.Function):
    """``sum(w * CE(hidden @ head.T, labels))`` over chunks of blocks, with the gradient for ``hidden`` computed in
    the forward, chunk by chunk (``w * (softmax - onehot) @ head``): no ``[slots, V]`` tensor outlives its chunk and
    none is recomputed in the backward. The head is the target's (frozen). Also returns, detached, each slot's CE
    and whether its argmax is the label."""

    @staticmethod
    def forward(ctx, hidden, head, labels, w, chunks, want_grad):
        m, bs, h = hidden.shape
        ce, correct = hidden.new_empty(m, bs), torch.empty(m, bs, dtype=torch.bool)
        grad = torch.empty_like(hidden) if want_grad else None
        for c in chunks:
            logits = hidden[c].reshape(-1, h) @ head.T
            lab = labels[c].reshape(-1, 1)
            correct[c] = (logits.argmax(-1, keepdim=True) == lab).view(-1, bs)
            logp = logits.log_softmax(-1)
            del logits
            ce[c] = -logp.gather(1, lab).view(-1, bs)
            if want_grad:  # d(w * CE)/d logits = w * (softmax - onehot), in place over log-probabilities
                g = logp.exp_()
                g.scatter_add_(1, lab, g.new_full(lab.shape, -1.0))
                g.mul_(w[c].reshape(-1, 1))
                grad[c] = (g @ head).view(-1, bs, h)
            del logp
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, correct)
        return (ce * w).sum(), ce, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_ce, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total, None, None, None, None, None


def block_loss(model: DFlashDraftModel, aux: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor,
               anchors: torch.Tensor, keep: torch.Tensor, gamma: float | None = None,
               chunk_blocks: int | None = None) -> tuple[torch.Tensor, list[tuple[int, float, int]]]:
    """SpecForge 0.2.0's DFlash objective on one batch (``loss_type: dflash``).

    The blocks' draft forward runs once over every anchor; the vocab-sized part (LM head, cross-entropy and its
    gradient) runs over chunks of blocks (:class:`_ChunkedHeadCE`), so its memory does not grow with the anchors.

    Args:
        aux / ids / anchors / keep: as :meth:`DFlashDraftModel.blocks`; ``loss_mask``: ``[b, S]`` 0/1.
        gamma: SpecForge's ``loss_decay_gamma``: weights times ``exp(-(k - 1) / gamma)``; None = no decay.
        chunk_blocks: blocks per chunk of the objective; None = as many as fit :data:`OBJECTIVE_CHUNK_ELEMENTS`
            logits. The loss and gradients do not depend on it (up to float rounding).
    Returns:
        ``(loss, per slot k = 1..B-1: (weighted positions, summed weighted CE, correct argmaxes))``; the loss is
        ``sum(w * CE) / sum(w)`` (0 with no gradient path when nothing is weighted).
    """
    b, s = ids.shape
    bs, v = model.config.block_size, model.config.vocab_size
    hidden = model.blocks(aux, ids, anchors, keep)  # [b, N, B, H]
    pos = anchors.unsqueeze(-1) + torch.arange(bs)  # [b, N, B]
    inside = pos < s
    labels = ids.gather(1, pos.clamp(max=s - 1).view(b, -1)).view(pos.shape)
    w = (keep.unsqueeze(-1) & inside & (torch.arange(bs) > 0)).float()
    w = w * loss_mask.float().gather(1, pos.clamp(max=s - 1).view(b, -1)).view(pos.shape)
    if gamma is not None and gamma > 0:
        w = w * torch.exp(-(torch.arange(bs) - 1).clamp(min=0).float() / gamma)
    scale = w / w.sum().clamp(min=1e-12)
    m = b * anchors.shape[1]
    total, ce, correct = _ChunkedHeadCE.apply(
        hidden.reshape(m, bs, -1), model.lm_head_weight, labels.reshape(m, bs), scale.reshape(m, bs),
        objective_chunks(m, bs, v, chunk_blocks), torch.is_grad_enabled() and hidden.requires_grad)
    ce_w, correct = ce.view(pos.shape) * w, correct.view(pos.shape) & (w > 0)
    per_slot = [(int((w[..., k] > 0).sum()), float(ce_w[..., k].sum()), int(correct[..., k].sum()))
                for k in range(1, bs)]
    return total, per_slot


def anchors_of(loss_mask: torch.Tensor, num_anchors: int | None = None, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge's anchor choice: positions ``a`` with ``loss_mask[a] = loss_mask[a + 1] = 1``; all of them, or
    ``num_anchors`` per row drawn uniformly without replacement (``generator``; None = torch's global generator,
    which a resumable training state saves) when some row has more, ascending.

    Returns:
        ``(anchors int64 [b, N], keep bool [b, N])``, ``N`` = the most any row has (capped by ``num_anchors``).
    Raises:
        ValueError: no row has an anchor.
    """
    m = loss_mask.bool()
    valid = m[:, :-1] & m[:, 1:]
    counts = valid.sum(1)
    width = int(counts.max()) if valid.numel() else 0
    if width == 0:
        raise ValueError("no anchor: a row needs two adjacent loss-masked tokens")
    draw = num_anchors is not None and width > num_anchors  # every row fits: all its anchors, no draw
    if draw:
        width = num_anchors
    u = torch.rand(valid.shape, generator=generator) if draw else \
        torch.arange(valid.shape[1], dtype=torch.float32).expand_as(valid) / valid.shape[1]
    u = torch.where(valid, u, torch.full_like(u, 2.0))
    chosen = u.argsort(1)[:, :width]
    keep = valid.gather(1, chosen)
    anchors = torch.where(keep, chosen, torch.zeros_like(chosen)).sort(1)
    order = anchors.indices
    return anchors.values, keep.gather(1, order)


def config_from_target(target_config: Any, mask_token_id: int, num_hidden_layers: int = 1,
                       block_size: int = DEFAULT_BLOCK_SIZE, target_layer_ids: Sequence[int] | None = None,
                       intermediate_size: int | None = None) -> DFlashConfig:
    """The draft's shape from a HF target config: its width, heads, norm eps and rotary copied (SpecForge's
    ``populate_dflash_generated_config``), ``target_layer_ids`` by :func:`build_target_layer_ids` when None.

    Raises:
        ValueError: a field is missing or the shape cannot be built (:class:`DFlashConfig`).
    """
    get = (target_config.get if isinstance(target_config, dict) else
           lambda name, default=None: getattr(target_config, name, default))
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    layers = int(get("num_hidden_layers"))
    ids = sorted(set(int(i) for i in target_layer_ids)) if target_layer_ids is not None else \
        build_target_layer_ids(layers, num_hidden_layers)
    params = get("rope_parameters", None)
    theta = float(params["rope_theta"]) if isinstance(params, dict) and "rope_theta" in params else \
        float(get("rope_theta", 10000.0))
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=int(intermediate_size or get("intermediate_size")),
        num_attention_heads=heads, num_key_value_heads=int(get("num_key_value_heads", None) or heads),
        head_dim=int(get("head_dim", None) or hidden // heads), rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=theta, max_position_embeddings=int(get("max_position_embeddings", 32768)),
        vocab_size=int(get("vocab_size")), num_target_layers=layers, target_layer_ids=ids,
        mask_token_id=int(mask_token_id), num_hidden_layers=num_hidden_layers, block_size=block_size)
