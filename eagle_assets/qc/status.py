"""Which datasets passed QC, each partition's QC verdict, and where a dataset's QC rows and shards are: read from
``qc_status.json`` and the files under ``<storage root>/<catalog>/qc_shards/<partition>/`` (no Dagster: the assets,
the schedules, the CLI, the evaluation report and the exports ask here).

The verdict (:func:`qc_verdict`, :func:`partition_verdict`) is the one word every place shows for a partition's QC:
``passed`` (both blocking checks at level OK), ``warned`` (a WARN finding, no ERROR: the partition trains) or
``failed`` (a blocking check at ERROR, or no reply kept: the partition is left out of training, and a suite's
figures stand on the few rows QC kept), with the blocking check, its finding and the kept / dropped counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from eagle_assets.catalog import Catalog
from eagle_assets.qc.dataset_checks import dataset_checks
from eagle_assets.qc.thresholds import Outcome
from eagle_assets.storage.shards import Layout, safe_name, shard_paths

QC_STATUS_FILE = "qc_status.json"
ROWS_FILE = "rows.parquet"

PASSED, WARNED, FAILED = "passed", "warned", "failed"
VERDICTS = (PASSED, WARNED, FAILED)
NOT_RUN = "not run"  # a partition without qc_status.json yet: no verdict
# The blocking checks in the order a verdict names them (token_structure first: a broken reply is worse than a
# short one, and its drops are what the kept count lost)
CHECKS = ("token_structure", "response_length")


@dataclass(frozen=True)
class QcVerdict:
    """One partition's (or chunked dataset's) QC verdict.

    ``verdict``: ``passed`` | ``warned`` | ``failed`` (module docstring). ``levels``: check name -> OK | WARN |
    ERROR. ``findings``: the broken thresholds, each ``{"check", "level", "figure", "value", "threshold",
    "comparison"}`` (figures: shares in [0, 1], lengths in tokens). ``rows``: generated replies checked (turn rows
    of an ``all_turns`` partition), ``kept`` of them kept, ``dropped`` = rows - kept.
    """

    partition: str
    verdict: str
    levels: dict[str, str]
    findings: tuple[dict[str, Any], ...] = ()
    rows: int = 0
    kept: int = 0
    stale: bool = field(default=False)  # written before qc_status.json recorded its findings (re-run QC)

    @property
    def dropped(self) -> int:
        return self.rows - self.kept

    @property
    def blocking_check(self) -> str | None:
        """The check that failed the partition (the first at ERROR, in :data:`CHECKS` order), else None."""
        return next((c for c in CHECKS if self.levels.get(c) == "ERROR"), None)

    def reported(self) -> list[dict[str, Any]]:
        """The findings the verdict stands on: the ERROR ones of a failed partition, the WARN ones of a warned
        one (one level per verdict), none of a passed one."""
        level = {FAILED: "ERROR", WARNED: "WARN"}.get(self.verdict)
        return [f for f in self.findings if f["level"] == level]

    def finding(self) -> str:
        """The reason in words, e.g. ``token_structure: share_dropped = 0.8974 > threshold 0.5`` ("" when
        passed)."""
        if self.verdict == PASSED:
            return ""
        if self.rows == 0:
            return "no generated replies to check (the partition is empty)"
        if self.verdict == FAILED and self.kept == 0 and self.blocking_check is None:
            return f"no reply kept (0 of {self.rows}): nothing to train on or measure"
        found = self.reported()
        if not found:  # a qc_status.json from before findings were recorded: the levels are all it has
            bad = {FAILED: "ERROR", WARNED: "WARN"}[self.verdict]
            return "; ".join(f"{c} {bad}" for c in CHECKS if self.levels.get(c) == bad) + \
                " (materialize qc_shards again for the figures)"
        return "; ".join(f"{f['check']}: {f['figure']} = {f['value']:.4g} {f['comparison']} threshold "
                         f"{f['threshold']:.4g}" for f in found)

    def counts(self) -> str:
        """``kept 4 of 39 replies, 35 dropped``."""
        return f"kept {self.kept} of {self.rows} replies, {self.dropped} dropped"

    def text(self) -> str:
        """The verdict as one line: ``failed (token_structure: share_dropped = 0.8974 > threshold 0.5); kept 4 of
        39 replies, 35 dropped``; ``passed; kept 121 of 121 replies, 0 dropped``."""
        reason = self.finding()
        return f"{self.verdict}{f' ({reason})' if reason else ''}; {self.counts()}"

    def to_dict(self) -> dict[str, Any]:
        """The verdict as JSON (the evaluation report's ``qc`` entries)."""
        return {"partition": self.partition, "verdict": self.verdict, "blocking_check": self.blocking_check,
                "finding": self.finding(), "levels": dict(self.levels), "rows": self.rows, "kept": self.kept,
                "dropped": self.dropped}


def verdict_word(levels: Mapping[str, str], kept: int) -> str:
    """``failed`` when a check is at ERROR or no reply is kept, ``warned`` when one is at WARN, else ``passed``."""
    if kept <= 0 or "ERROR" in levels.values():
        return FAILED
    return WARNED if "WARN" in levels.values() else PASSED


def findings_json(outcomes: Mapping[str, Outcome]) -> list[dict[str, Any]]:
    """Every finding of ``outcomes`` (check name -> :class:`~eagle_assets.qc.thresholds.Outcome`) as the JSON
    ``qc_status.json`` records (:class:`QcVerdict` ``findings``)."""
    return [{"check": name, "level": f.level, "figure": f.figure, "value": float(f.value),
             "threshold": float(f.threshold), "comparison": f.comparison}
            for name, outcome in outcomes.items() for f in outcome.findings]


def qc_verdict(status: Mapping[str, Any], partition: str | None = None) -> QcVerdict:
    """The verdict of a ``qc_status.json`` document (a ``qc_shards`` partition's or a chunked dataset's
    ``dataset_qc`` one). ``partition`` names it when the document does not (``partition`` / ``dataset`` key)."""
    levels = {c: status[c] for c in CHECKS if c in status}
    kept = int(status.get("kept", 0))
    return QcVerdict(
        partition=str(status.get("partition") or status.get("dataset") or partition or ""),
        verdict=verdict_word(levels, kept), levels=levels, findings=tuple(status.get("findings", ())),
        rows=int(status.get("rows", 0)), kept=kept, stale="findings" not in status)


def partition_verdict(layout: Layout, key: str) -> QcVerdict | None:
    """The QC verdict of ``qc_shards`` partition ``key`` (a dataset, a chunk or a suite's ``eval-<suite>``) from its
    ``qc_status.json``, as of its latest QC; None when it has none yet (QC never ran there).

    Raises ``OSError`` / ``json.JSONDecodeError`` for an unreadable file (the writer replaces it atomically, so a
    reader never sees half a file)."""
    path = Path(layout.base) / "qc_shards" / safe_name(key) / QC_STATUS_FILE
    if not path.is_file():
        return None
    return qc_verdict(json.loads(path.read_text()), key)


def dataset_verdict(layout: Layout, dataset: str) -> QcVerdict | None:
    """The verdict of a chunked dataset over all its chunks, from ``dataset_qc/<dataset>/qc_status.json``
    (``dataset_job``); None before ``dataset_qc`` has run."""
    path = Path(layout.base) / "dataset_qc" / safe_name(dataset) / QC_STATUS_FILE
    if not path.is_file():
        return None
    return qc_verdict(json.loads(path.read_text()), dataset)


def verdict_table(layout: Layout, keys: list[str]) -> list[dict[str, Any]]:
    """One row per partition of ``keys``: ``partition``, ``verdict`` (``not run`` without QC yet, ``unreadable``
    with the error as its finding when its ``qc_status.json`` cannot be read), ``blocking_check`` ("" when none),
    ``finding``, ``kept``, ``dropped``, ``rows`` (the UI's QC table)."""
    out = []
    for key in keys:
        empty = {"partition": key, "verdict": NOT_RUN, "blocking_check": "", "finding": "", "kept": 0, "dropped": 0,
                 "rows": 0}
        try:
            v = partition_verdict(layout, key)
        except (OSError, ValueError) as exc:  # another partition's file must not fail this one's table
            out.append({**empty, "verdict": "unreadable", "finding": f"{QC_STATUS_FILE}: {exc}"})
            continue
        out.append(empty if v is None else
                   {"partition": key, "verdict": v.verdict, "blocking_check": v.blocking_check or "",
                    "finding": v.finding(), "kept": v.kept, "dropped": v.dropped, "rows": v.rows})
    return out


def dataset_rows_files(layout: Layout, catalog: Catalog, dataset: str) -> list[Path]:
    """``rows.parquet`` of every partition of ``dataset`` (its chunks in order, or the dataset's one partition)."""
    return [Path(layout.base) / "qc_shards" / k / ROWS_FILE for k in catalog.dataset_partition_keys(dataset)]


def dataset_shard_paths(layout: Layout, catalog: Catalog, dataset: str) -> list[Path]:
    """The training shards of ``dataset``: every ``shard-NNNNN.parquet`` of each of its partitions, chunk by chunk.

    Raises:
        FileNotFoundError: a partition has no shards (the message names it and says to materialize it).
    """
    paths = []
    for key in catalog.dataset_partition_keys(dataset):
        found = shard_paths(layout.base / "qc_shards" / key)
        if not found:
            raise FileNotFoundError(f"no QC shards in {layout.base / 'qc_shards' / key}: materialize qc_shards for "
                                    f"partition {key} first")
        paths += found
    return paths


def passing_datasets(layout: Layout, catalog: Catalog) -> tuple[list[str], dict[str, str]]:
    """Datasets whose latest QC passed both blocking checks, and why each other dataset is excluded.

    A dataset that is not chunked passes by its one partition's ``qc_status.json``. A chunked dataset needs QC
    shards of every chunk (each QC'd as the chunk the catalog now names) and passes by the checks over all of its
    chunks' rows (``qc.dataset_checks``: the figures an unchunked run of the dataset would check, so it trains
    exactly when the unchunked dataset would); a single chunk's failed check does not exclude it by itself.
    """
    ok, excluded = [], {}
    for dataset in catalog.dataset_keys:
        why = _exclusion(layout, catalog, dataset)
        if why is None:
            ok.append(dataset)
        else:
            excluded[dataset] = why
    return ok, excluded


def _exclusion(layout: Layout, catalog: Catalog, dataset: str) -> str | None:
    """Why ``dataset`` is not trained on (None: it passed)."""
    spec = catalog.partitions[dataset]
    statuses, missing, stale = {}, [], []
    for key in catalog.dataset_partition_keys(dataset):
        status_file = Path(layout.base) / "qc_shards" / key / QC_STATUS_FILE
        if not status_file.exists():
            missing.append(key)
            continue
        statuses[key] = status = json.loads(status_file.read_text())
        if spec.chunks > 1 and status.get("chunk") != list(catalog.resolve(key)[1:]):
            stale.append(key)
    if missing:
        return (f"no QC shards yet for {missing}: materialize the partition first" if spec.chunks == 1
                else f"no QC shards yet for chunks {missing}: materialize them first")
    if stale:
        return (f"chunks {stale} were QC'd before the dataset was split into {spec.chunks} chunks: materialize them "
                "again")
    if spec.chunks == 1:
        verdict = qc_verdict(statuses[dataset], dataset)
        return None if verdict.verdict != FAILED else f"QC {verdict.text()}; see the check results"
    checks = dataset_checks(dataset_rows_files(layout, catalog, dataset), spec.thresholds)
    if checks.passed:
        return None
    verdict = checks_verdict(dataset, checks.token_structure, checks.response_length, checks.rows, checks.kept)
    return f"QC over its {spec.chunks} chunks (dataset_qc) {verdict.text()}; see the check results"


def checks_verdict(partition: str, token_structure: Outcome, response_length: Outcome, rows: int,
                   kept: int) -> QcVerdict:
    """The verdict of the two blocking checks' outcomes (as :func:`qc_verdict` reads them back from
    ``qc_status.json``)."""
    outcomes = {"token_structure": token_structure, "response_length": response_length}
    return qc_verdict({"partition": partition, **{c: o.level for c, o in outcomes.items()}, "rows": rows,
                       "kept": kept, "findings": findings_json(outcomes)})
