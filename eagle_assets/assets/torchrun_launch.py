"""``drafter_checkpoint`` with ``training.launcher: torchrun``: the training command in data-parallel processes,
launched through Dagster Pipes so its log lines and summary reach the run.

The step writes the rows it chose (the training mix, the validation split), the draft vocab and the
:class:`~eagle_assets.drafter.recipe.TrainConfig` to ``drafter_checkpoint/train_inputs/``
(:func:`~eagle_assets.drafter.train_command.write_training_inputs`), then runs::

    python -m torch.distributed.run --standalone --nproc_per_node N -m eagle_assets.drafter.training.command \\
        --target MODEL --inputs .../train_inputs --out .../checkpoint --state-dir .../train_state

with ``dagster.PipesSubprocessClient``: rank 0 opens ``dagster_pipes.open_dagster_pipes()`` and sends its log
lines (``context.log`` of this step) and a training summary (a custom message); every rank's stdout and stderr go to
the step's compute logs. The training state directory is the inline launcher's, and a state does not record how
many processes wrote it, so a run killed under one launcher resumes under the other. ``--standalone`` is one node
(torchrun's local rendezvous); several nodes need torchrun's ``--nnodes`` / ``--rdzv-endpoint``, which this
launcher does not pass (untested: docs/scaling.md).

With ``training.features: served`` the resolved features spec goes to the ranks as ``train_inputs/features.json``:
no rank loads the target, each fetches from the server only the features of the rows it trains on (its
``DataParallel.shard`` of every batch; ``ServedFeatures.admit``), rank 0 those of the validation rows. The server
(the catalog's ``features.url``, or the one the step's server resource launched) must outlive the command, which it
does: the resource is the step's.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

import dagster as dg

COMMAND_MODULE = "eagle_assets.drafter.training.command"


def torchrun_command(nproc_per_node: int, target_dir: Path, inputs: Path, out: Path, state_dir: Path) -> list[str]:
    """The command line (this interpreter's ``torch.distributed.run``, so the step's environment)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={int(nproc_per_node)}",
            "-m", COMMAND_MODULE, "--target", str(target_dir), "--inputs", str(inputs), "--out", str(out),
            "--state-dir", str(state_dir)]


def train_with_torchrun(context: dg.AssetExecutionContext, target_dir: Path, rows: Sequence, validation: Sequence,
                        vocab_dir: Path, config, stage: Path, nproc_per_node: int, features=None):
    """Run the training command under torchrun for ``drafter_checkpoint``; its :class:`TrainResult`.

    Args:
        target_dir: the target model directory; rows / validation: ``(input_ids, loss_mask)`` in training order.
        vocab_dir: the ``draft_vocab`` asset's directory; config: the TrainConfig.
        stage: ``drafter_checkpoint``'s directory (``train_inputs/``, ``checkpoint/``, ``train_state/`` in it).
        features: the resolved ``catalog.FeaturesSpec`` (None or ``local``: every rank loads the target).

    Raises:
        dagster.DagsterPipesExecutionError: the command failed (its stderr is in the step's compute logs).
    """
    from eagle_assets.drafter.training.command import train_result_from_dict, write_training_inputs

    inputs = write_training_inputs(stage / "train_inputs", rows, validation, config, vocab_dir, features=features)
    out = stage / "checkpoint"
    command = torchrun_command(nproc_per_node, target_dir, inputs, out, stage / "train_state")
    context.log.info(f"launching {nproc_per_node} training process(es): {shlex.join(command)}")
    invocation = dg.PipesSubprocessClient().run(context=context, command=command)
    for message in invocation.get_custom_messages():
        context.log.info(f"training command reported {json.dumps(message)}")
    return train_result_from_dict(json.loads((out / "training_metrics.json").read_text()))
