"""Target-model features for EAGLE-3: aux hidden states and teacher logits over the draft vocab.

Layer-id conventions (three numberings of the same thing; mixing them is the classic silent bug):

- capture id ``c``: SGLang's ``LlamaModel.layers_to_capture`` (``python/sglang/srt/models/llama.py``): before running
  decoder layer ``c`` it appends ``hidden_states + residual``, i.e. the INPUT of layer ``c`` == the OUTPUT of layer
  ``c - 1``. Default ``[2, L // 2, L - 3]`` (``set_eagle3_layers_to_capture(None)``).
- layer-output id ``o = c - 1``: what a drafter's ``config.json`` stores in
  ``eagle_config.eagle_aux_hidden_state_layer_ids``; SGLang adds 1 (``set_eagle3_layers_to_capture(layer_ids)``:
  "we plus 1 here because ... it takes the output of the (i-1)th layer").
- HF ``output_hidden_states`` index: ``hidden_states[0]`` is the embeddings and ``hidden_states[c]`` is the output of
  layer ``c - 1``, so it equals the capture id for ``c < L``. (``hidden_states[L]`` is the FINAL-NORMED output in
  transformers, not the raw output of the last layer.)

SGLang appends the captured states in layer order, so the ``3H`` concatenation is always in ascending capture id.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

#: positions of the target lm_head evaluated at once; bounds the full-vocab logits buffer to chunk x vocab floats.
LOGIT_CHUNK = 1024


def aux_layer_ids(num_layers: int, ids: Sequence[int] | None = None) -> list[int]:
    """Capture ids of the three aux hidden states, ascending.

    Args:
        num_layers: the target's ``num_hidden_layers`` (L).
        ids: capture ids to use, or None for SGLang's default ``[2, L // 2, L - 3]``.

    Returns:
        Three distinct capture ids in ``[1, L - 1]``, ascending (the order SGLang concatenates them in).

    Raises:
        ValueError: not exactly three ids, duplicates (SGLang would capture fewer than three states and ``fc`` would
            get the wrong width), or an id outside ``[1, L - 1]`` (SGLang only captures inputs of layers
            ``0..L-1``, and id 0 is the raw embedding). For targets with fewer than 7 layers the default collides;
            pass explicit ids.
    """
    L = int(num_layers)
    chosen = [2, L // 2, L - 3] if ids is None else [int(i) for i in ids]
    if len(chosen) != 3:
        raise ValueError(f"EAGLE-3 uses exactly three aux layers (fc takes 3 x hidden); got {chosen}")
    if len(set(chosen)) != 3:
        hint = " (SGLang's default [2, L//2, L-3] collides below 7 layers)" if ids is None else ""
        raise ValueError(
            f"aux capture ids {chosen} for a {L}-layer target are not distinct{hint}; "
            "pass three distinct ids in training.aux_layer_ids"
        )
    bad = [c for c in chosen if not 1 <= c <= L - 1]
    if bad:
        raise ValueError(
            f"aux capture ids {bad} are outside [1, {L - 1}] for a {L}-layer target "
            "(capture id c = input of layer c = output of layer c-1)"
        )
    return sorted(chosen)


def capture_to_layer_output_ids(capture_ids: Sequence[int]) -> list[int]:
    """Capture ids -> layer-output ids (``c - 1``), the numbering stored in the drafter's ``config.json``."""
    return [int(c) - 1 for c in capture_ids]


def layer_output_to_capture_ids(layer_output_ids: Sequence[int]) -> list[int]:
    """Layer-output ids from a drafter ``config.json`` -> capture ids (``o + 1``), as SGLang does when loading."""
    return [int(o) + 1 for o in layer_output_ids]


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]:
    """Find the decoder, its layer list, final norm and lm_head of a HF Llama/Qwen-like causal LM.

    Returns:
        ``(decoder, layers, final_norm, lm_head)``.

    Raises:
        ValueError: the model does not look like a decoder-only causal LM with ``layers`` and ``norm``.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or layers is None or norm is None or lm_head is None:
        raise ValueError(
            f"{type(model).__name__} is not a Llama/Qwen-like causal LM (need get_decoder().layers, "
            ".norm and get_output_embeddings()); EAGLE-3 features cannot be captured from it"
        )
    return decoder, layers, norm, lm_head


@torch.no_grad()
def run_target(
    model: nn.Module,
    input_ids: torch.Tensor,
    capture_ids: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target backbone once, capturing aux hidden states and the final-normed hidden state.

    No lm_head is applied here: full-vocab logits for every position are never materialized.

    Args:
        model: HF causal LM (eval mode).
        input_ids: int ``[T]`` or ``[B, T]``; batches must be RIGHT-padded (causal attention keeps real positions
            blind to the padding, so no attention mask is passed).
        capture_ids: capture ids from :func:`aux_layer_ids`.

    Returns:
        ``(aux_hidden, final_hidden)``: float32 ``[B, T, 3H]`` (inputs of the capture layers, ascending id,
        concatenated) and float32 ``[B, T, H]`` (after the final norm: what the lm_head sees).
    """
    decoder, layers, _norm, _head = decoder_parts(model)
    ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
    ids = ids.to(torch.long)
    order = sorted(int(c) for c in capture_ids)
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def make_hook(cid: int):
        def hook(_module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            captured[cid] = hs
        return hook

    try:
        for cid in order:
            handles.append(layers[cid].register_forward_pre_hook(make_hook(cid), with_kwargs=True))
        out = decoder(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [c for c in order if c not in captured]
    if missing:
        raise RuntimeError(f"decoder layers {missing} did not run; cannot capture their inputs")
    aux = torch.cat([captured[c].float() for c in order], dim=-1)
    final = out.last_hidden_state.float()
    return aux, final


@torch.no_grad()
def head_logits(model: nn.Module, final_hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits for some positions, optionally restricted to some vocab columns.

    Args:
        model: HF causal LM.
        final_hidden: float ``[N, H]`` final-normed hidden states of the positions wanted.
        token_ids: int64 ``[D]`` vocab columns to keep (e.g. the draft vocab's target ids), or None for all.

    Returns:
        float32 ``[N, D]`` (or ``[N, V]``) logits.
    """
    _dec, _layers, _norm, lm_head = decoder_parts(model)
    weight = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    if token_ids is not None:
        weight = weight[token_ids]
        bias = bias[token_ids] if bias is not None else None
    return torch.nn.functional.linear(final_hidden.to(weight.dtype), weight, bias).float()


@torch.no_grad()
def head_argmax(model: nn.Module, final_hidden: torch.Tensor, chunk: int = LOGIT_CHUNK) -> torch.Tensor:
    """Full-vocab greedy token of each position, computed in chunks of ``chunk`` positions.

    Args:
        final_hidden: float ``[N, H]``.

    Returns:
        int64 ``[N]`` target ids.
    """
    out = torch.empty(final_hidden.shape[0], dtype=torch.long)
    for start in range(0, final_hidden.shape[0], chunk):
        out[start : start + chunk] = head_logits(model, final_hidden[start : start + chunk]).argmax(-1)
    return out


@torch.no_grad()
def target_features(
    model: nn.Module,
    input_ids: torch.Tensor,
    aux_ids: Sequence[int],
    positions_to_keep: torch.Tensor,
    draft_token_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux hidden states for every position and teacher logits over the draft vocab for the kept positions only.

    Args:
        model: HF causal LM.
        input_ids: int ``[T]`` or right-padded ``[B, T]``.
        aux_ids: capture ids (:func:`aux_layer_ids`).
        positions_to_keep: bool ``[T]`` or ``[B, T]``; True where the teacher distribution is wanted. The logits at
            position ``q`` are the target's prediction of token ``q + 1``.
        draft_token_ids: int64 ``[D]`` target ids of the draft vocab (``DraftVocab.draft_token_ids``).

    Returns:
        ``(aux_hidden, target_logits_draft)``: float32 ``[B, T, 3H]`` and float32 ``[N, D]`` where N is the number of
        True entries of ``positions_to_keep``, in row-major (batch, position) order.
    """
    aux, final = run_target(model, input_ids, aux_ids)
    keep = positions_to_keep.unsqueeze(0) if positions_to_keep.dim() == 1 else positions_to_keep
    if keep.shape != final.shape[:2]:
        raise ValueError(f"positions_to_keep has shape {tuple(keep.shape)}, expected {tuple(final.shape[:2])}")
    logits = head_logits(model, final[keep.bool()], torch.as_tensor(draft_token_ids, dtype=torch.long))
    return aux, logits
