"""One writer per stage folder, and the storage layer's refusals as Dagster step failures.

Every asset that writes or deletes files holds its folder's lock (``storage.shards.Layout.lock``: ``flock`` on
``<folder>/.<stage>.lock``) around its whole write, data version included, through :func:`stage_writer`: a second run
of the same stage and partition fails at once instead of deleting the first one's working files. A folder that is a
symbolic link, or a busy one, is refused by the storage layer before anything is deleted; :func:`refusals_as_failures`
turns those refusals into a ``dg.Failure`` whose description is the refusal (what, where, what to do), not retried:
a retry would meet the same link or the same running writer.
"""

import contextlib
from pathlib import Path
from typing import Iterator

import dagster as dg

from eagle_assets.storage.guard import StorageRefused
from eagle_assets.storage.shards import Layout


@contextlib.contextmanager
def refusals_as_failures() -> Iterator[None]:
    """Run the block; a ``StorageRefused`` raised in it (``PartitionBusyError``, ``SymlinkRefusedError``) becomes
    a ``dg.Failure`` with its message as description, ``allow_retries=False``.

    Raises:
        dg.Failure: the storage layer refused (nothing was deleted).
    """
    try:
        yield
    except StorageRefused as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc


@contextlib.contextmanager
def stage_writer(layout: Layout, stage: str, partition: str | None = None, wait_s: float = 0.0) -> Iterator[Path]:
    """Hold the lock of ``stage``'s folder (of ``partition``) for the block; yields the folder. ``wait_s``: how long
    to wait for another holder before refusing (0: refuse at once).

    Raises:
        dg.Failure: another run holds the lock, or the folder, a folder above it under the storage root or the lock
            file is a symbolic link; also for those refusals raised inside the block (:func:`refusals_as_failures`).
    """
    with refusals_as_failures(), layout.lock(stage, partition, wait_s=wait_s) as folder:
        yield folder
