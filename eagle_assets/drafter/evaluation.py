"""Evaluating a trained drafter honestly: simulated tau per held-out partition with its spread, the mean over
partitions with a stratified bootstrap interval, rows generated greedily by the target (local, or the server that
serves it) for prompts from a source the drafter never trained on, and a plot of per-position acceptance.

With served features (catalog ``training.features.source: served``) nothing here runs the target: the rows'
features and greedy ids come from the server (``evaluate_groups(..., acceptance_rows=...)`` with
``ServedFeatures.acceptance_rows``) and the unseen-source rows from its ``/generate`` (:func:`served_greedy_rows`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.drafter.acceptance import AcceptanceResult, mean_tau_over_groups, simulate_acceptance
from eagle_assets.drafter.model import Eagle3DraftModel
from eagle_assets.drafter.vocab import DraftVocab

Row = tuple[np.ndarray, np.ndarray]


@dataclass
class GroupedAcceptance:
    """Simulated acceptance of one drafter on named groups of rows (held-out partitions, an unseen source).

    Attributes:
        groups: name -> :class:`AcceptanceResult`.
        mean_tau: mean over the groups that had rows of each group's tau; mean_tau_ci95: stratified 95% bootstrap
            interval of it (rows resampled within each group; see :func:`mean_tau_over_groups`).
        rows: rows per group.
    """

    groups: dict[str, AcceptanceResult]
    mean_tau: float
    mean_tau_ci95: list[float]
    rows: dict[str, int] = field(default_factory=dict)

    def summary(self, digits: int = 4) -> dict[str, Any]:
        """JSON for asset metadata: per group tau, its interval and per-row sd, per-position acceptance, rows,
        verifications and exact re-runs (target forwards, or with served features requests, off the rows)."""
        return {
            name: {
                "tau": round(r.tau, digits),
                "tau_ci95": [round(x, digits) for x in r.tau_ci95],
                "tau_row_sd": round(r.tau_row_sd, digits),
                "per_position_acceptance": [round(a, digits) for a in r.per_position_acceptance],
                "rows": self.rows.get(name, r.n_rows),
                "verifications": r.n_verifications,
                "exact_reruns": r.exact_reruns,
            }
            for name, r in self.groups.items()
        }


@torch.no_grad()
def evaluate_groups(
    target: nn.Module,
    drafter: Eagle3DraftModel,
    vocab: DraftVocab,
    groups: Mapping[str, Sequence[Row]],
    k: int,
    max_positions: int | None = None,
    acceptance_rows: Callable[[list[Row]], tuple[Sequence[Row], dict[str, Any]]] | None = None,
) -> GroupedAcceptance:
    """:func:`simulate_acceptance` of ``drafter`` on every group (``k`` drafts per verification), and the mean.

    Args:
        target: the HF target, run for every row's features and greedy ids; with ``acceptance_rows`` from a served
            source, anything with the target's ``config`` and ``get_input_embeddings()`` (``ServedTarget``).
        max_positions: caps verifications per group (None = every row in full).
        acceptance_rows: ``rows -> (rows, simulate_acceptance keyword arguments)`` per group, e.g.
            ``ServedFeatures.acceptance_rows`` (features and greedy ids from the server, re-runs as requests);
            None = the target runs.
    """
    results = {}
    for name, rows in groups.items():
        rows, extra = acceptance_rows(list(rows)) if acceptance_rows is not None else (list(rows), {})
        results[name] = simulate_acceptance(target, drafter, vocab, rows, k=k, max_positions=max_positions, **extra)
    mean, ci = mean_tau_over_groups({n: (r.row_verifications, r.row_tokens) for n, r in results.items()})
    return GroupedAcceptance(results, mean, ci, {n: len(rows) for n, rows in groups.items()})


@torch.no_grad()
def greedy_rows(target: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                stop_ids: Sequence[int], batch_size: int = 16) -> list[Row]:
    """Rows ``(prompt_ids + output_ids int32 [T], loss_mask int8 [T])`` from greedy decoding with the local target.

    Prompts are decoded ``batch_size`` at a time, left-padded with an attention mask (``transformers``'
    ``generate``), up to ``max_new_tokens`` new tokens; each output ends at its first stop id (kept, as SGLang's
    ``output_ids`` keep the matched stop token). Padding can move a logit by float rounding, so a row may leave the
    exact greedy path at a near-tie; :func:`~eagle_assets.drafter.acceptance.simulate_acceptance` re-runs the target
    wherever an accepted draft leaves the row's tokens, so the tau measured on these rows stays exact. The loss
    mask is 1 on the output ids.
    """
    stops = {int(s) for s in stop_ids}
    pad = int(stop_ids[0])
    rows: list[Row] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, p in enumerate(chunk):
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p):] = 1
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=sorted(stops), pad_token_id=pad, temperature=None, top_p=None,
                              top_k=None)
        for b, p in enumerate(chunk):
            rows.append(_greedy_row(p, out[b, width:].tolist(), stops))
    return rows


def _greedy_row(prompt: Sequence[int], output_ids: Sequence[int], stops: set[int]) -> Row:
    """``(prompt + output up to and with its first stop id, int32 [T]; loss mask int8 [T], 1 on the output)``."""
    new = list(output_ids)
    for j, tok in enumerate(new):
        if tok in stops:
            new = new[: j + 1]
            break
    full = np.asarray(list(prompt) + new, dtype=np.int32)
    loss_mask = np.zeros(full.size, dtype=np.int8)
    loss_mask[len(prompt):] = 1
    return full, loss_mask


def served_greedy_rows(client: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       stop_ids: Sequence[int], vocab_size: int | None = None) -> tuple[list[Row], Counter]:
    """Rows like :func:`greedy_rows`, decoded greedily by the server that serves the target (SGLang's
    ``/generate`` at temperature 0 with ``stop_token_ids``; the matched stop id stays in ``output_ids``), for a
    target that does not fit this process.

    Args:
        client: a ``serving.client.GenerateClient`` of the server(s) (its retries and backoff apply).
        prompts: prompt ids per row; max_new_tokens: the cap per row; stop_ids: the target's stop ids (the
            output is also cut after the first one, as :func:`greedy_rows` does).
        vocab_size: for the client's id checks (None = none).

    Returns:
        ``(rows in prompt order without the failed ones, failure kind -> count)``: a prompt the server refuses
        (HTTP 400: longer than its context, ...) or that fails after the client's attempts costs that row only.
    """
    from eagle_assets.serving.protocol import GenerateFailure, SamplingParams

    sampling = SamplingParams(max_new_tokens=int(max_new_tokens), temperature=0.0,
                              stop_token_ids=tuple(int(s) for s in stop_ids))
    replies = client.generate_all([(f"unseen-{i}", [int(t) for t in p]) for i, p in enumerate(prompts)], sampling,
                                  vocab_size=vocab_size)
    stops = {int(s) for s in stop_ids}
    rows: list[Row] = []
    failed: Counter = Counter()
    for prompt, reply in zip(prompts, replies):
        if isinstance(reply, GenerateFailure):
            failed[reply.kind] += 1
            continue
        rows.append(_greedy_row(prompt, reply.output_ids, stops))
    return rows, failed


def acceptance_png(results: Mapping[str, AcceptanceResult], title: str = "per-position acceptance") -> bytes:
    """PNG: for each named result, the share of verifications whose first ``j`` drafts were all accepted."""
    from eagle_assets.figures.plots import figure_png, plt

    fig, ax = plt.subplots(figsize=(6.4, 3.0), dpi=80)
    for name, r in results.items():
        if r.n_verifications:
            ci = f" [{r.tau_ci95[0]:.2f}, {r.tau_ci95[1]:.2f}]" if r.tau_ci95 else ""
            ax.plot(range(1, r.k + 1), r.per_position_acceptance, marker="o", label=f"{name}: tau {r.tau:.2f}{ci}")
    ax.set_xlabel("draft position j")
    ax.set_ylabel("share with drafts 1..j accepted")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return figure_png(fig)
