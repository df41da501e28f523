"""The drafter training command: the built-in trainer as a process of its own, one or N of them under ``torchrun``.

::

    torchrun --nproc_per_node 2 -m eagle_assets.drafter.training.command \\
        --target /models/Qwen3-8B --inputs ./train-inputs --out ./drafter --state-dir ./train_state
    python -m eagle_assets.drafter.training.command --target DIR --rows qc/shard-00000.parquet ... \\
        --draft-vocab .eagle_assets/default/draft_vocab --config train.json --out ./drafter

Inputs, either a prepared training-input directory (``--inputs``, written by :func:`write_training_inputs`; what
the ``drafter_checkpoint`` asset hands its torchrun launch) or the pieces one by one (each flag overrides the
directory's file):

- ``train.parquet`` / ``--rows PATH ...``: Parquet files with ``input_ids`` (list of int32) and ``loss_mask``
  (list of int8) columns -- QC shards as they are, or the rows the training mix chose; rows in file order.
- ``validation.parquet`` / ``--validation-rows PATH ...``: the same, never trained on (learning curve, early stop).
- ``draft_vocab/`` / ``--draft-vocab DIR``: ``d2t.npy``, ``t2d.npy`` (and ``token_counts.npy``), as the
  ``draft_vocab`` asset writes them.
- ``config.json`` / ``--config FILE``: :class:`~eagle_assets.drafter.recipe.TrainConfig` fields as JSON.
- ``features.json`` / ``--features FILE`` (optional): the catalog's ``training.features``
  (:class:`~eagle_assets.catalog.FeaturesSpec` as JSON, its ``url`` resolved); absent = ``local`` (every rank loads
  the target). With ``served`` no rank loads the target: each fetches from the server only the features of the
  rows it trains on (``ServedFeatures.admit``), and rank 0 those of the validation rows.

Every rank reads the same inputs and joins the job (:func:`~eagle_assets.drafter.distributed.from_environment`:
gloo on CPU); rank 0 logs, writes the training state, exports the checkpoint with its ``training_metrics.json`` to
``--out``. Launched by Dagster Pipes (``PipesSubprocessClient``; the ``DAGSTER_PIPES_*`` variables are set), rank 0
sends its log lines to the run (step lines at most every ``--log-every-s`` seconds) and reports the training
summary as a custom message; without Pipes it prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

TRAIN_FILE, VALIDATION_FILE = "train.parquet", "validation.parquet"
CONFIG_FILE, VOCAB_DIR, FEATURES_FILE = "config.json", "draft_vocab", "features.json"
VOCAB_FILES = ("d2t.npy", "t2d.npy", "token_counts.npy")
ROW_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])

Row = tuple[np.ndarray, np.ndarray]


class InputError(ValueError):
    """A training input is missing or malformed (the message names the file and what to do)."""


def write_training_inputs(path: str | Path, rows: Sequence[Row], validation: Sequence[Row], config: Any,
                          vocab_dir: str | Path, features: Any = None) -> Path:
    """Write a training-input directory for :func:`main`.

    Args:
        path: the directory (created; its files are replaced).
        rows / validation: ``(input_ids int32 [T], loss_mask int8 [T])`` in training order.
        config: a :class:`~eagle_assets.drafter.recipe.TrainConfig`.
        vocab_dir: holds ``d2t.npy``, ``t2d.npy`` (and ``token_counts.npy``); copied in.
        features: the resolved ``catalog.FeaturesSpec`` (written as ``features.json``); None or ``local`` = none
            written (and a stale one removed).
    Every file is written atomically (temp file + rename): the training command reads them in other processes.
    Raises:
        SymlinkRefusedError: ``path`` is a symbolic link (a stale file in it is deleted: it would be the link
            target's).
    """
    from eagle_assets.storage.guard import refuse_symlink
    from eagle_assets.storage.shards import write_json_atomic, write_npy_atomic, write_parquet_atomic

    out = refuse_symlink(Path(path))
    (out / VOCAB_DIR).mkdir(parents=True, exist_ok=True)
    for name, part in ((TRAIN_FILE, rows), (VALIDATION_FILE, validation)):
        table = pa.Table.from_pylist([{"input_ids": np.asarray(i).tolist(), "loss_mask": np.asarray(m).tolist()}
                                      for i, m in part], schema=ROW_SCHEMA)
        write_parquet_atomic(table, out / name)
    write_json_atomic(asdict(config), out / CONFIG_FILE)
    if features is not None and features.source != "local":
        write_json_atomic(features.model_dump(mode="json"), out / FEATURES_FILE)
    else:
        (out / FEATURES_FILE).unlink(missing_ok=True)
    write_npy_atomic({out / VOCAB_DIR / name: np.load(Path(vocab_dir) / name) for name in VOCAB_FILES
                      if (Path(vocab_dir) / name).exists()})
    return out


def read_rows(paths: Sequence[str | Path]) -> list[Row]:
    """``(input_ids int32 [T], loss_mask int8 [T])`` of every row of ``paths``, in order.

    Raises:
        InputError: a file is missing or lacks the ``input_ids`` / ``loss_mask`` columns.
    """
    rows: list[Row] = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise InputError(f"row file {p} does not exist; pass Parquet files with input_ids and loss_mask columns")
        names = pq.read_schema(p).names
        missing = [c for c in ("input_ids", "loss_mask") if c not in names]
        if missing:
            raise InputError(f"{p} has no {missing} column(s) (it has {names}); pass QC shards or a file written by "
                             "write_training_inputs")
        t = pq.read_table(p, columns=["input_ids", "loss_mask"])
        rows += [(np.asarray(i, dtype=np.int32), np.asarray(m, dtype=np.int8))
                 for i, m in zip(t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist())]
    return rows


def read_config(path: str | Path):
    """The :class:`TrainConfig` of a JSON file of its fields (unknown fields raise :class:`InputError`)."""
    from eagle_assets.drafter.training.recipe import TrainConfig

    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"training config {path} is unreadable ({exc}); pass a JSON object of TrainConfig "
                         "fields") from exc
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InputError(f"training config {path} has unknown fields {unknown}; TrainConfig has {sorted(known)}")
    if raw.get("aux_layer_ids") is not None:
        raw["aux_layer_ids"] = tuple(raw["aux_layer_ids"])
    return TrainConfig(**raw)


def read_draft_vocab(path: str | Path):
    """The :class:`~eagle_assets.drafter.vocab.DraftVocab` of a directory of ``d2t.npy``/``t2d.npy``."""
    from eagle_assets.drafter.data.vocab import draft_vocab_from_arrays

    d = Path(path)
    if not (d / "d2t.npy").is_file() or not (d / "t2d.npy").is_file():
        raise InputError(f"{d} has no d2t.npy / t2d.npy; pass the draft_vocab asset's directory")
    counts = np.load(d / "token_counts.npy") if (d / "token_counts.npy").is_file() else None
    return draft_vocab_from_arrays(np.load(d / "d2t.npy"), np.load(d / "t2d.npy"), counts)


def read_features(path: str | Path):
    """The ``catalog.FeaturesSpec`` of a JSON file (:func:`write_training_inputs`).

    Raises:
        InputError: unreadable, or not a valid ``training.features`` object.
    """
    from pydantic import ValidationError

    from eagle_assets.catalog import FeaturesSpec

    try:
        return FeaturesSpec.model_validate(json.loads(Path(path).read_text()))
    except (OSError, ValueError, ValidationError) as exc:
        raise InputError(f"features file {path} is unusable ({exc}); pass a JSON object of training.features "
                         "fields") from exc


def train_result_from_dict(raw: dict[str, Any]):
    """A :class:`~eagle_assets.drafter.train.TrainResult` read back from its ``training_metrics.json``
    (``TrainResult.to_dict``); its ``checkpoint`` report is re-validated from the checkpoint directory by the
    checkpoint's family, and a block drafter's config is read back from its export."""
    from eagle_assets.drafter.eagle3.model import DrafterConfig
    from eagle_assets.drafter.evaluation.acceptance import AcceptanceResult
    from eagle_assets.drafter.family import family_of_checkpoint
    from eagle_assets.drafter.training.learning_curve import CurvePoint, StepMetrics
    from eagle_assets.drafter.training.loop import TrainResult
    from eagle_assets.drafter.training.recipe import StepPlan, TrainConfig

    config = dict(raw["config"])
    if config.get("aux_layer_ids") is not None:
        config["aux_layer_ids"] = tuple(config["aux_layer_ids"])
    ckpt = Path(raw["checkpoint_dir"])
    family = family_of_checkpoint(ckpt)
    if family.name == "eagle3":
        dconf = dict(raw["drafter_config"])
        dconf["aux_capture_ids"] = tuple(dconf["aux_capture_ids"])
        drafter_config = DrafterConfig(**dconf)
    else:  # the export's config.json holds every field of a block drafter's config
        drafter_config = family.load(ckpt)[0].config
    plan = {k: v for k, v in (raw.get("plan") or {}).items() if k != "epochs"}
    acceptance = raw.get("acceptance")
    if acceptance is not None:
        names = {f.name for f in fields(AcceptanceResult)}
        acceptance = AcceptanceResult(**{k: v for k, v in acceptance.items() if k in names})
    return TrainResult(
        checkpoint_dir=ckpt, checkpoint=family.validate(ckpt),
        steps=[StepMetrics(**s) for s in raw["steps"]], epochs=raw["epochs"], rows_used=raw["rows_used"],
        rows_skipped=raw["rows_skipped"], skip_reasons=raw["skip_reasons"], rows_truncated=raw["rows_truncated"],
        tokens_per_epoch=raw["tokens_per_epoch"], out_of_draft_positions=raw["out_of_draft_positions"],
        feature_seconds=raw["feature_seconds"], train_seconds=raw["train_seconds"], tokens_per_s=raw["tokens_per_s"],
        aux_capture_ids=raw["aux_capture_ids"], drafter_config=drafter_config, config=TrainConfig(**config),
        plan=StepPlan(**plan) if plan else None, curve=[CurvePoint(**p) for p in raw["curve"]],
        best_step=raw["best_step"], stopped_early=raw["stopped_early"], validation_rows=raw["validation_rows"],
        eval_seconds=raw["eval_seconds"], acceptance=acceptance, notes=raw["notes"],
        resumed_from_step=raw["resumed_from_step"], state_dir=Path(raw["state_dir"]) if raw["state_dir"] else None,
        state_seconds=raw["state_seconds"],
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_assets.drafter.training.command",
                                description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="local HF directory of the target model")
    p.add_argument("--inputs", help="a training-input directory (train.parquet, validation.parquet, config.json, "
                   "draft_vocab/)")
    p.add_argument("--rows", nargs="+", help="Parquet files of training rows (input_ids, loss_mask)")
    p.add_argument("--validation-rows", nargs="*", help="Parquet files of validation rows")
    p.add_argument("--draft-vocab", help="directory with d2t.npy and t2d.npy")
    p.add_argument("--config", help="JSON file of TrainConfig fields")
    p.add_argument("--features", help="JSON file of training.features (FeaturesSpec; default: local, or the "
                   "--inputs directory's features.json)")
    p.add_argument("--out", required=True, help="checkpoint directory to export (replaced)")
    p.add_argument("--state-dir", help="resumable training state (outside --out; shared by every rank)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="torch.distributed backend (default: gloo on CPU)")
    p.add_argument("--log-every-s", type=float, default=5.0, help="at most one step line per this many seconds")
    return p


def _inputs(args: argparse.Namespace):
    base = Path(args.inputs) if args.inputs else None

    def pick(value, flag, name):
        if value:
            return value
        if base is None:
            raise InputError(f"no {flag}: pass {flag}, or --inputs DIR holding {name}")
        return base / name

    rows_paths = args.rows or [pick(None, "--rows", TRAIN_FILE)]
    if args.validation_rows is not None:
        val_paths = args.validation_rows
    else:
        val_paths = [base / VALIDATION_FILE] if base is not None and (base / VALIDATION_FILE).exists() else []
    features_path = args.features or (base / FEATURES_FILE if base is not None and (base / FEATURES_FILE).exists()
                                      else None)
    return (read_rows(rows_paths), read_rows(val_paths),
            read_draft_vocab(pick(args.draft_vocab, "--draft-vocab", VOCAB_DIR)),
            read_config(pick(args.config, "--config", CONFIG_FILE)),
            read_features(features_path) if features_path else None)


def _step_limited(log: Callable[[str], None], every_s: float) -> Callable[[str], None]:
    last = [float("-inf")]

    def emit(line: str) -> None:
        if line.startswith("step "):
            now = time.monotonic()
            if now - last[0] < every_s:
                return
            last[0] = now
        log(line)

    return emit


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command (see the module docstring); 0 on success. Errors propagate (a non-zero exit)."""
    from contextlib import ExitStack

    import torch

    from eagle_assets.drafter.training.distributed import from_environment, shutdown
    from eagle_assets.drafter.training.loop import train_drafter

    args = _parser().parse_args(argv)
    parallel = from_environment(args.backend)
    with ExitStack() as stack:
        pipes = None
        if parallel.is_main and os.environ.get("DAGSTER_PIPES_CONTEXT"):
            from dagster_pipes import open_dagster_pipes

            pipes = stack.enter_context(open_dagster_pipes())
        prefix = f"[rank {parallel.rank}/{parallel.world}] " if parallel.world > 1 else ""
        if pipes is not None:
            log = pipes.log.info
        else:
            def log(line: str) -> None:
                print(prefix + line, flush=True)
        emit = _step_limited(log, args.log_every_s) if parallel.is_main else (lambda _line: None)
        rows, validation, vocab, config, features = _inputs(args)
        emit(f"data-parallel training on {parallel.world} process(es), backend {parallel.backend or 'none'}; "
             f"{len(rows)} rows, {len(validation)} validation rows; torch threads "
             f"{config.num_threads or torch.get_num_threads()} per process; features "
             f"{features.source if features is not None else 'local'}")
        result = train_drafter(args.target, rows, vocab, config, Path(args.out), log=emit, state_dir=args.state_dir,
                               validation_rows=validation, parallel=parallel, features=features)
        if result is not None:
            summary = {"checkpoint": str(result.checkpoint_dir), "world_size": parallel.world,
                       "steps": len(result.steps), "resumed_from_step": result.resumed_from_step,
                       "last_loss": result.last_loss, "tokens_per_s": result.tokens_per_s,
                       "train_seconds": result.train_seconds, "feature_seconds": result.feature_seconds,
                       "val_tau_final": result.curve[-1].val_tau if result.curve else None}
            if pipes is not None:
                pipes.report_custom_message(summary)
            emit("training summary " + json.dumps(summary))
        shutdown(parallel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
