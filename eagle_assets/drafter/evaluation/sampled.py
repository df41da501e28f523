"""Acceptance when the target samples (temperature > 0): the expectation under SGLang 0.5.23's verification.

**Point-mass drafts** (EAGLE-3, DFlash, DSpark with ``SGLANG_DSPARK_USE_GREEDY_DRAFT=1``). SGLang's EAGLE worker
drafts a chain (``--speculative-eagle-topk 1``: the drafter's top-1 token at every step) and verifies a sampled
request with ``tree_speculative_sampling_target_only`` (``sgl_kernel`` ``speculative_sampling.cuh``, called by
``speculative/eagle_info.py`` ``EagleVerifyInput.verify`` with ``threshold_single = threshold_acc = 1``): draft
``d_j`` is accepted when a uniform coin is at most ``p_j = P_target(d_j | prefix, d_1 .. d_{j-1})``, the target's
distribution at the request's temperature, top_k and top_p (``softmax(logits / T)``, ``top_k_renorm_prob``,
``top_p_renorm_prob``: ``serving.engine.sampling_probs``); the first rejection ends the chain and the target samples
its own token from the residual. DFlash does the same: ``speculative/dflash_worker_v2.py`` drafts a plain DFlash
block by argmax at every temperature (``_greedy_sample_from_vocab_parallel_head``, or the folded greedy head;
only selector, LiLiCorr and Domino drafts, which this project does not export, sample) and
``_accept_block`` verifies a sampled batch with ``dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus``:
``tree_speculative_sampling_target_only`` with zero draft probabilities and the server's thresholds (1 and 1 by
default), on ``build_speculative_verify_target_probs`` (temperature, then top_k, then top_p). With one candidate per
step the accepted count ``A`` has ``P(A >= j) = p_1 * ... * p_j``, so

    E[A] = sum_{j=1..k} prod_{i<=j} p_i          (tokens per verification: 1 + E[A])

exactly, from the target's and the drafter's probabilities along the draft chain: no coin is thrown, there is no
Monte Carlo error. Greedy verification is the limit T -> 0 (``p_j`` is 1 for the target's argmax, else 0).

**Sampled drafts** (DSpark by default: a drafter whose family defines ``DraftModel.sample_drafts``). SGLang's
DSPARK worker (``speculative/dspark_components/``) draws the block from the draft (``dspark_draft.py::
draft_markov_block``: ``x_j ~ q_j = softmax(z_j / T)``, ``z_j`` the base logits plus the Markov bias of ``x_{j-1}``,
the request's temperature, no top_k / top_p: ``drafter.dspark.sampling``) and verifies it with rejection sampling
(``dspark_verify.py::accept_draft_tokens`` -> ``kernels/ops/speculative/dspark/dspark_accept.py::AcceptSampling`` ->
``kernels/ops/speculative/reject_sampling.py::chain_speculative_sampling_triton``, its token-wise branch: accept
``x_j`` when ``coin * q_j(x_j) < p_j(x_j)``, i.e. with probability ``min(1, p_j / q_j)``; on rejection the target
samples from ``max(p - q, 0)``), with ``q_j = dspark_verify.py::_draft_probs`` = ``SoftmaxTemp(corrected_logits,
T)``, the distribution ``x_j`` was drawn from, and ``p_j`` the target's ``SoftmaxTemp`` (no top_k / top_p) or
``build_speculative_verify_target_probs`` (with them). That is the default: block verification
(``--speculative-use-block-verification``) and block-wise rejection (``SGLANG_OPT_DSV41_BLOCKWISE_REJECTION``) are
opt-in, and a ``top_k == 1`` request drafts by argmax. Given a drawn block ``x``, ``P(A >= j | x) = prod_{i<=j}
min(1, p_i(x_i) / q_i(x_i))`` exactly; the expectation over blocks needs the target on every drawn continuation
(``p_j`` depends on ``x_1 .. x_{j-1}``, ``q_j`` on ``x_{j-1}``), which no closed form gives beyond ``j = 1``
(``sum_x min(p_1, q_1) = 1 - TV(p_1, q_1)``). So ``draft_samples`` blocks are drawn per verification point with a
seeded ``torch.Generator`` (``seed``; the same seed and rows give the same figure on any machine), and each drawn
block contributes its exact ``P(A >= j | x)`` (no acceptance coin is thrown): ``P(A >= j)`` is their mean, an
unbiased Monte Carlo estimate. Its standard error on tau (:attr:`SampledAcceptance.tau_mc_se`) is the jackknife over
the drawn blocks (leave draw ``s`` out at every point, recompute tau; Efron and Tibshirani 1993, ch. 11).

Verification points: the walk of ``drafter.evaluation.acceptance`` along each completion segment ``[s, e)`` of a
row, made random: a verification at ``n`` accepts ``A`` drafts (at most ``min(k, e - 1 - n)``, the segment's end)
and the next one is at ``n + A + 1``. The probability ``pi(n)`` that the walk verifies at ``n`` follows exactly from the
distribution of ``A`` at every earlier point (``pi(s) = 1``, ``pi(n + a + 1) += pi(n) P_n(A = a)``), and tau is
the ratio of expected tokens to expected verifications, ``sum pi(n) (1 + E_n[A]) / sum pi(n)``, the greedy walk's
ratio estimator in expectation (as T -> 0 the walk is the greedy one). Averaging every position alike instead
would over-weight easy stretches, which a served run crosses in a few long verifications. The walk follows the
row's tokens (the target's own reply at the suite's temperature, so every prefix is one the served model reaches),
as the greedy walk does.

``p_j`` for ``j >= 2`` needs the target on the prefix with the chain's own earlier drafts: one forward per chunk of
chains (verification points x drawn blocks) feeds the row and, after it, every chain, each chain token attending to
its row prefix and its own earlier drafts (a 4-D attention mask with explicit position ids, as tree verification
does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.catalog.evaluation import DRAFT_SAMPLES
from eagle_assets.drafter.data.rows import walkable
from eagle_assets.drafter.data.vocab import DraftVocab
from eagle_assets.drafter.evaluation.acceptance import bootstrap_tau, drafting_mode
from eagle_assets.drafter.family import DraftModel
from eagle_assets.drafter.features.local_capture import decoder_parts, head_logits, run_target
from eagle_assets.serving.engine import sampling_probs

#: chains (verification points x drawn blocks) that share one target forward (the row is re-fed with every chunk)
POINT_CHUNK = 64
#: the seed of the generator that draws sampled drafts (blocks per point: ``evaluation.draft_samples``)
DRAFT_SEED = 0


@dataclass
class ChainProbabilities:
    """The drafts' acceptance probabilities at every verification point of some rows.

    Attributes:
        probs: float64 ``[N, S, K]``; ``probs[i, s, j]`` = probability that draft ``j + 1`` of block ``s`` at point
            ``i`` is accepted once drafts ``1..j`` were: the target's probability of it (point-mass drafts,
            ``S = 1``) or ``min(1, p / q)`` (drawn blocks, ``S`` = the draws); 0 past the point's ``limits``.
        limits: int64 ``[N]``; drafts that fit before the segment's end and were drafted (``min(K, e - 1 - n)``,
            and at most a block drafter's block).
        positions: int64 ``[N]``; the point's ``n`` (tokens from the row's start).
        row_of: int64 ``[N]``; index of the row (in the rows given) the point belongs to.
        notes: rows skipped and why.
        seed: the generator seed of the drawn blocks (unused when ``S = 1``).
    """

    probs: np.ndarray
    limits: np.ndarray
    positions: np.ndarray
    row_of: np.ndarray
    notes: list[str] = field(default_factory=list)
    seed: int = DRAFT_SEED

    @property
    def draft_samples(self) -> int:
        """``S``: blocks per point (1: point-mass drafts, exact; more: drawn blocks, a Monte Carlo mean)."""
        return int(self.probs.shape[1])

    def reach_samples(self, k: int) -> np.ndarray:
        """float64 ``[N, S, k]``: ``P(A >= j | block s)`` for ``j = 1..k`` (``prod_{i<=j} probs[:, s, i]``, 0 past
        the limit of a chain of ``k`` drafts)."""
        cut = np.minimum(self.limits, k)
        reach = np.cumprod(self.probs[:, :, :k], axis=2)
        reach[np.broadcast_to(np.arange(k)[None, None, :] >= cut[:, None, None], reach.shape)] = 0.0
        return reach

    def reach(self, k: int) -> np.ndarray:
        """float64 ``[N, k]``: ``P(A >= j)`` at each point for ``j = 1..k``: the mean of :meth:`reach_samples`
        over the blocks (exact with one point-mass block)."""
        return self.reach_samples(k).mean(axis=1)


@dataclass
class SampledAcceptance:
    """Expected acceptance at one k (see the module docstring).

    Attributes:
        tau: mean expected tokens per verification (1 + E[A]); tau_ci95: 95% bootstrap interval over rows.
        per_position_acceptance: ``[k]``; entry ``j`` is the mean ``P(A >= j + 1)``.
        row_verifications / row_tokens: per row, its expected verifications and expected tokens (bootstrap units).
        position_buckets: expected tokens per verification by position-in-sequence bucket
            (``drafter.evaluation.acceptance.position_buckets``).
        n_verifications: expected verifications over all rows; n_rows, k, temperature.
        tau_mc_se: the Monte Carlo standard error of tau over the drawn blocks (jackknife; 0.0 for point-mass
            drafts, whose figure is exact); draft_samples: blocks drawn per point (1: point masses).
    """

    tau: float
    tau_ci95: list[float]
    per_position_acceptance: list[float]
    row_verifications: list[int]
    row_tokens: list[float]
    position_buckets: list[dict]
    n_verifications: float
    n_rows: int
    k: int
    temperature: float
    tau_mc_se: float = 0.0
    draft_samples: int = 1


@torch.no_grad()
def chain_probabilities(target_model: nn.Module, drafter: DraftModel, draft_vocab: DraftVocab,
                        rows: Sequence[tuple[np.ndarray, np.ndarray]], k: int, temperature: float,
                        top_p: float = 1.0, top_k: int = -1, chunk: int = POINT_CHUNK,
                        draft_samples: int = DRAFT_SAMPLES, seed: int = DRAFT_SEED,
                        greedy_draft: bool = False) -> ChainProbabilities:
    """Acceptance probabilities of ``k``-draft chains at every verification point of ``rows``.

    The drafts are the drafter's point-mass chain (``draft_chain``), or, when it samples its drafts at this
    sampling (``DraftModel.sample_drafts`` returns blocks), ``draft_samples`` blocks per point drawn with a
    generator seeded with ``seed`` (module docstring).

    Args:
        target_model: the HF target (eval mode; float32 on CPU is fine).
        drafter: the trained drafter; draft_vocab: its vocab (checked against the drafter's draft ids).
        rows: ``(input_ids int [T], loss_mask 0/1 [T])`` pairs (prompt tokens have mask 0).
        k: drafts per chain; temperature / top_p / top_k: the target's sampling (``sampling_probs``).
        chunk: chains (points x drawn blocks) per target forward.
        draft_samples / seed: blocks drawn per point, and their generator's seed (sampled drafts only).
        greedy_draft: take the point-mass chain even for a drafter that samples (DSpark under SGLang's
            ``SGLANG_DSPARK_USE_GREEDY_DRAFT=1``).

    Raises:
        ValueError: ``k < 1``, ``temperature <= 0``, ``draft_samples < 1`` or a draft vocab that is not the
            drafter's.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy acceptance is drafter.evaluation.acceptance), got "
                         f"{temperature}")
    if draft_samples < 1:
        raise ValueError(f"draft_samples must be >= 1, got {draft_samples}")
    was_training = drafting_mode(target_model, drafter, draft_vocab, k)
    capture = list(drafter.config.aux_capture_ids)
    decoder = decoder_parts(target_model)[0]
    sample = None if greedy_draft else getattr(drafter, "sample_drafts", None)
    generator = torch.Generator().manual_seed(seed)
    probs, limits, positions, row_of, notes = [], [], [], [], []
    for r, row in enumerate(rows):
        walk = walkable(row, drafter.config.vocab_size)
        if isinstance(walk, str):
            if walk:
                notes.append(f"row {r}: skipped ({walk})")
            continue
        ids_np, _mask, segments = walk
        ids = torch.from_numpy(ids_np)
        aux, _final = run_target(target_model, ids, capture)
        drawn = sample(aux, ids, k, temperature, top_k, draft_samples, generator) if sample is not None else None
        if drawn is None:  # row n-1 drafts tokens n+1 .. n+k
            chain, q = torch.from_numpy(drafter.draft_chain(aux, ids, k))[:, None, :], None
        else:
            chain, q = torch.from_numpy(drawn[0]), drawn[1]
        n_blocks = chain.shape[1]
        # a block drafter proposes at most its block's drafts (the chain is -1 past them): nothing past is verified
        drafted = (chain[:, 0] >= 0).sum(1)
        points = [(n, min(k, e - 1 - n, int(drafted[n - 1]))) for s, e in segments for n in range(s, e - 1)]
        per_forward = max(1, chunk // n_blocks)
        for start in range(0, len(points), per_forward):
            part = points[start:start + per_forward]
            chains = [(n, lim, chain[n - 1, b]) for n, lim in part for b in range(n_blocks)]
            p = _chunk_probs(decoder, target_model, ids, chains, k, temperature, top_p, top_k)
            p = p.reshape(len(part), n_blocks, k)
            probs.append(p if q is None else _rejection_accept(p, q[[n - 1 for n, _lim in part]]))
            limits += [lim for _n, lim in part]
            positions += [n for n, _lim in part]
            row_of += [r] * len(part)
    if was_training:
        drafter.train()
    return ChainProbabilities(np.concatenate(probs) if probs else np.zeros((0, 1, k)),
                              np.asarray(limits, np.int64), np.asarray(positions, np.int64),
                              np.asarray(row_of, np.int64), notes, seed)


def _rejection_accept(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``min(1, p / q)``, 0 where ``q`` is no probability in ``(0, 1]`` (``reject_sampling.py``'s token-wise
    branch accepts when ``coin * q < p`` and ``q`` is one): float64, the shape of ``p`` and ``q``."""
    ok = (q > 0.0) & (q <= 1.0)
    return np.where(ok, np.minimum(1.0, p / np.where(ok, q, 1.0)), 0.0)


def _chunk_probs(decoder, target_model, ids: torch.Tensor, chains: list[tuple[int, int, torch.Tensor]], k: int,
                 temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """float64 ``[len(chains), k]``: the target's probability of each chain's drafts from one forward.

    ``chains``: ``(n, lim, drafts int64 [>= lim])``: the chain verified after position ``n`` of the row, its
    ``lim`` drafts (the tokens ``n + 1 .. n + lim``); entries past ``lim`` are 0."""
    # only the row up to the chunk's last point is needed: later tokens are visible to nobody
    end = max(n for n, _lim, _d in chains) + 1
    row = ids[:end]
    at = torch.tensor([n for n, _lim, _d in chains], dtype=torch.long)
    lims = torch.tensor([lim for _n, lim, _d in chains], dtype=torch.long)
    fed = lims - 1  # the chain's drafts 1..lim-1 are fed; draft lim only needs the logits before it
    first = torch.cumsum(fed, 0) - fed  # each chain's first fed token, counted after the row
    m = int(fed.sum())
    chain_of = torch.repeat_interleave(torch.arange(len(chains)), fed)
    i = torch.arange(m) - first[chain_of] + 1  # draft index 1..lim-1 of each fed token
    extra = torch.cat([d[:lim - 1].long() for _n, lim, d in chains]) if m else torch.zeros(0, dtype=torch.long)
    tokens = torch.cat([row.long(), extra])
    pos = torch.cat([torch.arange(end), at[chain_of] + i])
    allowed = torch.zeros(end + m, end + m, dtype=torch.bool)
    allowed[:end, :end] = torch.ones(end, end, dtype=torch.bool).tril()
    allowed[end:, :end] = torch.arange(end)[None, :] <= at[chain_of][:, None]  # the row prefix x[0..n]
    allowed[end:, end:] = (chain_of[:, None] == chain_of[None, :]) & (i[None, :] <= i[:, None])  # drafts 1..i
    dtype = next(target_model.parameters()).dtype
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    hidden = decoder(input_ids=tokens[None], attention_mask=mask, position_ids=pos[None],
                     use_cache=False).last_hidden_state[0].float()
    # the logits before draft 1 are the row's at n; before draft j + 1, those of fed draft j
    slot = torch.cat([torch.arange(lim) for lim in lims.tolist()])
    owner = torch.repeat_interleave(torch.arange(len(chains)), lims)
    source = torch.where(slot == 0, at[owner], end + first[owner] + slot - 1)
    dist = sampling_probs(head_logits(target_model, hidden[source]), temperature, top_p, top_k)
    want = torch.cat([d[:lim].long() for _n, lim, d in chains])
    out = np.zeros((len(chains), k), dtype=np.float64)
    out[owner.numpy(), slot.numpy()] = dist.gather(1, want[:, None])[:, 0].numpy()
    return out


def _segment_bounds(chains: ChainProbabilities) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the points' walks: runs of one row's contiguous positions."""
    n_points = len(chains.positions)
    cut = np.flatnonzero((chains.row_of[1:] != chains.row_of[:-1])
                         | (chains.positions[1:] != chains.positions[:-1] + 1)) + 1
    edges = [0, *cut.tolist(), n_points]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _visits(reach: np.ndarray, bounds: list[tuple[int, int]]) -> np.ndarray:
    """float64 ``[N, R]``: the walk's visit probabilities for ``R`` estimates of ``P(A >= j)`` at once.

    ``reach``: float64 ``[N, R, k]``. ``P(A = a)`` (``a = 0..k``) is ``reach`` with ``P(A >= 0) = 1`` in front,
    differenced (clipped at 0: a mean of non-increasing draws is non-increasing up to rounding); each walk starts
    with probability 1 at its first point and moves ``a + 1`` points on."""
    n_points, n_rep, k = reach.shape
    full = np.concatenate([np.ones((n_points, n_rep, 1)), reach, np.zeros((n_points, n_rep, 1))], axis=2)
    p_exact = np.maximum(full[:, :, :-1] - full[:, :, 1:], 0.0).transpose(0, 2, 1)  # [N, k + 1, R]
    pi = np.zeros((n_points, n_rep), dtype=np.float64)
    for start, end in bounds:
        pi[start] = 1.0
        for i in range(start, end - 1):
            if not pi[i].any():
                continue
            hi = min(end, i + k + 2)
            pi[i + 1:hi] += pi[i] * p_exact[i, :hi - i - 1]
    return pi


def walk_weights(chains: ChainProbabilities, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(pi [N], reach [N, k])``: the probability that the random walk (module docstring) verifies at each point,
    with chains of ``k`` drafts, and ``P(A >= j)`` there (:meth:`ChainProbabilities.reach`). Points are grouped
    into segments by row and contiguous positions; each segment's walk starts at its first point."""
    reach = chains.reach(k)
    return _visits(reach[:, None, :], _segment_bounds(chains))[:, 0], reach


def mc_standard_error(chains: ChainProbabilities, k: int) -> float:
    """The jackknife standard error of tau over the drawn blocks (module docstring): tau recomputed with draw
    ``s`` left out at every point (``R = S`` walks at once), ``sqrt((S - 1) / S * sum_s (tau_(s) - mean)^2)``;
    0.0 with one block per point (point masses: exact)."""
    s = chains.draft_samples
    if s < 2 or len(chains.positions) == 0:
        return 0.0
    per = chains.reach_samples(k)
    left_out = (per.sum(axis=1, keepdims=True) - per) / (s - 1)  # [N, S, k]
    pi = _visits(left_out, _segment_bounds(chains))
    taus = (pi * (1.0 + left_out.sum(axis=2))).sum(axis=0) / pi.sum(axis=0)
    return float(np.sqrt((s - 1) / s * ((taus - taus.mean()) ** 2).sum()))


def sampled_acceptance(chains: ChainProbabilities, k: int, temperature: float, bucket_edges: Sequence[int] = (),
                       resamples: int = 2000) -> SampledAcceptance:
    """Expected acceptance at ``k`` drafts per verification from :func:`chain_probabilities` (computed for at
    least ``k`` drafts): tau, the per-position rates and the position buckets weighted by the walk's visit
    probabilities (:func:`walk_weights`); rows are the bootstrap units (expected tokens over expected
    verifications). Rows without a verification point contribute none. With drawn blocks, tau's Monte Carlo
    standard error (:func:`mc_standard_error`) comes with it.

    Raises:
        ValueError: the chains hold fewer than ``k`` drafts.
    """
    if chains.probs.shape[2] < k:
        raise ValueError(f"chain probabilities hold {chains.probs.shape[2]} drafts, fewer than k={k}")
    pi, reach = walk_weights(chains, k)
    tokens = 1.0 + reach.sum(axis=1)
    row_ids = np.unique(chains.row_of)
    row_v = [float(pi[chains.row_of == r].sum()) for r in row_ids]
    row_t = [float((pi * tokens)[chains.row_of == r].sum()) for r in row_ids]
    ci, _sd = bootstrap_tau(row_v, row_t, resamples=resamples)
    total = float(pi.sum())
    buckets = position_buckets_weighted(chains.positions, tokens, pi, bucket_edges)
    return SampledAcceptance(
        tau=float((pi * tokens).sum() / total) if total else 0.0, tau_ci95=ci,
        per_position_acceptance=[float(x) for x in (pi @ reach) / total] if total else [0.0] * k,
        row_verifications=row_v, row_tokens=row_t, position_buckets=buckets,
        n_verifications=total, n_rows=len(row_ids), k=k, temperature=float(temperature),
        tau_mc_se=mc_standard_error(chains, k), draft_samples=chains.draft_samples)


def position_buckets_weighted(positions: np.ndarray, tokens: np.ndarray, weights: np.ndarray,
                              edges: Sequence[int]) -> list[dict]:
    """Expected tokens per verification by position bucket, each point weighted by its visit probability
    (``drafter.evaluation.acceptance.position_buckets`` with weights; ``verifications`` is the expected count)."""
    bounds = [0, *[int(e) for e in edges], None]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sel = (positions >= lo) & (positions < hi) if hi is not None else positions >= lo
        w = float(weights[sel].sum())
        if w > 0:
            out.append({"from": lo, "to": hi, "tau": float((weights[sel] * tokens[sel]).sum() / w),
                        "verifications": round(w, 3)})
    return out
