"""The commit stage: a snapshot enters the manifest only once every rank's shard of it is durable.

It runs in rank 0's writer process, never in a training process, and coordinates through the
shared checkpoint directory alone: a rank's shard appears under its final name only after its
bytes are fsynced (it is written as ``*.partial`` and renamed), so the committer waits until every
rank's final name exists, checks their indexes (and that the replicated state agrees), and writes
the manifest. No collective runs, and no training process waits for another rank's I/O.

Attempts commit in the order rank 0 took them. An attempt that some rank never completes is
abandoned, never committed: when a later attempt completes first (that rank skipped or lost it),
or when no shard of any pending attempt has changed for ``commit_timeout`` seconds (a rank died
while writing; a few seconds once the training process is gone).

The other ranks' writers learn the outcome the same way (``CommitWatcher``): the manifest names
the attempt (committed), or rank 0 removed its directory (given up). Both are a ``CommitStage``,
so the writer loop drives either without knowing its rank. When the ranks share no directory
(``session.py``), every rank's writer runs a ``Committer`` over a root of its own instead, which
commits its shard alone; rank 0's uploader completes and checks the job's record in the object
store with the same ``with_shards``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Protocol, Sequence

from ..errors import (CheckpointError, CorruptSnapshotError, InternalError, ManifestError,
                      ReplicaMismatchError)
from ..format.manifest import (DroppedRecord, Manifest, ShardRecord, SnapshotRecord, read_manifest,
                               write_manifest)
from ..storage.names import MANIFEST_NAME, SHARD_FILE, shard_file_name
from ..format.records import Replica
from ..format.shard import ShardReader, referenced_dirs
from ..storage.base import Storage
from ..storage.local import write_error
from .protocol import (Abandoned, CommitFigures, Committed, Dropped, Failed, ShardFigures,
                       WriterEvent)

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.02
ORPHAN_QUIET_S = 5.0  # how long a writer whose trainer is gone waits for the other ranks


@dataclass
class Attempt:
    """One snapshot rank 0 has written, waiting for the other ranks' shards."""

    job: int
    step: int
    dir: str
    shard: ShardRecord  # rank 0's own shard
    replicas: list[Replica]  # rank 0's replica digests, which every rank's must equal
    raw_bytes: int
    figures: ShardFigures
    refers: tuple[str, ...] = ()  # earlier snapshots rank 0's shard refers to (incremental)
    data_bytes: int = 0  # of rank 0's data files (format version 6), besides its shard
    durable_at: float = field(default_factory=time.monotonic)
    last_change: float = field(default_factory=time.monotonic)
    seen: tuple = ()


class CommitStage(Protocol):
    """What the writer loop drives once a shard is durable: it tells the trainer (through
    ``send``) whether each attempt was committed, abandoned or failed. Time comes from the stage's
    injected monotonic clock, so tests advance it instead of sleeping."""

    pending: list[Attempt]

    def add(self, attempt: Attempt) -> None:
        """Take a durable attempt, and poll."""

    def poll(self, trainer_gone: bool) -> None:
        """Settle what can be settled now. ``trainer_gone``: the training process closed or died;
        the loop calls ``poll`` until nothing is pending."""

    def drop(self, steps: tuple[int, ...]) -> Dropped:
        """Take committed ``steps`` out of the manifest, where this stage writes it."""


class Committer:
    """Rank 0's writer's list of attempts not yet committed or abandoned; or, when the ranks
    share no directory (``own_root``), every rank's own: its root then holds only its own shards,
    and it commits each into its own manifest (``Manifest.rank``) as soon as it is durable (the
    object store's manifest, published by rank 0's uploader, commits the job's snapshot)."""

    def __init__(self, storage: Storage, world_size: int, keep_last: int,
                 keep_every: Optional[int], commit_timeout: float,
                 send: Callable[[WriterEvent], None],
                 clock: Callable[[], float] = time.monotonic,
                 on_commit: Optional[Callable[[SnapshotRecord], None]] = None,
                 keep: Optional[Callable[[], set[str]]] = None,
                 own_root: Optional[int] = None):
        self.storage, self.world_size = storage, world_size
        self.own_root = own_root
        self.ranks = set(range(world_size)) if own_root is None else {own_root}
        self.keep_last, self.keep_every = keep_last, keep_every
        self.commit_timeout = commit_timeout
        self.send = send
        self.clock = clock  # monotonic seconds; tests pass a clock they advance
        self.on_commit = on_commit  # the uploader, told of each commit after the trainer
        self.keep = keep  # directories retention must keep besides its own (being uploaded)
        self.pending: list[Attempt] = []

    def add(self, attempt: Attempt) -> None:
        attempt.last_change = self.clock()
        self.pending.append(attempt)
        self.poll(trainer_gone=False)

    def poll(self, trainer_gone: bool) -> None:
        """Commit what is complete, abandon what cannot complete any more (sooner once the
        trainer is gone: then nobody waits for a rank that is late)."""
        now = self.clock()
        complete = [self._scan(a, now) for a in self.pending]
        if any(complete):
            last = max(i for i, c in enumerate(complete) if c)
            for attempt, is_complete in zip(self.pending[:last + 1], complete):
                if is_complete:
                    self._commit(attempt)
                else:
                    self._abandon(attempt, "a later snapshot was complete first")
            del self.pending[:last + 1]
        quiet = min(self.commit_timeout, ORPHAN_QUIET_S) if trainer_gone else self.commit_timeout
        while self.pending and now - max(a.last_change for a in self.pending) > quiet:
            self._abandon(self.pending.pop(0), f"no rank wrote anything for {quiet:.0f} s")

    def _scan(self, attempt: Attempt, now: float) -> bool:
        """Whether every rank's shard is in place; notes any change as progress."""
        seen = self.storage.list_snapshot(attempt.dir)
        if seen != attempt.seen:
            attempt.seen, attempt.last_change = seen, now
        return self._ranks_present(attempt) >= self.ranks

    def _ranks_present(self, attempt: Attempt) -> set[int]:
        return {int(m.group(1)) for m in (SHARD_FILE.fullmatch(name) for name, _ in attempt.seen) if m}

    def _abandon(self, attempt: Attempt, why: str) -> None:
        missing = sorted(self.ranks - self._ranks_present(attempt))
        message = (f"step {attempt.step} was not committed: rank(s) {missing} never finished their "
                   f"shard ({why}). The previous committed snapshot stays the newest")
        log.warning("%s", message)
        self.storage.remove([attempt.dir])
        self.send(Abandoned(attempt.job, message))

    def _commit(self, attempt: Attempt) -> None:
        complete_at = self.clock()
        try:
            record = self._record(attempt)
            manifest, dropped = self._manifest().commit(
                record, self.keep_last, self.keep_every, self.keep() if self.keep else ())
            write_manifest(self.storage, manifest)  # the commit point
        except Exception as e:  # this attempt fails; the writer and older commits are unaffected
            error = failure(e, "committing", f"step {attempt.step}")
            self.storage.remove([attempt.dir])
            self.send(Failed(attempt.job, error))
            return
        committed_at = self.clock()
        self.storage.remove([d.dir for d in dropped])
        self.send(Committed(attempt.job, CommitFigures(
            attempt.figures, committed_at=committed_at, commit_s=committed_at - attempt.durable_at,
            raw_bytes=record.raw_bytes, stored_bytes=record.stored_bytes,
            disk_free_bytes=self.storage.free_bytes(),
            wait_ranks_s=complete_at - attempt.durable_at,
            dropped_steps=tuple(d.step for d in dropped if d.step != attempt.step))))
        if self.on_commit is not None:
            self.on_commit(manifest.find(attempt.step))

    def drop(self, steps: tuple[int, ...]) -> Dropped:
        """Take ``steps`` out of the manifest (but what a kept snapshot refers to), then delete
        their snapshots; the manifest is unchanged when writing it fails."""
        try:
            manifest, dropped = self._manifest().without(steps)
            if dropped:
                write_manifest(self.storage, manifest)
        except Exception as e:
            return Dropped((), failure(e, "dropping", f"steps {list(steps)}"))
        self.storage.remove([d.dir for d in dropped])
        return Dropped(tuple(d.step for d in dropped))

    def _manifest(self) -> Manifest:
        """The manifest to commit into: the root's, or in a rank's own root a new one of that
        rank (a root holding another rank's snapshots, or the job's, is refused)."""
        manifest = read_manifest(self.storage)
        if manifest.rank != self.own_root:
            if manifest.snapshots:
                raise ManifestError(
                    f"{self.storage.location()} holds the snapshots of "
                    f"{'all ranks' if manifest.rank is None else f'rank {manifest.rank}'}, not "
                    f"{'all ranks' if self.own_root is None else f'rank {self.own_root}'}'s; "
                    "point each job (and rank) at a directory of its own")
            manifest = dataclasses.replace(manifest, rank=self.own_root)
        return manifest

    def _record(self, attempt: Attempt) -> SnapshotRecord:
        """The manifest record of a complete attempt, after checking every other rank's shard."""
        others = sorted(self.ranks - {attempt.shard.rank})
        if others:  # the other ranks' renames are durable before the manifest names them
            self.storage.sync_snapshot(attempt.dir)
        own = SnapshotRecord(step=attempt.step, seq=0, dir=attempt.dir, committed_at=time.time(),
                             world_size=self.world_size, shards=(attempt.shard,),
                             raw_bytes=attempt.raw_bytes,
                             stored_bytes=attempt.shard.bytes + attempt.data_bytes,
                             refers=tuple(sorted(attempt.refers)))
        return with_shards(self.storage, own, attempt.replicas, others)


class CommitWatcher:
    """A writer of a rank other than 0: its shards are durable, and its trainer is told when rank
    0's writer has committed them (the manifest names them) or given them up (their directory is
    gone), so that ``wait()`` means "committed" on every rank. Should rank 0's writer itself be
    gone, an attempt is given up after twice ``commit_timeout`` without a new manifest.
    ``outlives_trainer(job)``: whether the outcome of a job still matters once the trainer is
    gone (the writer writes its markers then)."""

    def __init__(self, storage: Storage, commit_timeout: float,
                 send: Callable[[WriterEvent], None],
                 clock: Callable[[], float] = time.monotonic,
                 on_commit: Optional[Callable[[SnapshotRecord], None]] = None,
                 outlives_trainer: Callable[[int], bool] = lambda job: False):
        self.storage, self.send, self.clock = storage, send, clock
        self.on_commit, self.outlives_trainer = on_commit, outlives_trainer
        self.give_up_s = 2 * commit_timeout
        self.pending: list[Attempt] = []
        self._manifest_id: Optional[Hashable] = None
        self._committed: dict[str, SnapshotRecord | DroppedRecord] = {}  # by directory
        self._manifest_changed = clock()

    def add(self, attempt: Attempt) -> None:
        self.pending.append(attempt)
        self.poll(trainer_gone=False)

    def drop(self, steps: tuple[int, ...]) -> Dropped:
        """Nothing: rank 0's writer alone writes the manifest (``Committer.drop``)."""
        return Dropped(())

    def poll(self, trainer_gone: bool) -> None:
        """Report what rank 0 has committed or given up. Once the trainer is gone nobody is left
        to tell: drop what is pending (its shards are durable; rank 0 commits without us), but
        the jobs whose outcome still matters (``outlives_trainer``)."""
        if trainer_gone:
            self.pending = [a for a in self.pending if self.outlives_trainer(a.job)]
            if not self.pending:
                return
        self._reread_manifest()
        now = self.clock()
        still = []
        for attempt in self.pending:
            gone = not self.storage.exists(attempt.dir)
            if gone and attempt.dir not in self._committed and not self._reread_manifest():
                still.append(attempt)  # rank 0 deletes a directory only once a manifest that
                continue               # says why is durable: read that one before concluding
            record = self._committed.get(attempt.dir)
            if record is not None:
                self.send(Committed(attempt.job, CommitFigures(
                    attempt.figures, committed_at=now, commit_s=now - attempt.durable_at,
                    raw_bytes=record.raw_bytes, stored_bytes=record.stored_bytes,
                    disk_free_bytes=self.storage.free_bytes())))
                if self.on_commit is not None and isinstance(record, SnapshotRecord):
                    self.on_commit(record)
            elif gone:
                self.send(Abandoned(attempt.job,
                                    f"step {attempt.step} was not committed: rank 0 gave it up "
                                    "(some rank never finished its shard)"))
            elif now - max(attempt.durable_at, self._manifest_changed) > self.give_up_s:
                self.send(Abandoned(attempt.job,
                                    f"step {attempt.step}: rank 0 committed nothing for "
                                    f"{self.give_up_s:.0f} s; is its writer still running?"))
            else:
                still.append(attempt)
        self.pending = still

    def _reread_manifest(self) -> bool:
        """Read the manifest again when it was replaced (its storage version changed); False when
        it could not be read (replaced while read, or damaged: look again at the next poll)."""
        manifest_id = self.storage.version(MANIFEST_NAME)
        if manifest_id == self._manifest_id:
            return True
        try:
            manifest = read_manifest(self.storage)
        except CheckpointError:
            return False
        self._committed = {s.dir: s for s in (*manifest.snapshots, *manifest.dropped)}
        self._manifest_id, self._manifest_changed = manifest_id, self.clock()
        return True


def failure(exc: Exception, doing: str, what: str) -> CheckpointError:
    """The error the trainer is sent, and the writer logs, for ``exc`` raised while ``doing``
    ``what`` ("writing", "step 3"): a ``CheckpointError`` as it is, an ``OSError`` as a write
    error; anything else is a bug, never passed off as an I/O error: an ``InternalError``, its
    traceback in the writer's log."""
    if isinstance(exc, CheckpointError):
        error = exc
    elif isinstance(exc, OSError):
        error = write_error(exc, what)
    else:
        log.error("%s %s failed on a bug", doing, what, exc_info=exc)
        return InternalError(
            f"{doing} {what} failed on a bug in async_ckpt ({type(exc).__name__}: {exc}); "
            "committed snapshots are intact. Please report it with the writer's log, which holds "
            "its traceback")
    log.error("%s %s failed: %s", doing, what, error)
    return error


def with_shards(storage: Storage, record: SnapshotRecord, replicas: Sequence[Replica],
                ranks: list[int]) -> SnapshotRecord:
    """``record`` (holding rank 0's shard, whose index lists ``replicas``) with the shards of
    ``ranks`` added from ``storage``: each one's index is read and checked (its step, rank and
    world size; its replicas agree with rank 0's; the data files it names are there, with their
    sizes), and its size and index checksum recorded.
    The committer completes a snapshot in a shared directory this way, and rank 0's uploader one
    in the object store when the ranks share no directory."""
    shards, raw, refers = list(record.shards), record.raw_bytes, set(record.refers)
    stored = record.stored_bytes
    listing = dict(storage.list_snapshot(record.dir)) if ranks else {}
    for rank in ranks:
        with ShardReader(storage.open_shard(record.dir, shard_file_name(rank))) as reader:
            if not reader.is_shard_of(record.step, rank, record.world_size):
                raise CorruptSnapshotError(
                    f"{reader.path} is not rank {rank}'s shard of step {record.step} with "
                    f"{record.world_size} ranks; do several jobs share {storage.location()}?")
            _check_replicas(record.step, replicas, rank, reader.replicas)
            missing = reader.data_file_problems(listing, storage.location(record.dir))
            if missing:
                raise CorruptSnapshotError(f"rank {rank}'s shard of step {record.step} is "
                                           f"incomplete: {'; '.join(missing[:3])}")
            shards.append(ShardRecord(rank, shard_file_name(rank), reader.size, reader.index_xxh3))
            raw += reader.raw_bytes
            stored += reader.size + reader.data_file_bytes
            refers.update(referenced_dirs(reader.storages))
    shards.sort(key=lambda s: s.rank)
    return dataclasses.replace(record, shards=tuple(shards), raw_bytes=raw, stored_bytes=stored,
                               refers=tuple(sorted(refers)))


def _check_replicas(step: int, ours: Sequence[Replica], rank: int,
                    theirs: Sequence[Replica]) -> None:
    if [(r.entry, r.nbytes) for r in theirs] != [(r.entry, r.nbytes) for r in ours]:
        raise ReplicaMismatchError(
            f"step {step}: the replicated entries have a different layout on rank {rank} "
            f"than on rank 0 ({_entries(theirs)} vs {_entries(ours)}); every rank must register "
            "the same replicated entries with the same shapes")
    differ = sorted({a.entry for a, b in zip(ours, theirs) if a.xxh3 != b.xxh3})
    if differ:
        raise ReplicaMismatchError(
            f"step {step}: replicated state {', '.join(map(repr, differ))} differs between "
            f"rank 0 and rank {rank}, so it is not replicated; the snapshot was not committed. "
            "Declare as replicated only what every rank holds identically (a DDP model and its "
            "optimizer, not ZeRO/FSDP shards), and start every rank from the same weights")


def _entries(replicas: Sequence[Replica]) -> str:
    return ", ".join(sorted({r.entry for r in replicas})) or "none"

