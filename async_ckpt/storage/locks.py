"""The directory lock protocol: one lock file per rank, ``DIR/.lock-rankNNNNN`` (``storage.names``).

Who holds what, and why:

- An engine takes its rank's lock *exclusively* at start-up, waiting until the previous holder is
  gone: the previous engine of this rank and, above all, its writer process, which may still be
  committing what a killed trainer staged. Once it has the lock it downgrades it to *shared*.
- Its writer process takes the same lock *shared* and holds it until it exits, so the lock stays
  held while the writer finishes, even after the trainer died.
- Whoever deletes what no engine names (start-up clean-up runs while the exclusive lock is held;
  ``async-ckpt gc`` takes every rank's lock exclusively without waiting) knows no writer is active.

flock locks belong to open file descriptions, so a lock is released when its holder's process
exits, however it exits. They are local to one machine (see docs/distributed.md): the callers
reach them through ``LocalStorage`` (``take_lock``, ``lock_file``, ``exclude_engines``), and an
object store has none.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from typing import Callable, Iterator

from ..errors import CheckpointDirError, DirectoryInUseError
from .names import LOCK_FILE, lock_file_name

_RETRY_S = 0.05


def lock_path(root: str, rank: int) -> str:
    return os.path.join(root, lock_file_name(rank))


def take_rank_lock(root: str, rank: int, timeout: float) -> int:
    """An engine's lock of ``rank`` on ``root``: taken exclusively (waiting up to ``timeout``
    seconds for the previous engine and its writer to finish), then held shared, which its writer
    joins. Returns the file descriptor; closing it releases the lock."""
    path = lock_path(root, rank)
    fd = _open_lock_file(path)
    try:
        deadline = time.monotonic() + timeout
        while not _try_lock(fd, fcntl.LOCK_EX):
            if time.monotonic() > deadline:
                raise DirectoryInUseError(
                    f"another engine (or its writer) is still using {root} for rank {rank}; "
                    "close it first or use another directory")
            time.sleep(_RETRY_S)
        fcntl.flock(fd, fcntl.LOCK_SH)  # shared with our writer from now on
    except BaseException:
        os.close(fd)
        raise
    return fd


def join_rank_lock(path: str) -> int:
    """The writer's share of its engine's lock, held until the writer process exits."""
    fd = _open_lock_file(path)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _open_lock_file(path: str) -> int:
    """A descriptor of the lock file ``path``, created when absent; only ever a regular file: what
    else is at the name (a device, a FIFO, a link) is refused without ever being opened for
    reading or writing, since opening a device can do things of its own.

    Race-free: the name is first opened ``O_PATH | O_NOFOLLOW`` (which opens nothing: no device
    driver runs, a link is not followed), that very inode is checked to be a regular file, and
    only it is opened for writing, through ``/proc/self/fd``; what the name points to by then does
    not matter. It is created (``O_EXCL``, which opens nothing that exists) only when absent."""
    for _ in range(2):  # a lock file removed between two opens: create it again
        try:
            handle = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                               | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                continue
            except OSError as e:
                raise _unusable(path, e) from e
        except OSError as e:
            raise _unusable(path, e) from e
        try:
            if not stat.S_ISREG(os.fstat(handle).st_mode):
                raise CheckpointDirError(f"{path} is not a regular file; remove it (an engine "
                                         "creates its lock file itself)")
            return os.open(f"/proc/self/fd/{handle}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:  # no /proc mounted, or the file's permissions
            raise _unusable(path, e) from e
        finally:
            os.close(handle)
    raise CheckpointDirError(f"{path} keeps vanishing while opened; is another program removing "
                             "files in the checkpoint directory?")


def _unusable(path: str, e: OSError) -> CheckpointDirError:
    return CheckpointDirError(f"cannot open the lock file {path}: {e.strerror}; check the "
                              "directory's permissions (and that /proc is mounted)")


@contextlib.contextmanager
def every_rank_exclusively(root: str) -> Iterator[Callable[[], None]]:
    """Hold every rank's lock of ``root`` exclusively, without waiting (DirectoryInUseError when
    an engine or writer holds one); yields a function that also takes lock files created since."""
    held: dict[str, int] = {}

    def lock_all() -> None:
        for name in sorted(n for n in os.listdir(root) if LOCK_FILE.fullmatch(n)):
            if name in held:
                continue
            # one removed since it was listed is created again: held like the others, harmless
            fd = held[name] = _open_lock_file(os.path.join(root, name))
            if not _try_lock(fd, fcntl.LOCK_EX):
                raise DirectoryInUseError(
                    f"an engine is writing to {root}; stop it first (its lock {name} is held by a "
                    "running engine or its writer process)")

    try:
        lock_all()
        yield lock_all
    finally:
        for fd in held.values():
            os.close(fd)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
