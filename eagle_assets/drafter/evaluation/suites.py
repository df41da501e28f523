"""The drafter measured the way drafters are published: per suite and thinking mode, tau at each k with its
bootstrap interval, per-position acceptance, greedy and at the suite's temperature, and by position in the
sequence; written to ``<storage root>/<catalog>/evaluation/`` (``report.json``, ``report.md``, ``tau_vs_k.png``).

Rows: each suite's QC rows (partition ``eval-<suite>``, ``catalog.evaluation``; never trained on) and, with
``evaluation.heldout``, the training partitions' held-out test rows (suite ``heldout``, the ``acceptance_length``
check's rows, so its tau at ``training.acceptance_k`` is that check's figure). A row's thinking mode is the one
its turn row id names (``tokenized_prompts.walk``), ``default`` for a single-turn row.

Methods: greedy tau is the simulated chain drafting of ``drafter.evaluation.acceptance`` (exact, target re-runs off the
row); tau at the suite's temperature is the expectation of ``drafter.evaluation.sampled`` under SGLang 0.5.23's
sampling verification: exact for point-mass drafts (EAGLE-3, DFlash), a seeded Monte Carlo over drawn blocks with
each block's acceptance exact for DSpark's sampled drafts (its standard error ``tau_mc_se`` in the record).
Intervals: 95% percentile bootstrap over rows (a mean over partitions, for held-out rows: stratified by partition,
``drafter.evaluation.acceptance.mean_tau_over_groups``).

Overlap: a suite row whose prompt ids (the tokens before its reply) equal those of a training-split row of the
trained partitions is counted (``overlap_rows``) and reported; it is still measured.

What the figures stand on: each suite's QC verdict (``qc.status.partition_verdict`` of ``eval-<suite>``: passed,
warned or failed, with its blocking check, finding and kept / dropped replies) and the verdicts of the partitions
the held-out rows come from are in the report (``qc``, ``heldout_qc``); a suite whose QC did not pass is marked
in ``report.md``'s tables and in its gates' text. A failed suite is still measured, on the replies QC kept.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle_assets.catalog import Catalog, suite_partition_key
from eagle_assets.drafter.data.splits import iter_shard_rows, iter_split_rows, load_split_rows
from eagle_assets.drafter.evaluation.acceptance import mean_tau_over_groups, position_buckets, simulate_acceptance
from eagle_assets.drafter.evaluation.sampled import chain_probabilities, sampled_acceptance
from eagle_assets.qc.status import PASSED, QcVerdict, dataset_verdict, partition_verdict
from eagle_assets.storage.shards import Layout, atomic_files

HELDOUT = "heldout"
Row = tuple[np.ndarray, np.ndarray]


@dataclass
class Gate:
    """The verdict on one suite x thinking mode: ``level`` OK | WARN | ERROR on the greedy tau at ``k``, the
    levels (error at or under ``error_at``, warn under ``warn_under``) and the sentence that says so."""

    suite: str
    thinking: str
    level: str
    tau: float
    k: int
    error_at: float
    warn_under: float
    rows: int
    text: str


@dataclass
class EvaluationReport:
    """What :func:`evaluate_suites` measured: ``records`` (one per suite x thinking mode x k x temperature, the
    ``report.json`` records), the gates per suite x mode, overlap counts per suite, suites without rows (name ->
    why) and the seconds it took."""

    records: list[dict]
    gates: list[Gate]
    overlap_rows: dict[str, int]
    missing: dict[str, str]
    seconds: float
    notes: list[str] = field(default_factory=list)
    # suite -> its partition's QC verdict (None: no QC yet); trained partition -> its verdict (the held-out rows'):
    # what the figures stand on (qc.status.QcVerdict)
    qc: dict[str, QcVerdict | None] = field(default_factory=dict)
    heldout_qc: dict[str, QcVerdict | None] = field(default_factory=dict)

    def qc_json(self) -> dict[str, dict | None]:
        """``report.json``'s ``qc``: suite -> its QC verdict (``QcVerdict.to_dict``), None before its QC ran."""
        return {name: v.to_dict() if v is not None else None for name, v in self.qc.items()}

    def qc_marks(self) -> dict[str, str]:
        """Suite -> ``QC failed`` / ``QC warned`` / ``no QC`` for each suite whose QC did not pass (what its rows
        in ``report.md`` and the CLI are marked with)."""
        return {name: ("no QC" if v is None else f"QC {v.verdict}") for name, v in self.qc.items()
                if v is None or v.verdict != PASSED}


def prompt_key(ids: np.ndarray, mask: np.ndarray) -> bytes:
    """Digest of a row's prompt ids: the tokens before its first loss-masked (reply) token."""
    m = np.asarray(mask)
    cut = int(np.argmax(m != 0)) if (m != 0).any() else len(m)
    return hashlib.blake2b(np.asarray(ids[:cut], dtype=np.int32).tobytes(), digest_size=16).digest()


def _mode_of(sample_id: str) -> str:
    from eagle_assets.tokenized_prompts.walk import parse_turn_row_id

    parsed = parse_turn_row_id(sample_id)
    return parsed[1] if parsed is not None else "default"


def suite_rows(layout: Layout, catalog: Catalog, suite: str) -> dict[str, list[tuple[str, np.ndarray, np.ndarray]]]:
    """The QC rows of suite ``suite`` by thinking mode: ``(sample_id, input_ids int32 [T], loss_mask int8 [T])``,
    sorted by sample id (shard order is reply order, which timing decides).

    Raises:
        FileNotFoundError: the suite's partition has no QC shards (the message says to materialize it).
    """
    from eagle_assets.qc.status import dataset_shard_paths

    by_mode: dict[str, list] = {}
    for row in iter_shard_rows(dataset_shard_paths(layout, catalog, suite_partition_key(suite))):
        by_mode.setdefault(_mode_of(row[0]), []).append(row)
    return {mode: sorted(rows, key=lambda r: r[0]) for mode, rows in sorted(by_mode.items())}


def training_prompt_keys(layout: Layout, catalog: Catalog, keys: list[str]) -> set[bytes]:
    """:func:`prompt_key` of every training-split row of the trained partitions ``keys``."""
    return {prompt_key(ids, mask) for _sid, ids, mask, _k in iter_split_rows(layout, catalog, keys, "train")}


def _greedy_curve(target_model, drafter, vocab, groups: dict[str, list[Row]], ks: list[int], edges, resamples,
                  max_positions: int | None) -> dict[int, dict]:
    """Greedy figures per k over partition groups (mean over groups, stratified interval; at most
    ``max_positions`` verifications per group, ``training.acceptance_max_positions``); the target's features are
    computed once per row and the draft chains drafted once at the largest k."""
    features = {name: {} for name in groups}
    chains = {name: {} for name in groups}
    out = {}
    for k in sorted(ks, reverse=True):  # the longest chains first: every shorter k reads their first drafts
        results = {name: simulate_acceptance(target_model, drafter, vocab, rows, k=k, max_positions=max_positions,
                                             features=features[name], chains=chains[name])
                   for name, rows in groups.items()}
        kept = {n: r for n, r in results.items() if r.n_verifications}
        mean, ci = mean_tau_over_groups({n: (r.row_verifications, r.row_tokens) for n, r in kept.items()},
                                        resamples=resamples)
        reach = np.mean([r.per_position_acceptance for r in kept.values()], axis=0) if kept else np.zeros(k)
        positions = [p for r in kept.values() for p in r.positions]
        tokens = [a + 1 for r in kept.values() for a in r.accepted]
        out[k] = {"tau": mean, "ci": ci, "per_position": [float(x) for x in reach],
                  "verifications": sum(r.n_verifications for r in kept.values()),
                  "rows": sum(r.n_rows for r in kept.values()),
                  "position_buckets": position_buckets(positions, tokens, edges)}
    return dict(sorted(out.items()))


def _sampled_curve(target_model, drafter, vocab, rows: list[Row], ks: list[int], sampling, edges, resamples,
                   draft_samples: int) -> dict[int, dict]:
    """Expected figures per k at the suite's sampling (one chain of max(ks) drafts per point serves every k; a
    drafter that samples its drafts draws ``draft_samples`` blocks per point and adds the Monte Carlo standard
    error, the blocks per point and their seed)."""
    chains = chain_probabilities(target_model, drafter, vocab, rows, max(ks), sampling.temperature,
                                 sampling.top_p, sampling.top_k, draft_samples=draft_samples)
    out = {}
    for k in ks:
        r = sampled_acceptance(chains, k, sampling.temperature, edges, resamples)
        out[k] = {"tau": r.tau, "ci": r.tau_ci95, "per_position": r.per_position_acceptance,
                  "verifications": r.n_verifications, "rows": r.n_rows, "position_buckets": r.position_buckets}
        if r.draft_samples > 1:  # drawn blocks (DSpark): a seeded Monte Carlo, its standard error beside it
            out[k].update(tau_mc_se=r.tau_mc_se, draft_samples=r.draft_samples, draft_seed=chains.seed)
    return out


def _records(suite: str, mode: str, temperature: float, curve: dict[int, dict], n_rows: int) -> list[dict]:
    return [{"suite": suite, "thinking": mode, "k": k, "temperature": temperature, "tau": round(c["tau"], 6),
             "ci_low": round(c["ci"][0], 6) if c["ci"] else None, "ci_high": round(c["ci"][1], 6) if c["ci"] else None,
             "rows": n_rows, "verifications": c["verifications"],
             "per_position": [round(x, 6) for x in c["per_position"]], "position_buckets": c["position_buckets"],
             **({"tau_mc_se": round(c["tau_mc_se"], 6), "draft_samples": c["draft_samples"],
                 "draft_seed": c["draft_seed"]} if "tau_mc_se" in c else {})}
            for k, c in curve.items()]


def gate(t, suite_spec, suite: str, mode: str, tau: float, rows: int, qc: QcVerdict | None = None) -> Gate:
    """The verdict on a suite x mode's greedy tau at ``training.acceptance_k``: ERROR at or under ``1 +
    min_tau_margin``, WARN under ``tau_warn`` (the suite's own levels, else the ``training`` section's); no rows
    is an ERROR. ``qc``: the suite partition's QC verdict; one that did not pass is named at the end of the text
    (the level stays the tau's: the figure is right for the rows measured, the text says which rows those are)."""
    margin = suite_spec.min_tau_margin if suite_spec is not None and suite_spec.min_tau_margin is not None \
        else t.min_tau_margin
    warn = suite_spec.tau_warn if suite_spec is not None and suite_spec.tau_warn is not None else t.tau_warn
    error_at, k = 1.0 + margin, t.acceptance_k
    stands = "" if qc is None or qc.verdict == PASSED else f"; suite QC {qc.text()}"
    if rows == 0:
        return Gate(suite, mode, "ERROR", 0.0, k, error_at, warn, 0,
                    f"ERROR: suite {suite}, thinking {mode}: no rows to measure (materialize partition "
                    f"{suite_partition_key(suite)} and check its QC){stands}")
    level = "ERROR" if tau <= error_at else "WARN" if tau < warn else "OK"
    return Gate(suite, mode, level, tau, k, error_at, warn, rows,
                f"{level}: suite {suite}, thinking {mode}: greedy tau {tau:.3f} at k={k} on {rows} rows (error at or "
                f"under {error_at:g}, warn under {warn:g}){stands}")


def evaluate_suites(catalog: Catalog, layout: Layout, target_model, drafter, vocab, trained_keys: list[str],
                    log: Callable[[str], None]) -> EvaluationReport:
    """Measure ``drafter`` (trained on partitions ``trained_keys``) on every suite of ``catalog.evaluation`` and,
    with ``evaluation.heldout``, on the held-out test rows (see the module docstring).

    ``target_model``: the HF target in-process (float32 on CPU is fine). A suite without QC rows costs that suite
    only (``missing``; its gates are ERROR).
    """
    started = time.perf_counter()
    spec, t = catalog.evaluation, catalog.training
    # the training length is always a bucket edge: the buckets past it say how the drafter holds up beyond the
    # longest rows it trained on (training.max_length)
    ks, boot = spec.ks(t.acceptance_k), spec.bootstrap
    edges = sorted(set(spec.position_buckets) | {t.max_length})
    cap = t.acceptance_max_positions
    records: list[dict] = []
    gates: list[Gate] = []
    overlap: dict[str, int] = {}
    missing: dict[str, str] = {}
    notes: list[str] = []
    qc = {name: partition_verdict(layout, suite_partition_key(name)) for name in spec.suites}
    # a chunked dataset's verdict is over all its chunks (dataset_qc), as training judged it
    heldout_qc = {key: dataset_verdict(layout, key) if key in catalog.chunked_datasets else partition_verdict(
        layout, key) for key in trained_keys} if spec.heldout else {}
    if spec.heldout:
        held = sorted(load_split_rows(layout, catalog, trained_keys, "test"), key=lambda r: (r[3], r[0]))
        by_mode: dict[str, dict[str, list[Row]]] = {}
        for sid, ids, mask, key in held:
            by_mode.setdefault(_mode_of(sid), {}).setdefault(key, []).append((ids, mask))
        for mode, groups in sorted(by_mode.items()):
            curve = _greedy_curve(target_model, drafter, vocab, groups, ks, edges, boot, cap)
            records += _records(HELDOUT, mode, 0.0, curve, sum(len(g) for g in groups.values()))
        log(f"evaluation: held-out rows of {trained_keys} measured")
        if not held:
            notes.append(f"no held-out test rows in the trained partitions {trained_keys}: raise "
                         "training.holdout_fraction or holdout_rows to measure them")
    train_keys = training_prompt_keys(layout, catalog, trained_keys) if spec.suites else set()
    for name, suite in spec.suites.items():
        try:
            rows_by_mode = suite_rows(layout, catalog, name)
        except FileNotFoundError as exc:
            missing[name] = str(exc)
            gates += [gate(t, suite, name, mode, 0.0, 0, qc[name]) for mode in suite.modes]
            continue
        overlap[name] = sum(prompt_key(ids, mask) in train_keys
                            for rows in rows_by_mode.values() for _s, ids, mask in rows)
        if overlap[name]:
            log(f"evaluation: suite {name}: {overlap[name]} rows share their prompt ids with training rows")
        for mode in suite.modes:  # rows of another mode are stale: the suite's thinking setting changed
            rows = [(ids, mask) for _s, ids, mask in rows_by_mode.get(mode, [])]
            if not rows:
                gates.append(gate(t, suite, name, mode, 0.0, 0, qc[name]))
                continue
            greedy = _greedy_curve(target_model, drafter, vocab, {name: rows}, ks, edges, boot, cap)
            records += _records(name, mode, 0.0, greedy, len(rows))
            if suite.sampling.temperature > 0:
                sampled = _sampled_curve(target_model, drafter, vocab, rows, ks, suite.sampling, edges, boot,
                                         spec.draft_samples)
                records += _records(name, mode, float(suite.sampling.temperature), sampled, len(rows))
            gates.append(gate(t, suite, name, mode, greedy[t.acceptance_k]["tau"], len(rows), qc[name]))
        log(f"evaluation: suite {name} measured ({ {m: len(r) for m, r in rows_by_mode.items()} } rows by mode)")
    for record in records:
        for bucket in record["position_buckets"]:
            bucket["past_training_length"] = bucket["from"] >= t.max_length
    return EvaluationReport(records, gates, overlap, missing, time.perf_counter() - started, notes=notes, qc=qc,
                            heldout_qc=heldout_qc)


def qc_markdown(report: EvaluationReport) -> list[str]:
    """The lines of ``report.md`` that say what the figures stand on: a table of each suite's QC verdict (passed,
    warned or failed, kept and dropped replies, the finding) and the verdicts of the partitions the held-out rows
    come from (none when there are neither)."""
    lines = []
    if report.qc:
        lines += ["", "what the figures stand on: each suite's QC (a suite whose QC failed is measured on the replies "
                  "QC kept; docs/evaluation.md, QC of a suite):", "",
                  "| suite | partition | QC | kept | dropped | finding |", "|---|---|---|---|---|---|"]
        for name, v in report.qc.items():
            lines.append(f"| {name} | {suite_partition_key(name)} | not run | - | - | no qc_status.json: materialize "
                         "the partition |" if v is None else
                         f"| {name} | {v.partition} | {v.verdict} | {v.kept} | {v.dropped} | {v.finding() or '-'} |")
    if report.heldout_qc:
        lines += ["", "held-out rows from: " + ", ".join(
            f"{key} QC {v.verdict}" + (f" ({v.finding()})" if v.finding() else "") if v is not None
            else f"{key} (no QC)" for key, v in report.heldout_qc.items())]
    return lines


def report_markdown(report: EvaluationReport, ks: list[int]) -> str:
    """``report.md``: tau per suite x thinking mode x temperature at each k (95% interval at the largest; a suite
    whose QC did not pass is marked, e.g. ``gsm8k (QC failed)``), what the figures stand on (:func:`qc_markdown`),
    the per-position acceptance and tau by position in the sequence at the largest k, the gates and the overlap
    counts."""
    rows: dict[tuple, dict[int, dict]] = {}
    for r in report.records:
        rows.setdefault((r["suite"], r["thinking"], r["temperature"]), {})[r["k"]] = r
    marks = report.qc_marks()
    top = max(ks)
    lines = ["| suite | thinking | T | rows | " + " | ".join(f"tau k={k}" for k in ks) + f" | 95% CI k={top} |",
             "|---|---|---|---|" + "---|" * len(ks) + "---|"]
    for (suite, mode, temp), by_k in rows.items():
        last = by_k[top]
        ci = f"{last['ci_low']:.2f}-{last['ci_high']:.2f}" if last["ci_low"] is not None else "-"
        name = f"{suite} ({marks[suite]})" if suite in marks else suite
        lines.append(f"| {name} | {mode} | {temp:g} | {last['rows']} | "
                     + " | ".join(f"{by_k[k]['tau']:.3f}" for k in ks) + f" | {ci} |")
    if not rows:
        lines.append("| (nothing measured) |" + " |" * (4 + len(ks)))
    lines += qc_markdown(report)
    lines += ["", f"per-position acceptance at k={top} (share of verifications with drafts 1..j accepted):", "",
              "| suite | thinking | T | " + " | ".join(f"j={j}" for j in range(1, top + 1)) + " |",
              "|---|---|---|" + "---|" * top]
    for (suite, mode, temp), by_k in rows.items():
        lines.append(f"| {suite} | {mode} | {temp:g} | "
                     + " | ".join(f"{x:.3f}" for x in by_k[top]["per_position"]) + " |")
    lines += ["", f"tau by position in the sequence at k={top} (tokens from the row's start: tau over verifications):",
              ""]
    for (suite, mode, temp), by_k in rows.items():
        cells = [f"{b['from']}-{b['to'] if b['to'] is not None else ''}"
                 + ("(past training length)" if b.get("past_training_length") else "")
                 + f": {b['tau']:.2f} ({b['verifications']:.0f})" for b in by_k[top]["position_buckets"]]
        lines.append(f"- {suite} / {mode} / T={temp:g}: " + ", ".join(cells))
    if report.gates:
        lines += ["", "gates:", ""] + [f"- {g.text}" for g in report.gates]
    if report.overlap_rows:
        lines += ["", "rows sharing prompt ids with training rows: "
                  + ", ".join(f"{s} {n}" for s, n in report.overlap_rows.items())]
    for suite, why in report.missing.items():
        lines.append(f"\nsuite {suite} not measured: {why}")
    lines += [f"\nnote: {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def stands_on_lines(doc: dict) -> list[str]:
    """What a ``report.json`` document (``doc``) stands on, one line per suite (its QC verdict with the kept and
    dropped replies; a failed suite's figures are the replies QC kept) and one for the held-out rows' partitions;
    [] for a report written before verdicts were recorded."""
    lines = []
    for name, v in (doc.get("qc") or {}).items():
        if v is None:
            lines.append(f"suite {name}: QC not run (materialize partition {suite_partition_key(name)})")
            continue
        reason = f" ({v['finding']})" if v.get("finding") else ""
        lines.append(f"suite {name}: QC {v['verdict']}{reason}; kept {v['kept']} of {v['rows']} replies, "
                     f"{v['dropped']} dropped" + ("; its figures are on the replies QC kept"
                                                  if v["verdict"] == "failed" else ""))
    held = doc.get("heldout_qc") or {}
    if held:
        lines.append("held-out rows from: " + ", ".join(
            f"{k} QC {v['verdict']}" if v is not None else f"{k} (no QC)" for k, v in held.items()))
    return lines


def tau_vs_k_png(report: EvaluationReport) -> bytes:
    """PNG: tau against k, one line per suite x thinking mode (solid greedy, dashed at the suite's temperature)."""
    from eagle_assets.figures.plots import figure_png, plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=80)
    curves: dict[tuple, list] = {}
    for r in report.records:
        curves.setdefault((r["suite"], r["thinking"], r["temperature"]), []).append((r["k"], r["tau"]))
    for (suite, mode, temp), points in curves.items():
        points.sort()
        ax.plot([k for k, _ in points], [tau for _, tau in points], marker="o", linestyle="-" if temp == 0 else "--",
                label=f"{suite} / {mode} / " + ("greedy" if temp == 0 else f"T={temp:g}"))
    ax.set_xlabel("k (drafts per verification)")
    ax.set_ylabel("tau (tokens per verification)")
    ax.set_title("acceptance length vs k", fontsize=10)
    if curves:  # an empty legend is a matplotlib warning: nothing measured draws empty axes
        ax.legend(fontsize=6)
    return figure_png(fig)


def write_report(report: EvaluationReport, out: Path, ks: list[int]) -> tuple[str, bytes]:
    """Write ``report.json`` (records, gates, overlap, missing, ``qc``: each suite's QC verdict, ``heldout_qc``: the
    held-out partitions'), ``report.md`` and ``tau_vs_k.png`` to ``out``; returns the markdown and the PNG.

    The three are rendered first, written to temp files and renamed into place together once all are written
    (``storage.shards.atomic_files``): a failure anywhere leaves the previous report whole, with no temp file.
    Raises whatever rendering or writing raises (then nothing is replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    doc = json.dumps({"records": report.records, "gates": [g.__dict__ for g in report.gates],
                      "overlap_rows": report.overlap_rows, "missing": report.missing,
                      "qc": report.qc_json(),
                      "heldout_qc": {k: v.to_dict() if v is not None else None for k, v in report.heldout_qc.items()},
                      **({"notes": report.notes} if report.notes else {}),
                      "seconds": round(report.seconds, 2)}, indent=2, sort_keys=True, default=str)
    md = report_markdown(report, ks)
    png = tau_vs_k_png(report)
    with atomic_files([out / "report.json", out / "report.md", out / "tau_vs_k.png"]) as (json_tmp, md_tmp, png_tmp):
        # report.json: the bytes write_json_atomic writes
        Path(json_tmp).write_text(doc)
        Path(md_tmp).write_text(md, encoding="utf-8")
        Path(png_tmp).write_bytes(png)
    return md, png
