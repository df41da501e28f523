"""Acceptance when the target samples (temperature > 0): the exact expectation under SGLang 0.5.23's verification.

SGLang's EAGLE worker drafts a chain (``--speculative-eagle-topk 1``: the drafter's top-1 token at every step) and
verifies a sampled request with ``tree_speculative_sampling_target_only`` (``sgl_kernel``
``speculative_sampling.cuh``, called by ``speculative/eagle_info.py`` ``EagleVerifyInput.verify`` with
``threshold_single = threshold_acc = 1``): draft ``d_j`` is accepted when a uniform coin is at most
``p_j = P_target(d_j | prefix, d_1 .. d_{j-1})``, the target's distribution at the request's temperature, top_k and
top_p (``softmax(logits / T)``, ``top_k_renorm_prob``, ``top_p_renorm_prob``:
``serving.engine.sampling_probs``); the first rejection ends the chain and the target samples its own token from
the residual. With one candidate per step the accepted count ``A`` has ``P(A >= j) = p_1 * ... * p_j``, so

    E[A] = sum_{j=1..k} prod_{i<=j} p_i          (tokens per verification: 1 + E[A])

exactly, from the target's and the drafter's probabilities along the draft chain: no coin is thrown, there is no
Monte Carlo error. Greedy verification is the limit T -> 0 (``p_j`` is 1 for the target's argmax, else 0).

Verification points: the walk of ``drafter.evaluation.acceptance`` along each completion segment ``[s, e)`` of a
row, made random: a verification at ``n`` accepts ``A`` drafts (at most ``min(k, e - 1 - n)``, the segment's end)
and the next one is at ``n + A + 1``. The probability ``pi(n)`` that the walk verifies at ``n`` follows exactly from the
distribution of ``A`` at every earlier point (``pi(s) = 1``, ``pi(n + a + 1) += pi(n) P_n(A = a)``), and tau is
the ratio of expected tokens to expected verifications, ``sum pi(n) (1 + E_n[A]) / sum pi(n)``, the greedy walk's
ratio estimator in expectation (as T -> 0 the walk is the greedy one). Averaging every position alike instead
would over-weight easy stretches, which a served run crosses in a few long verifications. The walk follows the
row's tokens (the target's own reply at the suite's temperature, so every prefix is one the served model reaches),
as the greedy walk does.

``p_j`` for ``j >= 2`` needs the target on the prefix with the chain's own earlier drafts: one forward per row
chunk feeds the row and, after it, every chunk position's chain, each chain token attending to its row prefix and
its own earlier drafts (a 4-D attention mask with explicit position ids, as tree verification does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.drafter.data.rows import walkable
from eagle_assets.drafter.data.vocab import DraftVocab
from eagle_assets.drafter.evaluation.acceptance import bootstrap_tau, drafting_mode
from eagle_assets.drafter.family import DraftModel
from eagle_assets.drafter.features.local_capture import decoder_parts, head_logits, run_target
from eagle_assets.serving.engine import sampling_probs

#: verification points whose chains share one target forward (the row is re-fed with every chunk)
POINT_CHUNK = 64


@dataclass
class ChainProbabilities:
    """The draft chain's acceptance probabilities at every verification point of some rows.

    Attributes:
        probs: float64 ``[N, K]``; ``probs[i, j]`` = target probability of draft ``j + 1`` at point ``i`` given the
            row prefix and drafts ``1..j`` (0 past the point's ``limits``).
        limits: int64 ``[N]``; drafts that fit before the segment's end and were drafted (``min(K, e - 1 - n)``,
            and at most a block drafter's block).
        positions: int64 ``[N]``; the point's ``n`` (tokens from the row's start).
        row_of: int64 ``[N]``; index of the row (in the rows given) the point belongs to.
        notes: rows skipped and why.
    """

    probs: np.ndarray
    limits: np.ndarray
    positions: np.ndarray
    row_of: np.ndarray
    notes: list[str] = field(default_factory=list)

    def reach(self, k: int) -> np.ndarray:
        """float64 ``[N, k]``: ``P(A >= j)`` at each point for ``j = 1..k`` (``prod_{i<=j} p_i``, 0 past the
        limit of a chain of ``k`` drafts)."""
        cut = np.minimum(self.limits, k)
        reach = np.cumprod(self.probs[:, :k], axis=1)
        reach[np.arange(k)[None, :] >= cut[:, None]] = 0.0
        return reach


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


@torch.no_grad()
def chain_probabilities(target_model: nn.Module, drafter: DraftModel, draft_vocab: DraftVocab,
                        rows: Sequence[tuple[np.ndarray, np.ndarray]], k: int, temperature: float,
                        top_p: float = 1.0, top_k: int = -1, chunk: int = POINT_CHUNK) -> ChainProbabilities:
    """Acceptance probabilities of ``k``-draft chains at every verification point of ``rows``.

    Args:
        target_model: the HF target (eval mode; float32 on CPU is fine).
        drafter: the trained drafter; draft_vocab: its vocab (checked against the drafter's draft ids).
        rows: ``(input_ids int [T], loss_mask 0/1 [T])`` pairs (prompt tokens have mask 0).
        k: drafts per chain; temperature / top_p / top_k: the target's sampling (``sampling_probs``).
        chunk: verification points per target forward.

    Raises:
        ValueError: ``k < 1``, ``temperature <= 0`` or a draft vocab that is not the drafter's.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy acceptance is drafter.evaluation.acceptance), got "
                         f"{temperature}")
    was_training = drafting_mode(target_model, drafter, draft_vocab, k)
    capture = list(drafter.config.aux_capture_ids)
    decoder = decoder_parts(target_model)[0]
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
        chain = torch.from_numpy(drafter.draft_chain(aux, ids, k))  # row n-1 drafts tokens n+1 .. n+k
        # a block drafter proposes at most its block's drafts (the chain is -1 past them): nothing past is verified
        drafted = (chain >= 0).sum(1)
        points = [(n, min(k, e - 1 - n, int(drafted[n - 1]))) for s, e in segments for n in range(s, e - 1)]
        for start in range(0, len(points), chunk):
            part = points[start:start + chunk]
            probs.append(_chunk_probs(decoder, target_model, ids, chain, part, k, temperature, top_p, top_k))
            limits += [lim for _n, lim in part]
            positions += [n for n, _lim in part]
            row_of += [r] * len(part)
    if was_training:
        drafter.train()
    return ChainProbabilities(np.concatenate(probs) if probs else np.zeros((0, k)),
                              np.asarray(limits, np.int64), np.asarray(positions, np.int64),
                              np.asarray(row_of, np.int64), notes)


def _chunk_probs(decoder, target_model, ids: torch.Tensor, chain: torch.Tensor, points: list[tuple[int, int]],
                 k: int, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """float64 ``[len(points), k]`` acceptance probabilities of the points' chains from one target forward."""
    # only the row up to the chunk's last point is needed: later tokens are visible to nobody
    end = max(n for n, _ in points) + 1
    row = ids[:end]
    extra_tok, extra_pos = [], []
    for n, lim in points:  # the chain's drafts 1..lim-1 are fed; draft lim only needs the logits before it
        for i in range(1, lim):
            extra_tok.append(int(chain[n - 1, i - 1]))
            extra_pos.append(n + i)
    m = len(extra_tok)
    tokens = torch.cat([row, torch.tensor(extra_tok, dtype=row.dtype)])
    pos = torch.cat([torch.arange(end), torch.tensor(extra_pos, dtype=torch.long)])
    allowed = torch.zeros(end + m, end + m, dtype=torch.bool)
    allowed[:end, :end] = torch.ones(end, end, dtype=torch.bool).tril()
    j = 0
    for n, lim in points:
        for i in range(1, lim):
            allowed[end + j, : n + 1] = True  # the row prefix x[0..n]
            allowed[end + j, end + j - i + 1: end + j + 1] = True  # drafts 1..i of the same chain
            j += 1
    dtype = next(target_model.parameters()).dtype
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    hidden = decoder(input_ids=tokens[None].long(), attention_mask=mask, position_ids=pos[None],
                     use_cache=False).last_hidden_state[0].float()
    out = np.zeros((len(points), k), dtype=np.float64)
    j = 0
    for p, (n, lim) in enumerate(points):
        # the logits before draft 1 are the row's at n; before draft i + 1, those of fed draft i
        rows = torch.cat([hidden[n:n + 1], hidden[end + j: end + j + lim - 1]])
        dist = sampling_probs(head_logits(target_model, rows), temperature, top_p, top_k)
        want = chain[n - 1, :lim].long()
        out[p, :lim] = dist.gather(1, want[:, None])[:, 0].numpy()
        j += lim - 1
    return out


def walk_weights(chains: ChainProbabilities, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(pi [N], reach [N, k])``: the probability that the random walk (module docstring) verifies at each point,
    with chains of ``k`` drafts, and ``P(A >= j)`` there (:meth:`ChainProbabilities.reach`). Points are grouped
    into segments by row and contiguous positions; each segment's walk starts at its first point."""
    reach = chains.reach(k)
    n_points = reach.shape[0]
    pi = np.zeros(n_points, dtype=np.float64)
    # P(A = a) for a = 0..k: reach with P(A >= 0) = 1 in front, differenced
    full = np.concatenate([np.ones((n_points, 1)), reach, np.zeros((n_points, 1))], axis=1)
    p_exact = full[:, :-1] - full[:, 1:]
    start = 0
    while start < n_points:
        end = start + 1
        while end < n_points and chains.row_of[end] == chains.row_of[start] \
                and chains.positions[end] == chains.positions[end - 1] + 1:
            end += 1
        pi[start] = 1.0
        for i in range(start, end):
            if pi[i] == 0.0:
                continue
            for a in range(k + 1):
                j = i + a + 1
                if j < end and p_exact[i, a] > 0.0:
                    pi[j] += pi[i] * p_exact[i, a]
        start = end
    return pi, reach


def sampled_acceptance(chains: ChainProbabilities, k: int, temperature: float, bucket_edges: Sequence[int] = (),
                       resamples: int = 2000) -> SampledAcceptance:
    """Expected acceptance at ``k`` drafts per verification from :func:`chain_probabilities` (computed for at
    least ``k`` drafts): tau, the per-position rates and the position buckets weighted by the walk's visit
    probabilities (:func:`walk_weights`); rows are the bootstrap units (expected tokens over expected
    verifications). Rows without a verification point contribute none.

    Raises:
        ValueError: the chains hold fewer than ``k`` drafts.
    """
    if chains.probs.shape[1] < k:
        raise ValueError(f"chain probabilities hold {chains.probs.shape[1]} drafts, fewer than k={k}")
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
        n_verifications=total, n_rows=len(row_ids), k=k, temperature=float(temperature))


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
