"""DSpark's sampled drafts: the blocks SGLang 0.5.23 proposes for a request sampled at temperature ``T > 0``, and
the draft probability of every drafted token (what its verification divides by).

SGLang's default DSPARK path (``SGLANG_DSPARK_USE_GREEDY_DRAFT`` unset; ``speculative/dspark_components/``):

- ``dspark_draft.py::resolve_draft_params``: a row drafts greedily only when its ``top_k <= 1``; otherwise its step
  temperature is the request's temperature (clamped to >= 1e-5). The draft's own distribution ignores the request's
  top_k and top_p.
- ``dspark_draft.py::draft_markov_block`` (``DraftBlockProposer`` eagerly, ``dspark_draft_sampler.py::
  DsparkDraftSampler`` in the draft graph): slot ``j`` has the step logits ``z_j = base_j + markov(prev_j)``
  (``compute_base_logits``: the target's LM head on the draft's output; the bias from the anchor for ``j = 0``,
  else the token drawn at ``j - 1``), kept as ``corrected_logits``, and draws its token with
  ``kernels/ops/speculative/dspark/markov_sample.py::MarkovSampleStep``: ``argmax(z_j / T - log(E))``, ``E``
  exponential noise from a Philox stream: a Gumbel-max draw, i.e. a sample of ``q_j = softmax(z_j / T)``.
- ``dspark_verify.py::_draft_probs``: the verifier's draft distribution is ``SoftmaxTemp(corrected_logits, T)`` =
  ``q_j`` (the same ``q`` the token was drawn from).

:func:`draw_blocks` draws such blocks with a seeded ``torch.Generator`` (``argmax(log q_j - log(E))``, ``E`` from
``Tensor.exponential_``: the same Gumbel-max rule on our own noise) and returns the tokens and their ``q``. The step
logits are float32, as SGLang's for a float32 draft (a bf16 draft rounds them to bf16 first).
"""

from __future__ import annotations

import numpy as np
import torch

#: anchors whose blocks share one draft forward
ANCHOR_CHUNK = 64
#: drawn rows (anchors x samples) whose step logits are held at once
DRAW_ROWS = 1024


@torch.no_grad()
def draw_blocks(model, aux: torch.Tensor, ids: torch.Tensor, k: int, temperature: float, samples: int,
                generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``samples`` sampled DSpark blocks after every position of one row, as SGLang's default DSPARK draft draws
    them at ``temperature`` (module docstring).

    Args:
        model: a ``drafter.dspark.model.DSparkDraftModel`` (eval mode, the target attached).
        aux: float32 ``[1, T, A]`` the target's features at the draft's capture ids; ids: int64 ``[T]``.
        k: drafts wanted per block (slots past the block's ``g`` are -1, as :meth:`DSparkDraftModel.draft_chain`).
        temperature: the request's temperature (> 0); samples: blocks per position (>= 1).
        generator: the CPU generator the draws consume (seeded by the caller: the same seed draws the same blocks).
    Returns:
        ``(tokens, q)``: int64 ``[T, samples, k]``, row ``p`` the blocks anchored at ``ids[p + 1]`` (drafts of
        ``p + 2 .. p + k + 1``; the last row and slots past the block -1); float64 ``[T, samples, k]``, the draft
        probability ``q_j(token)`` of every drafted token (0 where -1).
    Raises:
        ValueError: ``k < 1``, ``temperature <= 0`` or ``samples < 1``.
    """
    if k < 1 or samples < 1:
        raise ValueError(f"k and samples must be >= 1, got k={k}, samples={samples}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampled drafts, got {temperature}")
    t = ids.shape[-1]
    g = min(k, model.config.block_size)
    tokens = np.full((t, samples, k), -1, dtype=np.int64)
    q = np.zeros((t, samples, k), dtype=np.float64)
    ids = ids.view(1, t).long()
    chunk = max(1, min(ANCHOR_CHUNK, DRAW_ROWS // samples))
    for start in range(0, t - 1, chunk):
        anchors = torch.arange(start + 1, min(t, start + chunk + 1)).unsqueeze(0)
        n = anchors.shape[1]
        hidden = model.blocks(aux, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))[0]  # [n, g_block, H]
        base = model.logits(hidden[:, :g])  # [n, g, V]: no draft token enters a block's forward
        prev = ids[0, anchors[0]].repeat_interleave(samples)  # [n * samples], anchor first
        for j in range(g):
            z = base[:, j].repeat_interleave(samples, 0) + model.markov_head(prev)
            log_q = torch.log_softmax(z.double() / temperature, -1)
            noise = torch.empty_like(log_q).exponential_(generator=generator)
            prev = (log_q - noise.log()).argmax(-1)
            tokens[start:start + n, :, j] = prev.view(n, samples).numpy()
            q[start:start + n, :, j] = log_q.gather(1, prev[:, None])[:, 0].exp().view(n, samples).numpy()
    return tokens, q
