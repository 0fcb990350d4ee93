"""A rank's session on a checkpoint directory: its lock held, and the token of this run.

The token names the run's snapshot directories (``Session.snapshot_dir``), so that a restarted
job never writes into a directory an earlier run left. Rank 0 draws it once no writer of
an earlier run can be active, and with several ranks publishes it in ``session.json``: every other
rank reading the same token is the proof that all of them share one directory. When some rank
does not see it (nodes with local disks and no shared file system) and the job has an object
store to commit through, each rank keeps its snapshots in a root of its own, ``DIR/rank-RRRRR``
(docs/distributed.md "Without a shared file system"); without one, that job is refused. The lock
protocol itself is ``storage.locks``'s; every file is reached through the directory's
``LocalStorage``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import secrets
import time
from typing import Optional

from ..distributed import Coordinator
from ..errors import CheckpointDirError, DistributedSetupError
from ..format.manifest import leftovers, recover_manifest
from ..storage.names import SESSION_NAME, rank_root_name, snapshot_dir_name
from ..storage.local import LocalStorage, ensure_writable_dir

log = logging.getLogger(__name__)
_MAX_SESSION_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Session:
    """What a started session holds: the lock's file descriptor (closing it releases the lock),
    the run's token, the ``directory`` given (its lock files, heartbeats and ``session.json``),
    and where this rank's snapshots go: ``root``, which is the directory itself unless the ranks
    share none (``own_root``)."""

    lock_fd: int
    token: str
    directory: LocalStorage
    root: str
    own_root: bool = False
    _attempts: collections.Counter = dataclasses.field(  # snapshot directories named, per step
        default_factory=collections.Counter, init=False, repr=False, compare=False)

    def snapshot_dir(self, step: int) -> str:
        """The directory of this session's next snapshot of ``step``: the same on every rank
        (they agree on the token and snapshot alike), fresh for every attempt, so that
        re-snapshotting a committed step never touches it."""
        attempt = self._attempts[step]
        self._attempts[step] += 1
        return snapshot_dir_name(step, self.token, attempt)

    def close(self) -> None:
        """Release this rank's lock: the session ends (the writer's own hold on the lock file
        ends when the writer does)."""
        os.close(self.lock_fd)


def start_session(directory: str | os.PathLike, coordinator: Coordinator, settings: dict,
                  lock_timeout: float, own_roots: bool = False) -> Session:
    """Take this rank's directory lock and agree with the other ranks on this run.

    In order: the directory is created if missing (CheckpointDirError when it cannot be, or is
    not writable); every rank checks that all were created with the same ``settings`` (this first
    exchange also connects the ranks, while they arrive together); each takes its lock, waiting
    up to ``lock_timeout`` seconds for its previous writer (perhaps of a killed process) to
    finish; then rank 0, now sure that no writer of an earlier run is active, starts the session
    and the others check that they see its ``session.json``. Where some rank does not, that is a
    CheckpointDirError on every rank, unless ``own_roots`` (the job commits through an object
    store): then every rank starts a root of its own in the directory it was given.
    """
    storage = LocalStorage(ensure_writable_dir(directory))
    everyone = coordinator.gather(settings)
    differ = [k for k in settings if any(other[k] != everyone[0][k] for other in everyone)]
    if differ:
        raise DistributedSetupError(
            "the ranks created their engines with different settings: " + "; ".join(
                f"{k} = " + ", ".join(f"{other[k]!r} (rank {r})"
                                      for r, other in enumerate(everyone))
                for k in differ) + ". Create every rank's engine with the same arguments")
    fd, problem, kind = None, None, CheckpointDirError
    try:
        fd = storage.take_lock(coordinator.rank, lock_timeout)
    except CheckpointDirError as e:  # DirectoryInUseError too: the rank that saw it says so
        problem, kind = str(e), type(e)
    try:
        coordinator.raise_if_any(problem, kind, "cannot lock the directory")
        token = coordinator.from_rank0(lambda: _new_token(storage, coordinator.world_size))
        seen = token if coordinator.world_size == 1 else _published_token(storage)
        problem = (None if seen == token else
                   f"{storage.root} does not hold rank 0's {SESSION_NAME} (found {seen!r})")
        if own_roots and coordinator.world_size > 1 and any(coordinator.gather(problem)):
            root = storage.location(rank_root_name(coordinator.rank))
            _start_own_root(root, coordinator.rank)
            return Session(fd, token, storage, root, own_root=True)
        coordinator.raise_if_any(problem, CheckpointDirError,
                                 "every rank must write to the same shared directory, or pass "
                                 "remote= to commit through an object store (see "
                                 "docs/distributed.md)")
        return Session(fd, token, storage, storage.root)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


def _new_token(directory: LocalStorage, world_size: int) -> str:
    """Rank 0, while no writer of any rank is active: remove what interrupted snapshots left, and
    draw the new session's token (published when several ranks share the directory)."""
    _remove_leftovers(directory)
    token = secrets.token_hex(8)
    if world_size > 1:
        directory.publish(SESSION_NAME, json.dumps(
            {"token": token, "world_size": world_size, "started": time.time()}).encode())
    return token


def _start_own_root(root: str, rank: int) -> None:
    """Rank ``rank``'s own root, created if needed, without what its interrupted snapshots left
    (this rank's lock, held, keeps any other engine out of it)."""
    _remove_leftovers(LocalStorage(ensure_writable_dir(root)), rank)
    log.info("the ranks share no checkpoint directory: rank %d keeps its snapshots in %s, and "
             "snapshots commit through the object store", rank, root)


def _remove_leftovers(root: LocalStorage, rank: Optional[int] = None) -> None:
    """Delete what interrupted snapshots left in ``root`` (``rank``: a rank's own root), once no
    writer that could still finish one is active there."""
    stale = leftovers(root, recover_manifest(root, rank=rank))
    if stale:
        log.info("removing leftovers of interrupted snapshots: %s", ", ".join(stale))
        root.remove(stale)


def _published_token(directory: LocalStorage) -> Optional[str]:
    """The token in ``session.json``, or None when it is missing or unreadable (then this rank
    does not share rank 0's directory)."""
    try:
        doc = json.loads(directory.read_file(SESSION_NAME, _MAX_SESSION_BYTES, CheckpointDirError))
    except (OSError, ValueError, RecursionError, CheckpointDirError):
        return None
    return doc.get("token") if isinstance(doc, dict) else None
