"""The remote tier: every rank's writer copies committed snapshots to the object store in the
background, and rank 0's publishes the remote manifest once every rank's shard is in the bucket.

The local commit stays the fast path and the training process never waits for the network: a
snapshot is uploaded only after it is committed locally, from its durable shard file (never from
a staging buffer), by a thread of the writer process. Per rank the uploader works on one
snapshot at a time; when snapshots commit faster than they upload, it moves on to the newest
committed one and skips those in between (``stats()`` shows the lag). Local retention keeps the
snapshot being uploaded (``protected``): the local disk holds at most one snapshot more than
``keep_last`` because of the upload.

One snapshot, in order:

1. each rank uploads its own shard (``ObjectStorage.upload_file``: multipart, parts checked by
   the store); with incremental snapshots (one rank), first the snapshots it refers to that the
   bucket does not hold yet;
2. rank 0 lists the snapshot's prefix until every rank's shard is there with the size its
   manifest record says, then publishes the remote manifest, conditional on the ETag it last
   saw (docs/FORMAT.md 7: a manifest never names a partial snapshot, and another engine writing the
   prefix is a RemoteConflictError that stops this uploader, replacing nothing). When the ranks
   share no directory, rank 0's local record holds only its own shard: it then reads the other
   ranks' shard indexes from the bucket and checks them as the committer of a shared directory
   would (``commit.with_shards``); a snapshot that fails the check is never published (its error
   is raised once in the trainer), and the uploader moves on;
3. only then are the objects of snapshots the new manifest drops (``remote_keep_last``) deleted.
   The other ranks watch the remote manifest to learn that their shard is published.

A failed request (the store down, a network error) is retried with exponential back-off from
``RETRY_FIRST_S`` to ``RETRY_MAX_S``; time comes from an injected clock, and the transfers run on
an executor, so tests drive it without sleeping.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import CheckpointError, CorruptSnapshotError, RemoteConflictError, SnapshotWriteError
from ..format.manifest import Manifest, SnapshotRecord, read_manifest, write_manifest
from ..storage.names import MANIFEST_NAME, shard_file_name
from ..format.shard import ShardReader
from ..storage.base import Storage
from ..storage.remote import ObjectStorage
from .commit import with_shards
from .protocol import RemoteStatus, WriterEvent

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
LISTING_INTERVAL_S = 0.25
"""How often rank 0 lists a snapshot's prefix while waiting for the other ranks' shards, and the
other ranks read the remote manifest while waiting for rank 0 to publish."""
PEER_WAIT_S = 60.0
"""Rank 0 gives up waiting for the other ranks' shards of a snapshot after this long once a newer
snapshot is committed (a rank that died, or fell far behind), and uploads that one; a rank seen to
have uploaded a newer snapshot's shard instead is not waited for at all (``_moved_on``)."""
ORPHAN_UPLOAD_S = 60.0
"""Once the training process is gone (killed, or it exited without ``close()``), the writer goes
on uploading until the uploads are done or have failed for this long."""


class Phase(enum.Enum):
    """How far the upload of one snapshot got. Every rank uploads its files (``UPLOAD``); rank 0
    then waits for the other ranks' (``PEERS``) and publishes the bucket's manifest
    (``PUBLISH``), while the others wait to see it published (``WATCH``). It ends ``DONE`` (in
    the bucket) or ``SKIPPED`` (superseded, dropped, or refused)."""

    UPLOAD = "upload"
    PEERS = "peers"
    PUBLISH = "publish"
    WATCH = "watch"
    DONE = "done"
    SKIPPED = "skipped"


@dataclass
class _Upload:
    """The snapshot being uploaded, and how far it got."""

    record: SnapshotRecord
    closure: tuple[SnapshotRecord, ...]  # committed earlier, referred to, not yet in the bucket
    phase: Phase = Phase.UPLOAD
    started: float = 0.0
    waited_since: float = 0.0


class Uploader:
    """One rank's remote tier, driven by the writer loop: ``committed`` hands it each snapshot
    committed locally, ``poll`` advances it, ``busy`` says whether work is left."""

    def __init__(self, local: Storage, remote: ObjectStorage, rank: int, world_size: int,
                 keep_last: int, keep_every: Optional[int], send: Callable[[WriterEvent], None],
                 clock: Callable[[], float] = time.monotonic,
                 run: Optional[Callable[..., Future]] = None):
        self.local, self.remote = local, remote
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.keep_every = keep_last, keep_every
        self.send, self.clock = send, clock
        self._submit = run or run_in_thread
        self.queue: collections.deque[tuple[SnapshotRecord, float]] = collections.deque()
        self.current: Optional[_Upload] = None
        self.remote_manifest: Optional[Manifest] = None  # rank 0: what it last published or read
        self.remote_step: Optional[int] = None
        self.pending_since: Optional[float] = None  # commit time of the oldest not yet uploaded
        self.last_error: Optional[str] = None
        self.failures = 0
        self.retry_at = 0.0
        self.failing_since: Optional[float] = None
        self.uploaded_bytes = 0
        self.skipped = 0
        self.stopped: Optional[RemoteConflictError] = None
        self.rejected: Optional[CheckpointError] = None  # why the last refused snapshot was
        self.rejections = 0  # snapshots whose shards failed the checks before publication
        self._future: Optional[Future] = None
        self._next_check = 0.0
        self._caught_up = False

    # --- what the writer loop calls -----------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.stopped is None and (not self._caught_up or self.current is not None
                                         or bool(self.queue) or self._future is not None)

    def committed(self, record: SnapshotRecord) -> None:
        """A snapshot this rank's writer has seen committed locally."""
        if self.stopped is not None:
            return
        now = self.clock()
        self.queue.append((record, now))
        if self.pending_since is None:
            self.pending_since = now
        self._report()  # the lag grows now, even while a transfer hangs on a store that is down
        self.poll()

    def protected(self) -> set[str]:
        """Snapshot directories local retention must keep: the one being uploaded, and what it
        refers to."""
        if self.current is None:
            return set()
        return {self.current.record.dir, *self.current.record.refers}

    def gave_up(self) -> bool:
        """Whether uploads have failed for ``ORPHAN_UPLOAD_S`` (the writer's trainer being gone,
        nobody would see them succeed any more)."""
        return self.failing_since is not None and self.clock() - self.failing_since > ORPHAN_UPLOAD_S

    def poll(self) -> None:
        now = self.clock()
        if self.stopped is not None or not self._collect(now) or now < self.retry_at:
            return
        if not self._caught_up:
            self._run(self._catch_up)
            return
        if self.current is None:
            if not self.queue:
                return
            self._start(now)
        upload = self.current
        if upload.phase is Phase.UPLOAD:
            self._run(self._upload_files, upload)
        elif now >= self._next_check:  # the other phases list or read the bucket: not too often
            self._next_check = now + LISTING_INTERVAL_S
            self._run({Phase.PEERS: self._check_peers, Phase.PUBLISH: self._publish,
                       Phase.WATCH: self._check_published}[upload.phase], upload)

    # --- steps -----------------------------------------------------------------------------

    def _start(self, now: float) -> None:
        record, _ = self.queue.pop()  # the newest committed: older ones are skipped
        self.skipped += len(self.queue)
        if self.queue:
            log.info("remote: skipping steps %s, which the upload of step %d supersedes",
                     [r.step for r, _ in self.queue], record.step)
        self.queue.clear()
        self.current = _Upload(record, (), started=now, waited_since=now)

    def _upload_files(self, upload: _Upload) -> Phase:
        if self.rank == 0:
            upload.closure = self._closure(upload.record)
        for record in (*upload.closure, upload.record):
            shard = record.shard_of(self.rank)
            present = self.remote.list_snapshot(record.dir)
            if (shard.file, shard.bytes) in present:
                continue  # uploaded before a retry or a restart
            try:
                # its data files first (format version 6), as its index names them: a shard in
                # the bucket has them there
                with ShardReader(self.local.open_shard(record.dir, shard.file), shard.bytes,
                                 shard.index_xxh3) as reader:
                    files = [f for f in reader.data_files if f not in present]
                for name, size in (*files, (shard.file, shard.bytes)):
                    self.remote.upload_file(record.dir, name, self.local.location(record.dir, name))
                    self.uploaded_bytes += size
            except (FileNotFoundError, CorruptSnapshotError) as e:
                if any(s.dir == record.dir for s in read_manifest(self.local).snapshots):
                    return self._rejected(upload.record, e)  # damaged here: never uploaded
                log.info("remote: step %d was dropped before it was uploaded", record.step)
                # dropped locally since (engine.drop, retention): its files are deleted only
                # once the manifest no longer names it
                return Phase.SKIPPED
        return Phase.PEERS if self.rank == 0 else Phase.WATCH

    def _check_peers(self, upload: _Upload) -> Phase:
        present = dict(self.remote.list_snapshot(upload.record.dir))
        missing = [rank for rank in range(upload.record.world_size)
                   if not _uploaded(upload.record, rank, present)]
        if not missing:
            return Phase.PUBLISH
        if self._moved_on(missing):
            log.info("remote: rank(s) %s moved on past step %d (each uploads the newest it has "
                     "committed); moving on to step %d", missing, upload.record.step,
                     self.queue[-1][0].step)
            return Phase.SKIPPED
        now = self.clock()
        if self.queue and now - upload.waited_since > PEER_WAIT_S:
            log.warning("remote: rank(s) %s never uploaded step %d; moving on to step %d",
                        missing, upload.record.step, self.queue[-1][0].step)
            return Phase.SKIPPED
        return Phase.PEERS

    def _moved_on(self, missing: list[int]) -> bool:
        """Whether one of the ``missing`` ranks has uploaded its shard of a snapshot committed
        after the one rank 0 waits for: each rank uploads the newest snapshot it has seen
        committed and never goes back, so that one cannot complete any more (waiting for it
        would hold every later upload back by ``PEER_WAIT_S``). It runs in the upload thread
        while the writer's thread appends to the queue: it walks a copy (list() of a deque is one
        step under the GIL; iterating the deque itself raised "deque mutated during iteration"
        and killed the writer)."""
        for record, _ in list(self.queue):
            present = dict(self.remote.list_snapshot(record.dir))
            if any(shard_file_name(rank) in present for rank in missing):
                return True
        return False

    def _complete(self, record: SnapshotRecord) -> SnapshotRecord:
        """``record`` with every rank's shard: as committed locally in a shared directory, else
        completed from the bucket's objects, checked against rank 0's own shard."""
        others = [rank for rank in range(record.world_size) if record.shard_of(rank) is None]
        if not others:
            return record
        own = record.shard_of(self.rank)
        with ShardReader(self.local.open_shard(record.dir, own.file)) as reader:
            replicas = reader.replicas
        return with_shards(self.remote, record, replicas, others)

    def _rejected(self, record: SnapshotRecord, error: Exception) -> Phase:
        """Give up publishing ``record``, whose shards failed the checks (not the store): told
        to the trainer; the next phase."""
        self.rejected, self.last_error = error, f"{type(error).__name__}: {error}"
        self.rejections += 1
        log.error("remote: step %d is not published: %s", record.step, error)
        return Phase.SKIPPED

    def _publish(self, upload: _Upload) -> Phase:
        try:
            upload.record = self._complete(upload.record)
        except (CorruptSnapshotError, SnapshotWriteError) as e:  # the shards, not the store
            return self._rejected(upload.record, e)
        manifest, dropped = self.remote_manifest, []
        for record in (*upload.closure, upload.record):
            manifest, gone = manifest.commit(record, self.keep_last, self.keep_every)
            dropped += gone
        try:
            write_manifest(self.remote, manifest)  # conditional: RemoteConflictError if not ours
        except RemoteConflictError:
            if self.remote.version(MANIFEST_NAME) is not None:
                raise
            log.warning("remote: %s has no manifest any more (emptied, or the store lost it); "
                        "checking the objects of step %d again before publishing anew",
                        self.remote.url, upload.record.step)
            self._read_remote_manifest()  # an empty one, which the next publish creates
            return Phase.UPLOAD
        self.remote_manifest = manifest
        kept = {s.dir for s in manifest.snapshots}
        self.remote.remove(sorted({d.dir for d in dropped} - kept))
        return Phase.DONE

    def _check_published(self, upload: _Upload) -> Phase:
        manifest = read_manifest(self.remote)
        if any(s.dir == upload.record.dir for s in manifest.snapshots):
            return Phase.DONE
        return Phase.SKIPPED if self.queue else Phase.WATCH

    def _read_remote_manifest(self) -> Manifest:
        manifest = read_manifest(self.remote)
        if self.rank == 0:
            self.remote_manifest = manifest  # what every publish is conditional on
        if manifest.snapshots:
            self.remote_step = manifest.snapshots[-1].step
        return manifest

    def _catch_up(self) -> None:
        """At start: read the bucket's manifest (rank 0 before anyone else could change it), and
        queue the local directory's newest snapshot if the bucket lacks it (an earlier engine
        closed, or died, before uploading it)."""
        remote = {s.dir for s in self._read_remote_manifest().snapshots}
        local = read_manifest(self.local).snapshots
        if local and local[-1].dir not in remote and local[-1].world_size == self.world_size:
            self.queue.appendleft((local[-1], self.clock()))
            self.pending_since = self.clock()
        self._caught_up = True

    def _closure(self, record: SnapshotRecord) -> tuple[SnapshotRecord, ...]:
        """The committed snapshots ``record`` refers to (transitively) that the bucket's manifest
        does not name, oldest first (a reference is always to an earlier commit)."""
        if not record.refers:
            return ()
        local = {s.dir: s for s in read_manifest(self.local).snapshots}
        remote = {s.dir for s in self.remote_manifest.snapshots}
        needed, todo = {}, list(record.refers)
        while todo:
            d = todo.pop()
            if d in remote or d in needed or d not in local:
                continue
            needed[d] = local[d]
            todo += local[d].refers
        return tuple(sorted(needed.values(), key=lambda s: s.seq))

    # --- running steps on the executor -------------------------------------------------------

    def _run(self, step: Callable, *args) -> None:
        self._future = self._submit(step, *args)

    def _collect(self, now: float) -> bool:
        """Take the result of the step that ran; False while one still runs."""
        future = self._future
        if future is None:
            return True
        if not future.done():
            return False
        self._future = None
        try:
            phase = future.result()
        except RemoteConflictError as e:
            self.stopped, self.last_error = e, str(e)
            log.error("remote: %s; this engine no longer uploads", e)
            self._report()
            return False
        except (CheckpointError, OSError) as e:
            self._failed(now, e)
            return True
        self.failures, self.failing_since, self.retry_at = 0, None, 0.0
        upload = self.current
        if upload is not None and phase is not None:
            self._advance(upload, phase, now)
        self._report()
        return True

    def _advance(self, upload: _Upload, phase: Phase, now: float) -> None:
        if phase in (Phase.DONE, Phase.SKIPPED):
            self.current = None
            if phase is Phase.DONE:
                self.remote_step = upload.record.step
                self.pending_since = self.queue[0][1] if self.queue else None
                log.info("remote: step %d is in %s (%.1f s after its local commit)",
                         upload.record.step, self.remote.url, now - upload.started)
            else:
                self.skipped += 1
        else:
            if phase != upload.phase:
                upload.waited_since = now
            upload.phase = phase

    def _failed(self, now: float, error: Exception) -> None:
        self.failures += 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self.failures - 1))
        self.retry_at = now + delay
        if self.failing_since is None:
            self.failing_since = now
        self.last_error = f"{type(error).__name__}: {error}"
        log.warning("remote: %s (attempt %d; retrying in %.1f s; local snapshots keep "
                    "committing)", self.last_error, self.failures, delay)
        self._report()

    def _report(self) -> None:
        pending = [r for r, _ in self.queue] + ([self.current.record] if self.current else [])
        self.send(RemoteStatus(
            remote_step=self.remote_step, pending_since=self.pending_since,
            pending_bytes=sum(r.shard_of(self.rank).bytes for r in pending),
            uploaded_bytes=self.uploaded_bytes, upload_retries=self.failures,
            upload_skipped=self.skipped, last_error=self.last_error, conflict=self.stopped,
            rejected=self.rejected, rejections=self.rejections))


def _uploaded(record: SnapshotRecord, rank: int, present: dict[str, int]) -> bool:
    """Whether rank ``rank``'s shard of ``record`` is in the bucket (``present``: name -> size):
    with the size the record gives, where it lists that rank's shard."""
    shard = record.shard_of(rank)
    name = shard_file_name(rank)
    return name in present and (shard is None or present[name] == shard.bytes)


def run_in_thread(step: Callable, *args) -> Future:
    """Run ``step(*args)`` in a daemon thread: a transfer still running when the trainer closes
    the engine does not keep the writer process from exiting (what is not uploaded stays local,
    and the next engine uploads it)."""
    future: Future = Future()

    def target() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(step(*args))
            except BaseException as e:
                future.set_exception(e)

    threading.Thread(target=target, name="async_ckpt-upload", daemon=True).start()
    return future
