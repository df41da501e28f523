"""What a training run measures as it goes: per-step metrics, the learning curve on validation rows (TTT loss and
simulated tau against training tokens), the early-stopping rule over it, and the curve as a PNG."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence


@dataclass
class StepMetrics:
    """One optimizer step.

    ``step_loss``/``step_acc``/``supervised`` have one entry per TTT step (None where nothing was supervised);
    ``loss`` is the weighted TTT loss, ``tokens`` the batch's row tokens, ``seconds`` the step's wall time.
    """

    step: int
    epoch: int
    loss: float
    step_loss: list[float | None]
    step_acc: list[float | None]
    supervised: list[int]
    lr: float
    tokens: int
    seconds: float


@dataclass
class CurvePoint:
    """One evaluation on the validation rows.

    Attributes:
        step: optimizer steps done; tokens: row tokens trained on so far (all epochs).
        train_loss: mean weighted TTT loss of the steps since the previous point.
        val_loss: weighted TTT loss on the validation rows (teacher-forced, per supervised position, as in training).
        val_tau: simulated tau on the validation rows (chain drafting of ``acceptance_k`` tokens).
        val_acc: per TTT step, the share of validation teacher positions whose target argmax the drafter matches.
        seconds: wall seconds of the evaluation itself.
    """

    step: int
    tokens: int
    train_loss: float
    val_loss: float
    val_tau: float
    val_acc: list[float | None]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EarlyStopping:
    """Best-so-far tracking on validation tau: a point counts as better when it beats the best by ``min_delta``.

    ``stop`` is set once ``patience`` points in a row were not better (never when ``patience`` is 0).
    """

    patience: int
    min_delta: float
    best_tau: float = float("-inf")
    best_step: int = -1
    since_best: int = 0
    stop: bool = False

    def update(self, point: CurvePoint) -> bool:
        """Record ``point``; True when it is the new best (the caller keeps its weights)."""
        if point.val_tau > self.best_tau + self.min_delta or self.best_step < 0:
            self.best_tau, self.best_step, self.since_best = point.val_tau, point.step, 0
            return True
        self.since_best += 1
        self.stop = self.patience > 0 and self.since_best >= self.patience
        return False

    def record(self) -> dict[str, Any]:
        return {"best_tau": self.best_tau if self.best_step >= 0 else None, "best_step": self.best_step,
                "since_best": self.since_best, "stop": self.stop}

    @classmethod
    def from_record(cls, patience: int, min_delta: float, record: dict[str, Any]) -> "EarlyStopping":
        best = record.get("best_tau")
        return cls(patience, min_delta, float("-inf") if best is None else float(best), int(record["best_step"]),
                   int(record["since_best"]), bool(record["stop"]))


def curve_table(points: Sequence[CurvePoint]) -> str:
    """The learning curve as a markdown table (tokens, step, train loss, validation loss, validation tau)."""
    lines = ["| tokens | step | train loss | val loss | val tau |", "|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p.tokens} | {p.step} | {p.train_loss:.4f} | {p.val_loss:.4f} | {p.val_tau:.3f} |")
    return "\n".join(lines)


def curve_png(points: Sequence[CurvePoint], steps: Sequence[StepMetrics], best_step: int | None = None,
              title: str = "drafter learning curve") -> bytes:
    """PNG: training loss per step and validation loss (left axis) and validation tau (right axis) against
    training tokens; a dotted line marks the kept (best) point.

    Args:
        points: the evaluations, in order; steps: every optimizer step (its loss is drawn faintly).
    """
    from eagle_assets.figures.plots import figure_png, plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=80)
    tokens, done = [], 0
    for s in steps:
        done += s.tokens
        tokens.append(done)
    if steps:
        ax.plot(tokens, [s.loss for s in steps], color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss (step)")
    if points:
        ax.plot([p.tokens for p in points], [p.train_loss for p in points], color="tab:blue", marker=".",
                label="train loss")
        ax.plot([p.tokens for p in points], [p.val_loss for p in points], color="tab:orange", marker=".",
                label="val loss")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("TTT loss")
    handles, labels = ax.get_legend_handles_labels()
    if points:
        right = ax.twinx()
        right.plot([p.tokens for p in points], [p.val_tau for p in points], color="tab:green", marker="o",
                   label="val tau")
        right.set_ylabel("simulated tau")
        h, lab = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
        kept = [p for p in points if p.step == best_step]
        if kept:
            ax.axvline(kept[0].tokens, color="black", linestyle=":", linewidth=1)
    ax.legend(handles, labels, fontsize=7, loc="center right")
    ax.set_title(title, fontsize=10)
    return figure_png(fig)
