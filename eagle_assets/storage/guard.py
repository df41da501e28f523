"""What the pipeline may delete under, and who may write a stage's folder: no symbolic links, one writer at a time.

**No links under the storage root.** Every stage clears and rewrites its own folders under
``<storage root>/<catalog>/`` (stale shards, a regeneration's staging folder, spill and staging folders, a replaced
checkpoint). If one of those folders were a symbolic link, the clearing would follow it and delete the files of
whatever it points to. :func:`refuse_symlink` ``lstat``\\ s a folder and every folder between the storage root and it,
and raises :class:`SymlinkRefusedError` (naming the link, saying nothing was deleted and what to do) before
anything is deleted or written there. The storage root itself and the folders above it may be links (data kept
on another disk): only the folders the pipeline creates under the root are checked.

**One writer per folder.** :func:`stage_lock` holds a non-blocking exclusive ``flock`` on ``<folder>/.<stage>.lock``
for as long as a stage writes that folder; a second run of the same stage and partition is refused at once with
:class:`PartitionBusyError` instead of deleting the first one's working files. The kernel drops the lock when the
holder exits, killed or not. The lock file is a dotfile that no shard listing or content version matches, so it
changes no data version.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Iterator

# How often a waiting stage_lock tries the lock again (flock has no timeout of its own; a blocking flock would wait
# for a hung holder forever)
_WAIT_POLL_S = 0.1


class StorageRefused(RuntimeError):
    """The storage layer refused to write or delete (a linked folder, a busy one); nothing was deleted."""


class SymlinkRefusedError(StorageRefused):
    """A folder the pipeline writes and deletes in (or its lock file: ``folder`` False) is a symbolic link;
    ``path`` names it, ``target`` is where it points."""

    def __init__(self, path: Path, target: str, folder: bool = True):
        self.path, self.target = Path(path), target
        if folder:
            fix = (f"Replace the link by a real folder: `rm {path}` removes only the link ({target} stays as it "
                   "is), then materialize again and the pipeline creates the folder; to keep the data on another "
                   "disk, link the storage root ($EAGLE_ASSETS_HOME) itself, not a folder inside it")
        else:
            fix = (f"Remove the link: `rm {path}` removes only the link ({target} stays as it is), then materialize "
                   "again and the pipeline creates that file itself")
        super().__init__(
            f"{path} is a symbolic link (to {target}). The pipeline deletes and rewrites files in the folders it "
            f"keeps under the storage root and never follows a link there, so it stopped before touching anything: "
            f"nothing was deleted or written. {fix}")


class PartitionBusyError(StorageRefused):
    """Another process holds the lock of the folder a stage writes (:func:`stage_lock`)."""


def refuse_symlink(path: Path, root: Path | None = None) -> Path:
    """Return ``path`` when neither it nor a folder between ``root`` (excluded) and it is a symbolic link.

    Args:
        path: a folder (or file) the pipeline is about to delete under or write; need not exist (the check stops
            at the first part that does not).
        root: the storage root; the root and the folders above it may be links and are not looked at. None (or a
            ``path`` outside ``root``): only ``path`` itself is checked.
    Raises:
        SymlinkRefusedError: a checked part is a link (``.path`` names the first one found).
    """
    path = Path(path)
    parts = [path]
    if root is not None:
        try:
            rel = path.relative_to(root)
        except ValueError:
            rel = None
        if rel is not None:
            here, parts = Path(root), []
            for name in rel.parts:
                here = here / name
                parts.append(here)
    for part in parts:
        try:
            mode = os.lstat(part).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break  # nothing below a missing part exists yet: what the pipeline creates there is a real folder
        if stat.S_ISLNK(mode):
            raise SymlinkRefusedError(part, os.readlink(part))
    return path


def remove_tree(path: Path, ignore_errors: bool = False) -> None:
    """``shutil.rmtree(path)`` of a real folder only (the pipeline's own scratch and staging folders).

    Raises:
        SymlinkRefusedError: ``path`` is a symbolic link (nothing is deleted; ``shutil.rmtree`` would refuse it
            with a bare ``OSError``, or silently with ``ignore_errors``).
        OSError: as ``shutil.rmtree`` (unless ``ignore_errors``).
    """
    refuse_symlink(path)
    shutil.rmtree(path, ignore_errors=ignore_errors)


def lock_file_name(stage: str) -> str:
    """The lock file a stage holds in the folder it writes: ``.<stage>.lock``."""
    return f".{stage}.lock"


def open_lock_file(path: Path) -> int:
    """Open (creating) the lock file ``path`` for ``flock`` without following a link; returns the descriptor.

    Raises:
        SymlinkRefusedError: ``path`` is a symbolic link (``O_NOFOLLOW``: not even a dangling one is followed to
            create a file where it points).
        OSError: as ``os.open``.
    """
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkRefusedError(Path(path), os.readlink(path), folder=False) from None
        raise


@contextlib.contextmanager
def stage_lock(directory: Path, stage: str, *, root: Path | None = None, busy: str | None = None,
               lock_name: str | None = None, wait_s: float = 0.0) -> Iterator[Path]:
    """Hold an exclusive ``flock`` on ``directory / .<stage>.lock`` for the block (the folder is created); yields
    ``directory``. Not blocking: a held lock is refused at once, or after ``wait_s`` seconds of retrying.

    The lock is released when the block ends, and by the kernel when the process dies (SIGKILL included), so a
    killed run never leaves a folder locked. The lock file stays (an empty dotfile: no shard listing or content
    version reads it); it is opened with ``O_NOFOLLOW``, so a link planted in its place is refused, not followed.

    Args:
        directory: the folder the stage writes and deletes in.
        stage: names the lock file (:func:`lock_file_name`) and the refusal.
        root: the storage root: the folders between it and ``directory`` are checked too (:func:`refuse_symlink`).
        busy: the refusal's message (default: names the folder, the lock file and what to do).
        lock_name: another name for the lock file (default ``.<stage>.lock``).
        wait_s: how long to wait for another holder to finish before refusing (0: refuse at once). For a folder
            that runs of other partitions rewrite whole (the length report), where the later write is as right as
            the earlier one and only their overlap must be avoided.
    Raises:
        PartitionBusyError: another process holds the lock (nothing was touched).
        SymlinkRefusedError: ``directory``, a folder above it under ``root``, or the lock file is a link.
    """
    directory = refuse_symlink(Path(directory), root)
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / (lock_name or lock_file_name(stage))
    fd = open_lock_file(lock)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    waited = f" (waited {wait_s:g} s for it)" if wait_s else ""
                    raise PartitionBusyError(busy or (
                        f"another process is writing {stage} into {directory} (it holds {lock}){waited}; two "
                        "writers of one folder would delete each other's files. Wait for it to finish, or stop it: "
                        "the lock is released as soon as that process exits, even when it is killed")) from None
                time.sleep(min(_WAIT_POLL_S, max(deadline - time.monotonic(), 0.0)))
        yield directory
    finally:
        os.close(fd)  # closing the descriptor releases the flock
