"""Evaluating a trained drafter honestly: simulated tau per held-out partition with its spread, the mean over
partitions with a stratified bootstrap interval, and a plot of per-position acceptance.

With served features (catalog ``training.features.source: served``) nothing here runs the target: the rows'
features and greedy ids come from the server (``evaluate_groups(..., acceptance_rows=...)`` with
``ServedFeatures.acceptance_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.drafter.data.vocab import DraftVocab
from eagle_assets.drafter.evaluation.acceptance import AcceptanceResult, mean_tau_over_groups, simulate_acceptance
from eagle_assets.drafter.family import DraftModel

Row = tuple[np.ndarray, np.ndarray]


@dataclass
class GroupedAcceptance:
    """Simulated acceptance of one drafter on named groups of rows (held-out partitions, thinking modes).

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
    drafter: DraftModel,
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
