"""Simulated acceptance length (tau) of a drafter on held-out rows, without a serving engine.

Chain drafting at temperature 0, as SGLang's EAGLE worker does with ``--speculative-eagle-topk 1``: after the target
has emitted token ``x[n]`` (its hidden states for positions ``< n`` are known), the drafter proposes ``k`` tokens one
after another, each step fed its own previous hidden state and its own previous token; the target accepts the
longest prefix equal to its own greedy continuation and adds one token of its own. tau = mean tokens emitted per
verification (accepted + 1); EAGLE-3 (arXiv 2503.01840, table 1) reports tau 6.1-6.7 at temperature 0 for
LLaMA-3.1-8B with tree drafting.

The walk follows the row's own tokens: verification points are ``n = s, s + m1 + 1, ...`` inside each completion
segment ``[s, e)`` of the loss mask (``x[s]`` itself comes from the target's prefill, so the first draft predicts
``x[s + 1]``). The target's greedy token after the row prefix ``x[:q+1]`` is read from one forward pass over the row;
when an accepted draft differs from the row's token (rows sampled at temperature > 0) the target is re-run on the
exact prefix, so acceptance is never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.drafter.data.rows import walkable
from eagle_assets.drafter.data.vocab import DraftVocab
from eagle_assets.drafter.family import DraftModel
from eagle_assets.drafter.features.local_capture import head_argmax, run_target


@dataclass
class AcceptanceResult:
    """Outcome of :func:`simulate_acceptance`.

    Attributes:
        tau: mean tokens emitted per verification, counting the target's own token (>= 1; 0.0 if nothing ran).
        per_position_acceptance: ``[k]``; entry ``j`` is the share of verifications whose first ``j + 1`` drafts
            were all accepted (so tau = 1 + sum of entries, up to segment-end truncation).
        conditional_acceptance: ``[k]``; entry ``j`` = P(draft ``j + 1`` accepted | drafts ``1..j`` accepted).
        accept_length_histogram: ``[k + 1]`` counts of verifications that accepted 0..k drafts.
        n_verifications: verification steps simulated.
        n_tokens: tokens emitted by those steps.
        n_rows: rows that contributed at least one verification.
        exact_reruns: target re-runs needed because an accepted draft left the row's tokens.
        k: drafts per verification.
        row_verifications / row_tokens: per row that contributed, its verifications and emitted tokens (in row
            order), from which the spread is taken.
        tau_ci95: 95% bootstrap interval of tau over rows (``[lo, hi]``; see :func:`bootstrap_tau`).
        tau_row_sd: standard deviation of the per-row tau (``row_tokens / row_verifications``).
        positions / accepted: per verification, in walk order, the position ``n`` of the target's last token
            (tokens from the row's start) and the drafts accepted there (for :func:`position_buckets`).
    """

    tau: float
    per_position_acceptance: list[float]
    conditional_acceptance: list[float]
    accept_length_histogram: list[int]
    n_verifications: int
    n_tokens: int
    n_rows: int
    exact_reruns: int
    k: int
    notes: list[str] = field(default_factory=list)
    row_verifications: list[int] = field(default_factory=list)
    row_tokens: list[int] = field(default_factory=list)
    tau_ci95: list[float] = field(default_factory=list)
    tau_row_sd: float = 0.0
    positions: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "tau_ci95": self.tau_ci95,
            "tau_row_sd": self.tau_row_sd,
            "per_position_acceptance": self.per_position_acceptance,
            "conditional_acceptance": self.conditional_acceptance,
            "accept_length_histogram": self.accept_length_histogram,
            "n_verifications": self.n_verifications,
            "n_tokens": self.n_tokens,
            "n_rows": self.n_rows,
            "exact_reruns": self.exact_reruns,
            "k": self.k,
            "notes": self.notes,
            "row_verifications": self.row_verifications,
            "row_tokens": self.row_tokens,
        }


def bootstrap_tau(
    row_verifications: Sequence[int], row_tokens: Sequence[int], resamples: int = 2000, seed: int = 0
) -> tuple[list[float], float]:
    """95% percentile-bootstrap interval of tau over rows, and the standard deviation of per-row tau.

    Rows are the resampling unit (verifications within a row are not independent): each resample draws rows with
    replacement and takes ``sum(tokens) / sum(verifications)``, the same ratio estimator as tau (Efron and
    Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13). Seeded, so the interval is reproducible.

    Returns:
        ``([lo, hi], sd)``; ``([], 0.0)`` without rows.
    """
    v = np.asarray(row_verifications, dtype=np.float64)
    t = np.asarray(row_tokens, dtype=np.float64)
    if v.size == 0:
        return [], 0.0
    sd = float(np.std(t / v, ddof=1)) if v.size > 1 else 0.0
    pick = np.random.default_rng(seed).integers(0, v.size, size=(resamples, v.size))
    taus = t[pick].sum(axis=1) / v[pick].sum(axis=1)
    lo, hi = np.percentile(taus, [2.5, 97.5])
    return [float(lo), float(hi)], sd


def mean_tau_over_groups(
    groups: dict[str, tuple[Sequence[int], Sequence[int]]], resamples: int = 2000, seed: int = 0
) -> tuple[float, list[float]]:
    """Mean over groups (partitions) of each group's tau, with a stratified 95% bootstrap interval.

    Args:
        groups: name -> ``(row_verifications, row_tokens)`` of that group's rows (:class:`AcceptanceResult`).

    Each resample redraws rows with replacement within every group, takes each group's tau
    (``sum tokens / sum verifications``) and averages them, so every group weighs the same however many rows or
    verifications it has. Groups without rows are left out.

    Returns:
        ``(mean tau, [lo, hi])``; ``(0.0, [])`` when no group has rows.
    """
    kept = [(np.asarray(v, np.float64), np.asarray(t, np.float64)) for v, t in groups.values() if len(v)]
    if not kept:
        return 0.0, []
    point = float(np.mean([t.sum() / v.sum() for v, t in kept]))
    gen = np.random.default_rng(seed)
    taus = np.zeros(resamples)
    for v, t in kept:
        pick = gen.integers(0, v.size, size=(resamples, v.size))
        taus += t[pick].sum(axis=1) / v[pick].sum(axis=1)
    taus /= len(kept)
    lo, hi = np.percentile(taus, [2.5, 97.5])
    return point, [float(lo), float(hi)]


def drafting_mode(target_model: nn.Module, drafter: DraftModel, draft_vocab: DraftVocab, k: int) -> bool:
    """Make ``drafter`` ready to draft chains of ``k`` against ``target_model``: the draft vocab checked, the
    target's embedding attached when the drafter has none, eval mode. Returns whether it was training (the
    caller puts it back).

    Raises:
        ValueError: ``k < 1`` or the draft vocab does not belong to the drafter.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if drafter.draft_token_ids is not None and not torch.equal(drafter.draft_token_ids.cpu(),
                                                              torch.from_numpy(draft_vocab.draft_token_ids)):
        raise ValueError("draft_vocab is not the vocab this drafter was trained with (draft ids differ)")
    if drafter.embed_weight.numel() == 0:
        drafter.attach_embedding(target_model.get_input_embeddings().weight.float())
    was_training = drafter.training
    drafter.eval()
    return was_training


@torch.no_grad()
def simulate_acceptance(
    target_model: nn.Module,
    drafter: DraftModel,
    draft_vocab: DraftVocab,
    rows: Sequence[tuple[np.ndarray, np.ndarray]],
    k: int = 7,
    max_positions: int | None = 2000,
    features: dict[int, tuple[torch.Tensor, np.ndarray]] | None = None,
    greedy_next: Callable[[np.ndarray], int] | None = None,
    chains: dict[int, np.ndarray] | None = None,
) -> AcceptanceResult:
    """Simulate temperature-0 chain drafting over held-out rows (see module docstring).

    Length: one loop on purpose; the chain's state (position in the row, the drafter's hidden state and the
    pending draft, whether the chain has left the row and runs on exact re-runs) is carried from one verification
    to the next, as SGLang's EAGLE worker carries it.

    Args:
        target_model: the HF target (eval mode, float32 on CPU is fine).
        drafter: the trained drafter; its ``aux_capture_ids`` select the target layers.
        draft_vocab: the drafter's vocab (checked against the drafter's draft ids).
        rows: ``(input_ids int [T], loss_mask 0/1 [T])`` pairs; prompt tokens have mask 0.
        k: drafts per verification (SGLang ``--speculative-num-steps``).
        max_positions: stop after this many verifications in total (None = no cap).
        features: a dict kept by the caller across calls on the same rows and target: the target's aux hidden
            states ``[1, T, 3H]`` and greedy ids ``[T]`` of row ``i`` are stored under ``i`` on first use and
            reused after (the target is frozen; only the drafter changes between calls). A mapping whose value for
            a row is None (a served row the server refused) skips that row with a note.
        greedy_next: the target's greedy token after a prefix (int64 ``[n]``), for the exact re-runs once a draft
            leaves the row; None = a forward of ``target_model``. With it and ``features`` holding every row (e.g.
            features served by SGLang, ``eagle_assets.drafter.features.served_client``), ``target_model`` is never run.
        chains: a dict kept by the caller across calls with the SAME drafter (a k curve): row ``i``'s draft chain
            ``[T, K]`` is stored under ``i`` and its first ``k`` columns reused for any ``k <= K`` (a chain's first
            drafts do not depend on how many follow). None = drafted on every call.

    Returns:
        :class:`AcceptanceResult`.

    Raises:
        ValueError: ``k < 1`` or the draft vocab does not belong to the drafter.
    """
    was_training = drafting_mode(target_model, drafter, draft_vocab, k)
    capture = list(drafter.config.aux_capture_ids)
    vocab_size = drafter.config.vocab_size

    lengths: list[int] = []
    positions: list[int] = []
    row_verifications: list[int] = []
    row_tokens: list[int] = []
    histogram = np.zeros(k + 1, dtype=np.int64)
    reruns = 0
    rows_used = 0
    notes: list[str] = []
    budget = max_positions if max_positions is not None else float("inf")

    for row_index, row in enumerate(rows):
        if len(lengths) >= budget:
            break
        walk = walkable(row, vocab_size)
        if isinstance(walk, str):
            if walk:
                notes.append(f"row {row_index}: skipped ({walk})")
            continue
        ids_np, _mask_np, segments = walk
        ids = torch.from_numpy(ids_np)
        if features is not None and row_index in features:
            got = features[row_index]
            if got is None:  # the feature source has none for this row (a served row the server refused)
                notes.append(f"row {row_index}: skipped (no target features for it)")
                continue
            aux, greedy = got
        else:
            aux, final = run_target(target_model, ids, capture)
            greedy = head_argmax(target_model, final[0]).numpy()
            if features is not None:
                features[row_index] = (aux, greedy)
        chain = chains.get(row_index) if chains is not None else None
        if chain is None or chain.shape[1] < k:
            chain = drafter.draft_chain(aux, ids, k)
            if chains is not None:
                chains[row_index] = chain
        before = len(lengths)
        for start, end in segments:
            n = start
            while n <= end - 2 and len(lengths) < budget:
                limit = min(k, end - 1 - n)
                accepted: list[int] = []
                off_row = False
                for j in range(limit):
                    draft = int(chain[n - 1, j])
                    if off_row:
                        reruns += 1
                        prefix = torch.from_numpy(np.concatenate([ids_np[: n + 1], np.asarray(accepted, np.int64)]))
                        if greedy_next is not None:
                            want = int(greedy_next(prefix.numpy()))
                        else:
                            _, fin = run_target(target_model, prefix, capture)
                            want = int(head_argmax(target_model, fin[0, -1:])[0])
                    else:
                        want = int(greedy[n + j])
                    if draft != want:
                        break
                    accepted.append(draft)
                    off_row = off_row or draft != int(ids_np[n + j + 1])
                lengths.append(len(accepted))
                positions.append(n)
                histogram[len(accepted)] += 1
                n += len(accepted) + 1
        if len(lengths) > before:
            rows_used += 1
            row_verifications.append(len(lengths) - before)
            row_tokens.append(int(sum(lengths[before:])) + len(lengths) - before)

    if was_training:
        drafter.train()
    if not lengths:
        notes.append("no verification point: rows need a completion segment of >= 2 tokens after a prompt")
        return AcceptanceResult(0.0, [0.0] * k, [0.0] * k, histogram.tolist(), 0, 0, rows_used, reruns, k, notes)
    acc = np.asarray(lengths)
    reach = [(acc >= j + 1).mean() for j in range(k)]
    conditional = []
    for j in range(k):
        prior = (acc >= j).sum()
        conditional.append(float((acc >= j + 1).sum() / prior) if prior else 0.0)
    ci, sd = bootstrap_tau(row_verifications, row_tokens)
    return AcceptanceResult(
        tau=float((acc + 1).mean()),
        per_position_acceptance=[float(r) for r in reach],
        conditional_acceptance=conditional,
        accept_length_histogram=histogram.tolist(),
        n_verifications=int(acc.size),
        n_tokens=int((acc + 1).sum()),
        n_rows=rows_used,
        exact_reruns=reruns,
        k=k,
        notes=notes,
        row_verifications=row_verifications,
        row_tokens=row_tokens,
        tau_ci95=ci,
        tau_row_sd=sd,
        positions=positions,
        accepted=[int(a) for a in lengths],
    )


def position_buckets(positions: Sequence[int], tokens: Sequence[float], edges: Sequence[int]) -> list[dict]:
    """Tokens per verification by position-in-sequence bucket.

    Args:
        positions: per verification, the position of the target's last token before it (tokens from the row's
            start, prompt included).
        tokens: per verification, tokens emitted (accepted + 1; an expectation under sampling).
        edges: ascending bucket edges; buckets ``[0, e0), [e0, e1), ..., [e_last, inf)``.

    Returns:
        ``[{"from", "to" (None = open), "tau", "verifications"}]``, one per bucket with a verification in it.
    """
    pos = np.asarray(positions, dtype=np.int64)
    tok = np.asarray(tokens, dtype=np.float64)
    bounds = [0, *[int(e) for e in edges], None]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sel = (pos >= lo) & (pos < hi) if hi is not None else pos >= lo
        if sel.any():
            out.append({"from": lo, "to": hi, "tau": float(tok[sel].mean()), "verifications": int(sel.sum())})
    return out
