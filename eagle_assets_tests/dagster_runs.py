"""Runs of the training assets in a real (ephemeral) Dagster instance, as several tests make them."""

from __future__ import annotations

from typing import Any

import dagster as dg

TRAINING_ASSETS = ("draft_vocab", "training_mix", "drafter_checkpoint")


def materialize_training(defs: dg.Definitions, names: tuple[str, ...] = TRAINING_ASSETS) -> tuple[Any, list[str]]:
    """Materialize the assets ``names`` of ``defs`` with its resources in an ephemeral instance (errors are not
    raised: the caller asserts on ``result.success`` with the logs).

    Returns:
        ``(result, log messages of the run)``.
    """
    wanted = {dg.AssetKey(k) for k in names}
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and a.keys & wanted],
                                instance=instance, resources=defs.resources, raise_on_error=False)
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
    return result, logs
