"""``eagle-assets`` command line: run the whole pipeline, print the length report.

    eagle-assets run [--catalog PATH] [--partitions A,B.c03] [--skip-training]
    eagle-assets report [--catalog PATH]

``run`` runs every partition of the catalog (evaluation suites included, as ``eval-<suite>``), then
``training_job`` (with the ``evaluation`` asset: every catalog has one, held-out rows at least, except with
``evaluation: null`` or served features) and prints the evaluation report. ``--partitions`` takes dataset keys
and chunk keys: a chunked dataset's key runs its ``raw_prompts`` over all its chunks in one run (one parse, one
step: ``assets.dataset_runs``), then every one of its chunks through the rest of ``partition_job``, one run each,
then ``dataset_job`` (its checks over all its chunks); a chunk key runs that chunk (``dataset_job`` follows once
all of the dataset's chunks have QC rows).
``run`` executes the Dagster jobs in-process against the persistent instance in ``$DAGSTER_HOME`` (set to the repo
root, where ``dagster.yaml`` lives, when unset), so every run shows in ``dagster dev`` afterwards; it prints the
command that opens that instance in the UI (:func:`ui_command`). Each run's summary (:func:`partition_summary`) is
read from that run's events only, never from files an earlier run left (docs/guide.md, "Reading the summary").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _ensure_dagster_home(catalog_path: Path) -> Path:
    """``$DAGSTER_HOME``, set when unset to the instance of ``catalog_path``: the repo root (where ``dagster.yaml``
    lives) for the default catalog, ``<repo>/dagster_home/<catalog name>/`` (with a copy of ``dagster.yaml``) for any
    other, so two catalogs never share an instance (``definitions.claim_instance``)."""
    if not os.environ.get("DAGSTER_HOME"):
        settings = REPO_ROOT / "dagster.yaml"
        home = REPO_ROOT if settings.exists() else Path.cwd()
        if catalog_path != (REPO_ROOT / "catalogs" / "default.yaml").resolve():
            home = REPO_ROOT / "dagster_home" / catalog_path.stem
            home.mkdir(parents=True, exist_ok=True)
            if settings.exists() and not (home / "dagster.yaml").exists():
                (home / "dagster.yaml").write_text(settings.read_text())
        os.environ["DAGSTER_HOME"] = str(home)
    home = Path(os.environ["DAGSTER_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    return home


def dagster_executable() -> list[str]:
    """The ``dagster`` command of the environment running this CLI: the script beside this interpreter (a venv's
    ``.venv/bin/dagster``, by absolute path, not resolved through the interpreter's symbolic link), else the one on
    ``PATH``, else ``python -m dagster`` with this interpreter."""
    beside = Path(sys.executable).parent / "dagster"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside.absolute())]
    found = shutil.which("dagster")
    return [found] if found else [sys.executable, "-m", "dagster"]


def ui_command(home: Path, catalog_path: Path, storage_root: Path) -> str:
    """The shell command that opens the Dagster UI on this catalog's runs, runnable as printed from any folder:
    ``cd`` into ``DAGSTER_HOME`` (the folder of the instance's ``dagster.yaml``: run from elsewhere, a
    ``dagster.yaml`` in the current folder makes ``dagster dev`` warn that it is not used), the variables the code
    location needs (``DAGSTER_HOME``, ``EAGLE_ASSETS_CATALOG``, ``EAGLE_ASSETS_HOME``: the storage root would
    otherwise be ``./.eagle_assets`` of that folder), the venv's ``dagster`` by absolute path and ``-w`` the
    repository's ``workspace.yaml`` by absolute path. Every path is shell-quoted."""
    q = shlex.quote
    return (f"cd {q(str(home))} && DAGSTER_HOME={q(str(home))} EAGLE_ASSETS_CATALOG={q(str(catalog_path))} "
            f"EAGLE_ASSETS_HOME={q(str(storage_root))} {' '.join(q(part) for part in dagster_executable())} dev "
            f"-w {q(str(REPO_ROOT / 'workspace.yaml'))}")


def _cmd_report(args: argparse.Namespace) -> int:
    from eagle_assets.catalog import default_catalog_path, load_catalog
    from eagle_assets.qc.lengths import format_table, length_report
    from eagle_assets.storage.shards import Layout, default_storage_root

    catalog_path = Path(args.catalog or default_catalog_path()).resolve()
    catalog = load_catalog(catalog_path)
    layout = Layout(default_storage_root(), catalog_path.stem)
    files = [layout.base / "qc_shards" / k / "rows.parquet" for k in catalog.training_partition_keys]
    rows = length_report([f for f in files if f.exists()], short_tokens=catalog.short_tokens())
    if not rows:
        print(f"no QC rows under {layout.base}: run `eagle-assets run --catalog {catalog_path}` first")
        return 1
    print(format_table(rows, spans=args.spans.split(",")))
    return 0


# A check description holds one or more findings, each opening with its level ("WARN: a; ERROR: b"); text before the
# first level is context that belongs to the check as a whole (e.g. "the partition is empty: ...").
_FINDING = re.compile(r"(?:^|;\s+)(WARN|ERROR|OK):\s")


def finding_lines(prefix: str, description: str, level: str) -> list[str]:
    """``description`` as one line per finding, each under its own level: ``{prefix} WARN: ...``,
    ``{prefix} ERROR: ...``; ``level`` is the level of a description (or of text before its first finding) that
    names none. OK findings are not listed."""
    text = " ".join(description.split())
    marks = list(_FINDING.finditer(text))
    if not marks:
        return [f"{prefix} {level}: {text}"] if text else [f"{prefix} {level}"]
    lines = []
    head = text[:marks[0].start()].strip().rstrip(";").strip()
    if head:
        lines.append(f"{prefix} {level}: {head}")
    for i, m in enumerate(marks):
        body = text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)].strip()
        if m.group(1) != "OK":
            lines.append(f"{prefix} {m.group(1)}: {body}")
    return lines


def check_summary_lines(result) -> list[str]:
    """One line per finding of each asset check of a job result that failed or passed with a WARN finding, each
    under its own level: ``  check <asset>.<check> WARN: <figure> = <value> > threshold <t>``. A check with a WARN
    and an ERROR finding gives two lines."""
    import dagster as dg

    lines = []
    for event in result.all_events:
        if event.event_type_value != "ASSET_CHECK_EVALUATION":
            continue
        data = event.asset_check_evaluation_data
        description = data.description or ""
        if data.passed and "WARN" not in description:
            continue
        level = "WARN" if data.passed or data.severity == dg.AssetCheckSeverity.WARN else "ERROR"
        lines += finding_lines(f"  check {data.asset_key.to_user_string()}.{data.check_name}", description, level)
    return lines


def failure_lines(result) -> list[str]:
    """One line per failed step of a job result: the step and its root cause, i.e. a ``dg.Failure``'s description,
    else the message of the innermost exception in the error's cause chain (the exception the asset raised, not
    Dagster's wrapper around it). The steps the run planned and never started because a step before them failed
    are listed once, in run order, as not run (Dagster records no event for them: they are the run's steps to
    execute without a start), so no line below can be read as their result."""
    lines, started = [], set()
    for event in result.all_events:
        if event.event_type_value == "STEP_START":
            started.add(event.step_key)
        if event.event_type_value != "STEP_FAILURE":
            continue
        data = event.step_failure_data
        text = ""
        if data.user_failure_data is not None and data.user_failure_data.description:
            text = data.user_failure_data.description
        elif data.error is not None:
            error = data.error
            while error.cause is not None:
                error = error.cause
            text = f"{error.cls_name}: {error.message.strip()}" if error.cls_name else error.message.strip()
        lines.append(f"  step {event.step_key} FAILED -- {' '.join(text.split())}")
    planned = result.dagster_run.step_keys_to_execute
    if planned is None:  # every step of the job
        planned = [n.name for n in result.job_def.graph.nodes_in_topological_order]
    skipped = [k for k in planned if k not in started]
    if lines and skipped:
        lines.append(f"  not run: {', '.join(skipped)} (a step before them failed)")
    return lines


def _materialized(result, asset: str, key: str) -> dict | None:
    """The metadata (name -> plain value) of the last materialization of ``asset`` partition ``key`` in the run of
    ``result``, or None when the run did not materialize it: what this run did, never a file an earlier run left."""
    found = None
    for event in result.all_events:
        if event.event_type_value != "ASSET_MATERIALIZATION" or event.asset_key is None:
            continue
        if event.asset_key.to_user_string() == asset and event.partition == key:
            found = event.step_materialization_data.materialization.metadata
    return None if found is None else {k: getattr(v, "value", v) for k, v in found.items()}


def _check_metadata(result, asset: str, check: str, key: str) -> dict | None:
    """The metadata (name -> plain value) of check ``asset.check`` on partition ``key`` evaluated in this run."""
    for event in result.all_events:
        if event.event_type_value != "ASSET_CHECK_EVALUATION":
            continue
        data = event.asset_check_evaluation_data
        if (data.asset_key.to_user_string(), data.check_name, data.partition) == (asset, check, key):
            return {k: getattr(v, "value", v) for k, v in data.metadata.items()}
    return None


def _reasons(counts: dict) -> str:
    """``"reason n, ..."``, most frequent first (ties by name); reasons counted 0 times (QC lists every reason) are
    left out."""
    return ", ".join(f"{r} {n}" for r, n in sorted(counts.items(), key=lambda c: (-c[1], c[0])) if n)


def _raw_prompts_line(meta: dict, spec, folder: Path, whole_dataset: bool = False) -> str:
    """What ``raw_prompts`` read and kept, in counts that add up: records read = set aside + usable, and the
    sample (``limit``) drawn from the usable ones; for a chunk, the dataset's counts and the chunk's share
    (``whole_dataset``: chunk 0's materialization of a run over all chunks, said of the dataset)."""
    rows, usable = meta.get("dagster/row_count", 0), meta.get("available_records", 0)
    rejected, read = meta.get("rejected", 0), meta.get("records_read")
    limit = meta.get("sample_limit")
    sampled = min(limit, usable) if limit is not None else usable
    parts = []
    if read is not None:
        parts.append(f"read {read} records")
    if rejected:
        parts.append(f"{rejected} set aside ({_reasons(meta.get('reject_reason_counts') or {})}; "
                     f"see {folder / 'rejects.parquet'})")
    if sampled < usable:
        parts.append(f"{sampled} of the {'other ' if rejected else ''}{usable} usable sampled (limit {limit})")
    else:
        parts.append(f"{usable} usable, all kept")
    if spec.chunk is None:
        return "  raw_prompts: " + "; ".join(parts)
    if whole_dataset:
        return f"  raw_prompts: dataset {spec.dataset}, {spec.chunks} chunks: " + "; ".join(parts)
    where = "" if spec.chunk == 0 else f" (its records set aside are counted in chunk {spec.dataset}.c00)"
    return (f"  raw_prompts: {rows} rows in this chunk of dataset {spec.dataset}{where}; the dataset: "
            + "; ".join(parts))


def _generations_line(meta: dict) -> tuple[str, bool]:
    """What ``generations`` sent in this run, and whether it had nothing to send and asked no server."""
    sent, contacted = meta.get("requests_sent", 0), meta.get("server_contacted", True)
    done_before, made, failed = meta.get("skipped_done", 0), meta.get("succeeded", 0), meta.get("failed", 0)
    if not contacted and not sent:
        return (f"  generations: nothing pending ({done_before} replies already generated by earlier runs); "
                "server not contacted"), True
    servers = ", ".join(meta.get("servers") or []) or "the server"
    turns = f", every assistant turn of {meta['conversations']} conversations" if "conversations" in meta else ""
    text = f"  generations: {made} replies generated in this run ({sent} requests to {servers}{turns})"
    if done_before:
        text += f", {done_before} kept from earlier runs"
    if failed:
        text += f", {failed} requests failed (failures.parquet)"
    return text, False


def _qc_counts(result, key: str) -> tuple[int, int, dict] | None:
    """``(generated, kept, drop reasons)`` of ``qc_shards`` partition ``key`` in this run: from its
    materialization, else from its ``token_structure`` check's figures (a QC step that failed after checking);
    None when QC did not run in this run."""
    meta = _materialized(result, "qc_shards", key)
    if meta is not None and "generated" in meta and "kept" in meta:
        return meta["generated"], meta["kept"], meta.get("drop_reason_counts") or {}
    check = _check_metadata(result, "qc_shards", "token_structure", key)
    if check is None or "count" not in check:
        return None
    n = int(check["count"])
    reasons = check.get("drop_reasons") or {}
    return n, n - sum(reasons.values()), reasons


def partition_summary(result, layout, spec, key: str, seconds: float) -> tuple[str, list[str]]:
    """The status line of partition ``key``'s run and the lines under it, from that run's events only (a stage
    that did not run in this run has no line; nothing is read from files an earlier run left).

    Status: ``FAILED``, ``ok`` or ``ok with N warnings`` (N: the WARN findings listed below), with notes in brackets:
    ``nothing pending; server not contacted`` when generations sent nothing, ``QC kept K of N replies`` when QC
    dropped some. Lines: each failed step with its cause, the steps not run, what raw_prompts read and kept,
    what tokenized_prompts refused, what generations sent, what QC kept and dropped by reason, one line per check
    finding under its own level."""
    from eagle_assets.storage.shards import safe_name

    lines: list[str] = []
    raw = _materialized(result, "raw_prompts", key)
    if raw is not None:
        lines.append(_raw_prompts_line(raw, spec, layout.base / "raw_prompts" / safe_name(key)))
    tok = _materialized(result, "tokenized_prompts", key)
    if tok is not None:
        refused = tok.get("rejected", 0)
        text = f"  tokenized_prompts: {tok.get('dagster/row_count', 0)} prompts rendered"
        if refused:
            text += (f"; {refused} refused ({_reasons(tok.get('reject_reason_counts') or {})}; see "
                     f"{layout.base / 'tokenized_prompts' / safe_name(key) / 'rejects.parquet'})")
        lines.append(text)
    notes = []
    gen = _materialized(result, "generations", key)
    if gen is not None:
        text, idle = _generations_line(gen)
        lines.append(text)
        if idle:
            notes.append("nothing pending; server not contacted")
    qc = _qc_counts(result, key)
    if qc is not None:
        generated, kept, reasons = qc
        if generated - kept:
            notes.append(f"QC kept {kept} of {generated} replies")
            lines.append(f"  qc_shards: kept {kept} of {generated} replies, dropped {generated - kept} "
                         f"({_reasons(reasons)}; see {layout.base / 'qc_shards' / safe_name(key) / 'rows.parquet'}, "
                         "docs/token-structure.md names each reason)")
        else:
            lines.append(f"  qc_shards: kept all {generated} replies")
    checks = check_summary_lines(result)
    lines = failure_lines(result) + lines + checks
    status = "FAILED" if not result.success else _ok(checks)
    status += f" ({'; '.join(notes)})" if notes else ""
    return f"partition {key}: {status} in {seconds:.1f} s (run {result.run_id})", lines


def _ok(check_lines: list[str]) -> str:
    """The status of a run that succeeded: ``ok``, ``ok with N warnings`` for the WARN findings among
    ``check_lines``, and ``ok with N ERROR findings`` for ERROR findings of checks that block nothing (an evaluation
    gate), e.g. ``ok with 1 ERROR finding and 2 warnings``."""
    errors = sum(1 for line in check_lines if " ERROR: " in line)
    warnings = sum(1 for line in check_lines if " WARN: " in line)
    parts = ([f"{errors} ERROR finding{'' if errors == 1 else 's'}"] if errors else []) \
        + ([f"{warnings} warning{'' if warnings == 1 else 's'}"] if warnings else [])
    return "ok with " + " and ".join(parts) if parts else "ok"


def mix_line(result) -> str | None:
    """The rows each partition gave the training mix (of its training-split rows) in a training run, or None."""
    for event in result.all_events:
        if event.event_type_value == "ASSET_MATERIALIZATION" and event.asset_key is not None \
                and event.asset_key.to_user_string() == "training_mix":
            meta = event.step_materialization_data.materialization.metadata.get("rows_by_partition")
            if meta is None:
                return None
            parts = [f"{p} {v['mix']} of {v['candidates']}" for p, v in meta.value.items()]
            return "  training_mix: rows in the mix of each partition's training-split rows: " + ", ".join(parts)
    return None


def acceptance_line(result) -> str | None:
    """The ``acceptance_length`` check's description (tau with its CI, per partition) of a training run, or None."""
    for event in result.all_events:
        if event.event_type_value == "ASSET_CHECK_EVALUATION":
            data = event.asset_check_evaluation_data
            if data.check_name == "acceptance_length":
                return f"  acceptance_length -- {data.description}"
    return None


@contextlib.contextmanager
def _dagster_output_to(log_path: Path):
    """Dagster's run output (its console logger writes every event, DEBUG included, to ``sys.stderr``) goes to
    ``log_path`` (appended) for the block; the command's own lines stay on stdout."""
    with open(log_path, "a", encoding="utf-8") as fh, contextlib.redirect_stderr(fh):
        yield


@contextlib.contextmanager
def _partition_definitions(defs, catalog_path: Path, catalog, prelaunch: bool = False):
    """The Definitions the partition runs use: ``defs`` itself, or, when the catalog launches its server (no
    ``server.url``) and the runs execute in this process, Definitions whose server resource launches through one
    shared launcher, so every partition of this command talks to one server (loaded once, on first use) instead of
    each run starting and stopping its own. The server is stopped on exit, before the training job, which on a GPU
    host needs the memory (and launches its own in aux-capture mode when ``training.features`` is served).
    ``prelaunch``: start launching it at once, in a background thread, instead of at the first generations step."""
    from eagle_assets.assets.k8s import executor_kind
    from eagle_assets.assets.server_resource import SGLangServerResource, shared_launcher
    from eagle_assets.definitions import build_definitions

    server = catalog.server
    if server.urls or executor_kind(None) != "in_process":
        yield defs
        return
    with shared_launcher(launch=server.launch, api_key_env=server.api_key_env, extra_args=list(server.extra_args),
                         device=server.device, python=server.python) as key:
        shared = SGLangServerResource(launch=server.launch, api_key_env=server.api_key_env,
                                      extra_args=list(server.extra_args), shared=key,
                                      max_reply_bytes=server.max_reply_bytes)
        if prelaunch:
            # Start the server now, while the first partition reads and tokenizes its prompts; its generations step
            # then finds it ready (or waits on the launcher's lock). A launch that fails here is retried by that
            # step, which reports the error.
            try:
                model_dir = str(defs.resources["target"].resolve())
            except (OSError, ValueError):
                pass  # a missing model directory: the generations step reports it
            else:
                threading.Thread(target=_quietly, args=(shared.base_urls, model_dir), daemon=True,
                                 name="prelaunch-server").start()
        yield build_definitions(catalog_path, storage_root=defs.resources["settings"].storage_root, sglang=shared)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the step that needs the server launches it again and raises with the log
        pass


def _first_run(layout, keys: list[str]) -> bool:
    """Whether some of ``keys`` has no generations yet (so the run will need a server); a partition that has some
    is resumed and launches one on demand, as does any run this says False for."""
    from eagle_assets.storage.shards import safe_name

    return any(not any((layout.base / "generations" / safe_name(k)).glob("*.parquet")) for k in keys)


def selected_partition_keys(catalog, selection: str | None) -> list[str]:
    """The partition keys ``--partitions`` names, in the order given (duplicates once): a chunked dataset's key
    stands for all its chunks; None or empty = every partition of the catalog. Raises ``CatalogError`` for a key
    that is neither a dataset nor a chunk of one (``Catalog.resolve`` says which keys exist)."""
    if not selection:
        return list(catalog.partition_keys)
    keys: list[str] = []
    for item in (k.strip() for k in selection.split(",")):
        if not item:
            continue
        expanded = catalog.dataset_partition_keys(item) if item in catalog.partitions else [item]
        for key in expanded:
            catalog.resolve(key)
            if key not in keys:
                keys.append(key)
    return keys


def chunks_without_qc(catalog, layout, keys: list[str]) -> dict[str, list[str]]:
    """For each chunked dataset with a chunk among ``keys``: its chunk keys that have no QC rows yet
    (``qc.status.dataset_rows_files``); an empty list = ``dataset_job`` can check it now."""
    from eagle_assets.qc.status import dataset_rows_files

    touched = {catalog.resolve(k)[0] for k in keys}
    return {d: [f.parent.name for f in dataset_rows_files(layout, catalog, d) if not f.exists()]
            for d in catalog.chunked_datasets if d in touched}


def _cmd_run(args: argparse.Namespace) -> int:
    from eagle_assets.catalog import CatalogError, default_catalog_path

    catalog_path = Path(args.catalog or default_catalog_path()).resolve()
    home = _ensure_dagster_home(catalog_path)
    if args.catalog:
        os.environ["EAGLE_ASSETS_CATALOG"] = str(catalog_path)
    import dagster as dg

    from eagle_assets.storage.shards import Layout

    try:  # importing definitions loads $EAGLE_ASSETS_CATALOG (its module-level defs) too
        from eagle_assets.definitions import build_definitions, claim_instance

        defs = build_definitions(catalog_path)
        claim_instance(catalog_path)
    except CatalogError as exc:  # the message names the file, the field and what to do: no traceback needed
        print(exc)
        return 2
    settings = defs.resources["settings"]
    catalog = settings.catalog()
    try:
        keys = selected_partition_keys(catalog, args.partitions)
    except CatalogError as exc:
        print(f"{exc}\n(--partitions takes dataset keys {catalog.dataset_keys} or chunk keys such as "
              f"<dataset>.c00; the catalog {catalog_path} has {len(catalog.partition_keys)} partitions)")
        return 2
    for line in catalog.warnings():
        print(f"catalog warning: {line}", flush=True)
    for key in keys:  # a missing source file is a catalog error, found before anything runs, like a typo
        try:
            catalog.partition(key).resolved_sources()
        except CatalogError as exc:
            print(exc)
            return 2
    if catalog.target.model == "demo":
        from eagle_assets.demo.shipped import DemoTargetStale, demo_target

        try:
            print(f"embedded target model: {demo_target()}", flush=True)
        except DemoTargetStale as exc:
            print(exc, file=sys.stderr)
            return 1
    instance = dg.DagsterInstance.get()
    layout = Layout(Path(settings.storage_root), catalog_path.stem)
    log_path = layout.base / "run_logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"DAGSTER_HOME={home}; catalog {catalog_path}; storage {settings.storage_root}\n"
          f"Dagster's output (every event of every run): {log_path}\n"
          f"see the runs in the UI (http://127.0.0.1:3000; docs/guide.md#opening-the-ui explains its warnings):\n"
          f"  {ui_command(home, catalog_path, Path(settings.storage_root))}", flush=True)
    with _dagster_output_to(log_path):
        return _run_jobs(args, defs, instance, catalog, catalog_path, layout, keys)


def _run_jobs(args: argparse.Namespace, defs, instance, catalog, catalog_path: Path, layout, keys: list[str]) -> int:
    """The runs of ``eagle-assets run`` (see the module doc), one summary block per run on stdout."""
    import dagster as dg

    from eagle_assets.assets.dataset_runs import RAW_PROMPTS, run_raw_prompts_over_chunks
    from eagle_assets.definitions import DATASET_JOB, PARTITION_JOB, TRAINING_JOB

    failed = []
    refreshed = False  # whether a run of this command wrote the length report (else the file is an earlier run's)
    t_all = time.monotonic()
    with _partition_definitions(defs, catalog_path, catalog, prelaunch=_first_run(layout, keys)) as partition_defs:
        job = partition_defs.resolve_job_def(PARTITION_JOB)
        # a dataset run whole: its raw_prompts in one run over its chunk keys (assets.dataset_runs), so the chunks'
        # runs below start from their rows; where that run fails, each chunk's run tries raw_prompts itself
        prepared: set[str] = set()
        without_raw = [k for k in job.asset_layer.selected_asset_keys if k != RAW_PROMPTS]
        for dataset in catalog.chunked_datasets:
            chunks = catalog.dataset_partition_keys(dataset)
            if not set(chunks) <= set(keys):
                continue
            t0 = time.monotonic()
            result = run_raw_prompts_over_chunks(job, instance, catalog, chunks)
            checks = check_summary_lines(result)  # e.g. prompts_available naming an empty chunk
            status = _ok(checks) if result.success else "FAILED (each chunk's run tries it again and reports why)"
            print(f"dataset {dataset}: raw_prompts of its {len(chunks)} chunks in one run: {status} in "
                  f"{time.monotonic() - t0:.1f} s (run {result.run_id})", flush=True)
            first = _materialized(result, "raw_prompts", chunks[0])  # chunk 0 records the dataset's counts
            head = [] if first is None else [_raw_prompts_line(
                first, catalog.partition(chunks[0]), layout.base / "raw_prompts" / chunks[0], whole_dataset=True)]
            for line in failure_lines(result) + head + checks:
                print(line, flush=True)
            if result.success:
                prepared.update(chunks)
        for key in keys:
            t0 = time.monotonic()
            result = job.execute_in_process(
                partition_key=key, instance=instance, raise_on_error=False,
                asset_selection=without_raw if key in prepared else None,
            )
            status, lines = partition_summary(result, layout, catalog.partition(key), key, time.monotonic() - t0)
            for line in [status, *lines]:
                print(line, flush=True)
            refreshed |= bool(result.asset_materializations_for_node("length_report"))
            if not result.success:
                failed.append(key)
    waiting = chunks_without_qc(catalog, layout, keys)
    for dataset, absent in waiting.items():
        if not absent:
            continue
        print(f"dataset {dataset}: dataset_qc not run yet, {len(absent)} of {catalog.partitions[dataset].chunks} "
              f"chunks have no QC rows ({absent[:5]}{' ...' if len(absent) > 5 else ''}); its length report line "
              f"covers the chunks done so far. Run them (--partitions {dataset}) to check the whole dataset.",
              flush=True)
    for dataset in (d for d, absent in waiting.items() if not absent):
        t0 = time.monotonic()
        result = defs.resolve_job_def(DATASET_JOB).execute_in_process(
            partition_key=dataset, instance=instance, raise_on_error=False)
        checks = check_summary_lines(result)
        status = _ok(checks) if result.success else "FAILED"
        print(f"dataset {dataset} ({catalog.partitions[dataset].chunks} chunks): dataset_job {status} in "
              f"{time.monotonic() - t0:.1f} s (run {result.run_id})", flush=True)
        for line in failure_lines(result) + checks:
            print(line, flush=True)
        if not result.success:
            failed.append(dataset)
    report = layout.base / "length_report" / "report.md"
    if report.exists() and refreshed:
        print(f"\nlength report: {report}\n{report.read_text()}")
    elif report.exists():  # no run of this command reached it: its table is an earlier run's, not this one's
        print(f"\nlength report: not refreshed (no partition of this command reached it); the last one is {report}")
    passed = [k for k in keys if k not in failed]
    if not args.skip_training and keys and not passed:
        print(f"training: not attempted: no partition passed ({len(failed)} failed; their reasons are above)",
              flush=True)
    elif not args.skip_training:
        t0 = time.monotonic()
        result = defs.resolve_job_def(TRAINING_JOB).execute_in_process(instance=instance, raise_on_error=False)
        # the drafter is written before its acceptance_length check runs: an ERROR there is a failed training
        # for whoever reads this summary, though the run itself succeeded
        useless = any(e.check_name == "acceptance_length" and not e.passed
                      and e.severity == dg.AssetCheckSeverity.ERROR for e in result.get_asset_check_evaluations())
        warned = check_summary_lines(result)
        # a check that blocks nothing can still find an ERROR (an evaluation gate): "ok" alone would hide it
        status = _ok(warned) if result.success and not useless else \
            "FAILED (the drafter barely drafts: acceptance_length ERROR)" if result.success else "FAILED"
        print(f"training: {status} in {time.monotonic() - t0:.1f} s (run {result.run_id})", flush=True)
        tau = acceptance_line(result)
        mixed = mix_line(result)
        for line in failure_lines(result) + ([mixed] if mixed else []) \
                + ([tau] if tau and not any("acceptance_length" in w for w in warned) else []) + warned:
            print(line, flush=True)
        ckpt = layout.base / "drafter_checkpoint" / "checkpoint"
        if useless:
            print("  train longer or faster: training.train_tokens, epochs, lr and batch_tokens (catalogs/default.yaml "
                  "has the embedded target's values; drafter/training/recipe.py explains them and gives values for "
                  "8B- and 1T-class targets), and hold out enough rows for a stable figure (training.holdout_rows)",
                  flush=True)
            failed.append("training")
        elif result.success:
            from eagle_assets.drafter.family import family_of_checkpoint

            target_path = defs.resources["target"].resolve()
            flags = family_of_checkpoint(ckpt).serve_flags(ckpt, catalog.training.acceptance_k)
            print(f"drafter checkpoint: {ckpt}\n  serve with: python -m sglang.launch_server --model-path "
                  f"{target_path} {' '.join(flags)}")
            report = layout.base / "evaluation" / "report.md"
            if catalog.evaluation is not None and report.exists():
                import json

                from eagle_assets.drafter.evaluation.suites import stands_on_lines

                # what the figures stand on first: a suite whose QC failed is measured on the few replies QC kept
                doc = json.loads((report.parent / "report.json").read_text())
                print(f"\nevaluation (docs/evaluation.md): {report.parent}", flush=True)
                for line in stands_on_lines(doc):
                    print(f"  {line}", flush=True)
                print(report.read_text(), flush=True)
            compared = layout.base / "drafter_comparison" / "report.md"
            if catalog.training.compare and compared.exists():
                print(f"drafters side by side (training.compare, docs/drafters.md): {compared.parent}\n"
                      f"{compared.read_text()}", flush=True)
        else:
            failed.append("training")
    print(f"total {time.monotonic() - t_all:.1f} s")
    if failed:
        print(f"failed: {failed}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eagle-assets`` command; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="eagle-assets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="every partition to QC shards, then the draft vocab and the drafter")
    p_run.add_argument("--catalog", help="catalog YAML (default $EAGLE_ASSETS_CATALOG or catalogs/default.yaml)")
    p_run.add_argument("--partitions", help="comma-separated dataset keys (a chunked one: all its chunks) or chunk "
                       "keys <dataset>.cNN (default: all)")
    p_run.add_argument("--skip-training", action="store_true")
    p_run.set_defaults(fn=_cmd_run)
    p_rep = sub.add_parser("report", help="print the length report of a catalog's QC shards")
    p_rep.add_argument("--catalog")
    p_rep.add_argument("--spans", default="total,reasoning,answer")
    p_rep.set_defaults(fn=_cmd_report)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
