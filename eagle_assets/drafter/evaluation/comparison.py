"""Several drafters of one catalog side by side: the ``drafter_comparison`` report.

Every drafter of ``training.drafter`` and ``training.compare`` is trained from the same rows, mix, draft vocab and
recipe and measured by :func:`~eagle_assets.drafter.evaluation.suites.evaluate_suites` on the same held-out rows
and suites, so a column of the report compares drafters and nothing else. The report gives, per drafter, its SGLang
class, its parameters (every tensor of its checkpoint: a block drafter's borrowed embedding and LM head are not in
it), its training seconds (the trainer's own clock) and tau at ``training.acceptance_k`` per suite x thinking mode x
temperature, with the held-out rows' 95% bootstrap interval; and which drafter the measurements support (the
highest mean greedy tau over the measured columns) with the margin to the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle_assets.drafter.evaluation.suites import HELDOUT, EvaluationReport
from eagle_assets.storage.shards import atomic_files

Column = tuple[str, str, float]  # (suite, thinking mode, temperature)


@dataclass
class ComparedDrafter:
    """One drafter of the comparison.

    Attributes:
        label: ``primary`` for ``training.drafter``, else its ``training.compare`` key.
        architecture: the drafter's shape (its config's ``describe()``).
        sglang_class: the ``architectures`` entry of its ``config.json``.
        parameters: elements of every tensor in its checkpoint.
        train_seconds: the optimization loop's seconds (``TrainResult.train_seconds``); None when not recorded.
        checkpoint: its exported folder.
        report: what :func:`~eagle_assets.drafter.evaluation.suites.evaluate_suites` measured of it.
    """

    label: str
    architecture: str
    sglang_class: str
    parameters: int
    train_seconds: float | None
    checkpoint: str
    report: EvaluationReport

    def tau(self, k: int) -> dict[Column, dict]:
        """``(suite, mode, temperature)`` -> its record at ``k`` (``tau``, ``ci_low``, ``ci_high``, ``rows``)."""
        return {(r["suite"], r["thinking"], float(r["temperature"])): r for r in self.report.records if r["k"] == k}


def columns(drafters: list[ComparedDrafter], k: int) -> list[Column]:
    """Every suite x mode x temperature measured for any drafter at ``k``: held-out first, then suites by name, greedy
    before sampled."""
    found = {c for d in drafters for c in d.tau(k)}
    return sorted(found, key=lambda c: (c[0] != HELDOUT, c[0], c[1], c[2]))


def supported(drafters: list[ComparedDrafter], k: int) -> tuple[str | None, str]:
    """The drafter the measurements support, and why: the highest mean greedy tau at ``k`` over the greedy columns
    every drafter was measured on, with the margin to the next; ``(None, why)`` when nothing is comparable."""
    greedy = [c for c in columns(drafters, k) if c[2] == 0.0 and all(c in d.tau(k) for d in drafters)]
    if not drafters or not greedy:
        return None, "no greedy column was measured for every drafter"
    means = sorted(((sum(d.tau(k)[c]["tau"] for c in greedy) / len(greedy), d.label) for d in drafters),
                   reverse=True)
    (best_tau, best), rest = means[0], means[1:]
    where = ", ".join(f"{s}/{m}" for s, m, _t in greedy)
    if not rest:
        return best, f"{best}: mean greedy tau {best_tau:.3f} at k={k} over {where} (the only drafter)"
    second_tau, second = rest[0]
    why = (f"{best}: mean greedy tau {best_tau:.3f} at k={k} over {where}, {best_tau - second_tau:+.3f} over {second} "
           f"({second_tau:.3f})")
    by_label = {d.label: d.tau(k) for d in drafters}
    held = [(by_label[best][c], by_label[second][c]) for c in greedy if c[0] == HELDOUT]
    held = [(a, b) for a, b in held if None not in (a["ci_low"], b["ci_low"])]
    if held and all(a["ci_low"] <= b["ci_high"] and b["ci_low"] <= a["ci_high"] for a, b in held):
        why += "; their held-out 95% intervals overlap, so the lead is not a measured difference on these rows"
    elif held:
        why += "; their held-out 95% intervals do not overlap"
    return best, why


def _cell(record: dict | None) -> str:
    if record is None:
        return "-"
    ci = (f" ({record['ci_low']:.2f}-{record['ci_high']:.2f})"
          if record.get("ci_low") is not None and record["suite"] == HELDOUT else "")
    return f"{record['tau']:.3f}{ci}"


def comparison_markdown(drafters: list[ComparedDrafter], k: int) -> str:
    """``report.md``: one row per drafter (class, parameters, training seconds, tau at ``k`` per column, the held-out
    rows with their 95% interval), the best of each column in bold, then the supported drafter and the rows
    measured per column."""
    cols = columns(drafters, k)
    head = ["drafter", "architecture", "SGLang class", "parameters", "train s"] + [
        f"{s} / {m} / " + ("greedy" if t == 0 else f"T={t:g}") for s, m, t in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = {c: max((d.tau(k)[c]["tau"] for d in drafters if c in d.tau(k)), default=None) for c in cols}
    for d in drafters:
        taus = d.tau(k)
        cells = []
        for c in cols:
            text = _cell(taus.get(c))
            cells.append(f"**{text}**" if c in taus and len(drafters) > 1 and taus[c]["tau"] == best[c] else text)
        seconds = f"{d.train_seconds:.1f}" if d.train_seconds is not None else "-"
        lines.append(f"| {d.label} | {d.architecture} | {d.sglang_class} | {d.parameters:,} | {seconds} | "
                     + " | ".join(cells) + " |")
    label, why = supported(drafters, k)
    lines += ["", f"tau at k={k} (tokens per verification; greedy is SGLang's verification exactly, T > 0 its "
              "expectation at the suite's temperature); every drafter trained from the same rows and recipe and "
              "measured on the same rows.", "", f"measurements support: {why}" if label else f"no choice: {why}"]
    rows = {c: max((d.tau(k)[c]["rows"] for d in drafters if c in d.tau(k)), default=0) for c in cols}
    lines.append("rows per column: " + ", ".join(f"{s}/{m}/T={t:g} {n}" for (s, m, t), n in rows.items()))
    return "\n".join(lines) + "\n"


def comparison_png(drafters: list[ComparedDrafter], k: int) -> bytes:
    """PNG: tau at ``k`` per column, one bar per drafter."""
    from eagle_assets.figures.plots import figure_png, plt

    cols = columns(drafters, k)
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=80)
    width = 0.8 / max(1, len(drafters))
    for i, d in enumerate(drafters):
        taus = d.tau(k)
        ax.bar([j + i * width for j in range(len(cols))], [taus[c]["tau"] if c in taus else 0.0 for c in cols],
               width=width, label=d.label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cols))],
                  [f"{s}\n{m}/" + ("greedy" if t == 0 else f"T={t:g}") for s, m, t in cols], fontsize=6)
    ax.set_ylabel(f"tau at k={k}")
    ax.set_title("drafters side by side", fontsize=10)
    if drafters:
        ax.legend(fontsize=6)
    return figure_png(fig)


def comparison_json(drafters: list[ComparedDrafter], k: int) -> dict:
    """``report.json``: per drafter its label, architecture, class, parameters, training seconds, checkpoint and
    every evaluation record; ``k`` and the supported drafter with the reason."""
    label, why = supported(drafters, k)
    return {"k": k, "supported": label, "reason": why, "drafters": [
        {"label": d.label, "architecture": d.architecture, "sglang_class": d.sglang_class,
         "parameters": d.parameters, "train_seconds": d.train_seconds, "checkpoint": d.checkpoint,
         "records": d.report.records, "gates": [g.__dict__ for g in d.report.gates],
         "seconds": round(d.report.seconds, 2)} for d in drafters]}


def write_comparison(drafters: list[ComparedDrafter], out: Path, k: int) -> tuple[str, bytes]:
    """Write ``report.json``, ``report.md`` and ``tau.png`` to ``out`` together (``storage.shards.atomic_files``:
    a failure leaves the previous report whole); returns the markdown and the PNG."""
    out.mkdir(parents=True, exist_ok=True)
    doc = json.dumps(comparison_json(drafters, k), indent=2, sort_keys=True, default=str)
    md, png = comparison_markdown(drafters, k), comparison_png(drafters, k)
    with atomic_files([out / "report.json", out / "report.md", out / "tau.png"]) as (json_tmp, md_tmp, png_tmp):
        Path(json_tmp).write_text(doc)
        Path(md_tmp).write_text(md, encoding="utf-8")
        Path(png_tmp).write_bytes(png)
    return md, png
