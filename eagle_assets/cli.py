"""``eagle-assets`` command line: run the whole pipeline, print the length report.

    eagle-assets run [--catalog PATH] [--partitions A,B.c03] [--skip-training]
    eagle-assets report [--catalog PATH]

``run`` runs every partition of the catalog (evaluation suites included, as ``eval-<suite>``), then
``training_job`` (with the ``evaluation`` asset when the catalog has an evaluation section) and prints the
evaluation report. ``--partitions`` takes dataset keys and chunk keys: a chunked dataset's key runs its
``raw_prompts`` over all its chunks in one run (one parse, one step: ``assets.dataset_runs``), then every one of
its chunks through the rest of ``partition_job``, one run each, then ``dataset_job`` (its checks over all its
chunks); a chunk key runs that chunk (``dataset_job`` follows once all of the dataset's chunks have QC rows).
``run`` executes the Dagster jobs in-process against the persistent instance in ``$DAGSTER_HOME`` (set to the repo
root, where ``dagster.yaml`` lives, when unset), so every run shows in ``dagster dev`` afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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


def check_summary_lines(result) -> list[str]:
    """One line per asset check of a job result that failed or passed with a WARN finding: name, level, figures."""
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
        lines.append(f"  check {data.asset_key.to_user_string()}.{data.check_name} {level} -- {description}")
    return lines


def failure_lines(result) -> list[str]:
    """One line per failed step of a job result: the step and its root cause, i.e. a ``dg.Failure``'s description,
    else the message of the innermost exception in the error's cause chain (the exception the asset raised, not
    Dagster's wrapper around it). Steps skipped because an upstream step failed are not listed."""
    lines = []
    for event in result.all_events:
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
    return lines


def reject_lines(layout, key: str) -> list[str]:
    """What the stages of partition ``key`` set aside: records ``raw_prompts`` rejected, prompts
    ``tokenized_prompts`` refused and replies ``qc_shards`` dropped, by reason, with the file that names each one
    (nothing when none)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from eagle_assets.storage.shards import safe_name

    lines = []
    for stage in ("raw_prompts", "tokenized_prompts"):
        folder = layout.base / stage / safe_name(key)
        rejects, prompts = folder / "rejects.parquet", folder / "prompts.parquet"
        if not rejects.exists():
            continue
        reasons = pq.read_table(rejects, columns=["reason"]).column("reason")
        if not len(reasons):
            continue
        kept = pq.read_metadata(prompts).num_rows if prompts.exists() else 0
        lines.append(f"  {stage}: {len(reasons)} of {len(reasons) + kept} rejected ({_by_reason(reasons)}); "
                     f"see {rejects}")
    qc_rows = layout.base / "qc_shards" / safe_name(key) / "rows.parquet"
    if qc_rows.exists():  # replies qc_shards dropped (the token_structure check's figures, as counts)
        table = pq.read_table(qc_rows, columns=["kept", "drop_reason"])
        dropped = table.filter(pc.invert(table.column("kept"))).column("drop_reason")
        if len(dropped):
            lines.append(f"  qc_shards: {len(dropped)} of {table.num_rows} replies dropped ({_by_reason(dropped)}); "
                         f"see {qc_rows} (docs/token-structure.md names each reason)")
    return lines


def _by_reason(reasons) -> str:
    """``"reason n, ..."`` of a string column, most frequent first (counted by Arrow, not row by row)."""
    import pyarrow.compute as pc

    counts = sorted(pc.value_counts(reasons).to_pylist(), key=lambda c: -c["counts"])
    return ", ".join(f"{c['values']} {c['counts']}" for c in counts)


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
          f"see the runs in the UI: DAGSTER_HOME={home} EAGLE_ASSETS_CATALOG={catalog_path} dagster dev", flush=True)
    with _dagster_output_to(log_path):
        return _run_jobs(args, defs, instance, catalog, catalog_path, layout, keys)


def _run_jobs(args: argparse.Namespace, defs, instance, catalog, catalog_path: Path, layout, keys: list[str]) -> int:
    """The runs of ``eagle-assets run`` (see the module doc), one summary block per run on stdout."""
    import dagster as dg

    from eagle_assets.assets.dataset_runs import RAW_PROMPTS, run_raw_prompts_over_chunks
    from eagle_assets.definitions import DATASET_JOB, PARTITION_JOB, TRAINING_JOB

    failed = []
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
            status = "ok" if result.success else "FAILED (each chunk's run tries it again and reports why)"
            print(f"dataset {dataset}: raw_prompts of its {len(chunks)} chunks in one run: {status} in "
                  f"{time.monotonic() - t0:.1f} s (run {result.run_id})", flush=True)
            for line in check_summary_lines(result):  # e.g. prompts_available naming an empty chunk
                print(line, flush=True)
            if result.success:
                prepared.update(chunks)
        for key in keys:
            t0 = time.monotonic()
            result = job.execute_in_process(
                partition_key=key, instance=instance, raise_on_error=False,
                asset_selection=without_raw if key in prepared else None,
            )
            status = "ok" if result.success else "FAILED"
            print(f"partition {key}: {status} in {time.monotonic() - t0:.1f} s (run {result.run_id})", flush=True)
            for line in failure_lines(result) + check_summary_lines(result) + reject_lines(layout, key):
                print(line, flush=True)
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
        status = "ok" if result.success else "FAILED"
        print(f"dataset {dataset} ({catalog.partitions[dataset].chunks} chunks): dataset_job {status} in "
              f"{time.monotonic() - t0:.1f} s (run {result.run_id})", flush=True)
        for line in failure_lines(result) + check_summary_lines(result):
            print(line, flush=True)
        if not result.success:
            failed.append(dataset)
    report = layout.base / "length_report" / "report.md"
    if report.exists():
        print(f"\nlength report: {report}\n{report.read_text()}")
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
        status = "ok" if result.success and not useless else \
            "FAILED (the drafter barely drafts: acceptance_length ERROR)" if result.success else "FAILED"
        print(f"training: {status} in {time.monotonic() - t0:.1f} s (run {result.run_id})", flush=True)
        tau = acceptance_line(result)
        warned = check_summary_lines(result)
        for line in failure_lines(result) + ([tau] if tau and not any("acceptance_length" in w for w in warned)
                                             else []) + warned:
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
                print(f"\nevaluation (docs/evaluation.md): {report.parent}\n{report.read_text()}", flush=True)
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
