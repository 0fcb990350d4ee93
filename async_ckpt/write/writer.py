"""The writer process: turns staged snapshots into durable, committed files.

The training process starts it once per engine as ``python -m async_ckpt.write.writer`` (a fresh
interpreter: never a fork of a CUDA process, and unlike multiprocessing's spawn it does not re-import
the user's ``__main__``), through ``client.WriterClient``. It never imports torch. The two talk over
a Unix socketpair in the typed messages of ``protocol.py``, whose docstring lists them in order.

For each job the writer encodes and writes the shard, releases the buffer, fsyncs, and hands the
attempt to its commit stage (``commit.py``: rank 0 commits, the other ranks watch for the commit;
when the ranks share no directory, each commits its own shard into its own root, and the remote
tier commits the job's snapshot).
When the training process dies the socket closes; the writer finishes the jobs already queued
(their bytes are staged and whole) and exits. With a remote tier (``upload.py``) each commit
is handed to the uploader, which the loop drives too; after ``Close`` what is not uploaded stays
local, while a writer whose trainer died goes on uploading (``upload.ORPHAN_UPLOAD_S``).
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import mmap
import os
import signal
import stat
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle
from typing import BinaryIO, Callable, Iterator, Optional, Union

import psutil

from .commit import POLL_INTERVAL_S, Attempt, Committer, CommitStage, CommitWatcher, failure
from .protocol import (Attach, Close, Committed, Detach, Drop, Dropped, Failed, JobOutcome, Marker,
                       Ready, Released, ShardFigures, SnapshotJob, WriterConfig,
                       WriterEvent)
from .upload import Uploader
from ..errors import CheckpointError, DiskFullError, LayoutError, SnapshotWriteError
from ..format.records import Chunk, DataFile, Replica
from ..format.references import References
from ..format.native import Derived, NativeFile, write_committed
from ..format.shard import (CHUNK_BYTES, ChunkEncoder, ShardReader, ShardWriter, checksum,
                            reference_to, tensor_table, version_needed)
from ..storage.local import (Content, Linked, LocalStorage, atomic_directory, atomic_write,
                             make_dirs, remove_tree)
from ..storage.remote import ObjectStorage
from ..storage.locks import join_rank_lock
from ..format.manifest import ShardRecord, read_manifest
from ..storage.names import MAX_DATA_FILES, data_file_name, shard_file_name
from ..format.layout import Plan, Region, shard_layout, ShardLayout

log = logging.getLogger(__name__)

ENCODE_WORKERS = 2
"""Threads that encode and checksum chunks while the writer writes earlier ones: with zstd the
encoding overlaps the disk instead of taking turns with it (see format.shard.ShardWriter)."""


CLOSED, GONE = "closed", "gone"  # how the trainer's side ended (SnapshotWriter.receive)


class SnapshotWriter:
    """The writer process's state: attached buffers, the current plan and shard layout, and the
    commit stage (rank 0 commits, the other ranks watch for the commit)."""

    def __init__(self, conn: Connection, config: WriterConfig):
        self.conn = conn
        self.trainer_pid = os.getppid()  # the trainer started this process
        self.root = config.root
        self.storage = LocalStorage(self.root, config.direct_io)
        self.rank = config.rank
        self.world_size = config.world_size
        self.spread_replicated = config.spread_replicated
        self.reserve_bytes = config.reserve_bytes
        self.encoder = ChunkEncoder(config.compression, config.level)
        self.buffers: dict[int, mmap.mmap] = {}
        self.plan: Optional[Plan] = None
        self.layout: Optional[ShardLayout] = None
        self.stored_ratio = 1.0
        self.commit_timeout = config.commit_timeout
        # by job: its snapshot directory and markers, written once it is committed
        self.markers: dict[int, tuple[str, tuple[Marker, ...]]] = {}
        # by job: the data files its shard keeps its storages in, by the Derived each is
        self.data_files: dict[int, dict[Derived, str]] = {}
        # Drops received while snapshots taken before them were still waiting for the other
        # ranks' shards (rank 0's commit stage): each with the jobs it waits for, in order
        self.drops: list[tuple[frozenset[int], Drop]] = []
        self.unlaid: set[Derived] = set()  # the framework files a bug kept from being data files
        self.uploader = None if config.remote is None else Uploader(
            self.storage, ObjectStorage(config.remote, config.remote_options), self.rank,
            self.world_size, config.remote_keep_last, config.keep_every, self.send)
        on_commit = self.uploader.committed if self.uploader else None
        self.own_root = config.own_root
        self.commit: CommitStage = (
            Committer(self.storage, self.world_size, config.keep_last, config.keep_every,
                      config.commit_timeout, self.send, on_commit=on_commit,
                      keep=self.uploader.protected if self.uploader else None,
                      own_root=self.rank if self.own_root else None)
            if self.rank == 0 or self.own_root
            else CommitWatcher(self.storage, config.commit_timeout, self.send,
                               on_commit=on_commit, outlives_trainer=self.markers.__contains__))

    def serve(self) -> None:
        """Handle the trainer's messages; between them, let the commit stage and the uploader
        poll. Once the trainer is gone, poll until the commit stage has nothing pending and the
        uploads are done (or given up); once it closed, stop uploading."""
        ended = None
        trainer = _process_handle(self.trainer_pid)
        watched = [self.conn] + ([trainer] if trainer is not None else [])
        while ended is None or self.commit.pending or self._uploading(ended):
            polling = bool(self.commit.pending) or self._uploading(ended)
            if ended is not None:
                time.sleep(POLL_INTERVAL_S)
            else:
                ready = wait(watched, POLL_INTERVAL_S if polling else None)
                if self.conn in ready:
                    ended = self.receive()
                elif ready:  # the trainer is gone, though processes it forked (data loader
                    ended = GONE  # workers) may keep the socket open a while longer
            if self.commit.pending:
                self.commit.poll(ended is not None)
            self.apply_drops()
            if self._uploading(ended):
                self.uploader.poll()

    def _uploading(self, ended: Optional[str]) -> bool:
        """Whether the uploader has work to be driven: not after ``Close``, and once the trainer
        died only until the uploads have failed for ``ORPHAN_UPLOAD_S``."""
        return (self.uploader is not None and self.uploader.busy and ended != CLOSED
                and not (ended == GONE and self.uploader.gave_up()))

    def receive(self) -> Optional[str]:
        """Handle one message: None while the trainer is there, ``CLOSED`` once it sent
        ``Close``, ``GONE`` once it died (or closed the connection)."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            return GONE
        match message:
            case Attach(buffer_id, nbytes):
                try:
                    fd = recv_handle(self.conn)
                except (EOFError, OSError):
                    return GONE  # the trainer died between the message and its fd
                self.buffers[buffer_id] = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
                os.close(fd)
            case Detach(buffer_id):
                self.buffers.pop(buffer_id).close()
            case SnapshotJob():
                self.handle(message)
            case Drop():
                self.drops.append((frozenset(a.job for a in self.commit.pending), message))
                self.apply_drops()
            case Close():
                return CLOSED
            case _:
                raise TypeError(f"the writer got an unknown message {message!r}")
        return None

    def apply_drops(self) -> None:
        """Apply the drops whose earlier snapshots are settled (committed, or given up), in the
        order they came: a drop queued right after a save (``drop(wait=False)``: the snapshot a
        framework's file named before that save replaced it) goes only once that save is
        committed, never leaving the file naming nothing while the other ranks still write.
        With one rank every snapshot is settled before the next message is read."""
        pending = {a.job for a in self.commit.pending}
        while self.drops and not self.drops[0][0] & pending:
            _, drop = self.drops.pop(0)
            self.send(_unlink(drop.files) or self.commit.drop(drop.steps))

    def send(self, event: WriterEvent) -> None:
        """Tell the trainer; a job's markers are written first, once it is committed."""
        if isinstance(event, JobOutcome):  # nothing of the job is kept past its outcome
            data_files = self.data_files.pop(event.job, {})
            directory, markers = self.markers.pop(event.job, (None, ()))
            if isinstance(event, Committed) and markers:
                event = _write_markers(event, markers, functools.partial(
                    self.derive, directory), data_files, self.commit_timeout)
        try:
            self.conn.send(event)
        except OSError:
            pass  # the trainer died; still finish and commit what it staged

    def handle(self, job: SnapshotJob) -> None:
        if job.markers:
            self.markers[job.job] = (job.dir, job.markers)
        if job.plan is not None:
            self.plan = job.plan
            self.layout = shard_layout(self.plan, self.rank, self.world_size, self.spread_replicated)
        step, buffer_id = job.step, job.buffer_id
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.send(Released(buffer_id, step))

        try:
            attempt = self.write(job, memoryview(self.buffers[buffer_id]), release)
        except Exception as e:  # a failed snapshot must not stop the writer; the trainer decides
            release()
            self.send(Failed(job.job, failure(e, "writing", f"step {step}")))
            return
        self.commit.add(attempt)  # rank 0 commits; the others watch for it

    def write(self, job: SnapshotJob, buf: memoryview, release) -> Attempt:
        """Write and fsync this rank's shard of one snapshot under its final name; calls
        ``release`` once the staging buffer is no longer read."""
        step, plan, layout = job.step, self.plan, self.layout
        t_start = time.monotonic()
        refer = dict(job.refer)
        regions = [plan.regions[i] for i in layout.written]
        raw_bytes = sum(r.nbytes for r in regions)
        referred_bytes = sum(plan.regions[i].nbytes for i in refer)
        self.check_space(raw_bytes - referred_bytes)
        natives = self.native_files(job, regions)
        # The directory must be durable before our shard's final name is: rank 0 commits on names.
        self.storage.make_snapshot_dir(job.dir)
        sink = self.storage.create_shard(job.dir, shard_file_name(self.rank))
        shard = ShardWriter(sink, self.encoder, version=version_needed(
                                layout.uses_references, bool(refer), bool(job.dtensors),
                                any(r.nbytes for n, r in zip(layout.written, regions)
                                    if n not in refer), bool(natives),
                                # compressed chunks go through bounce buffers: nothing to align
                                sink.direct and self.encoder.compression is None),
                            workers=ENCODE_WORKERS)
        data_bytes = 0
        hashing = [0.0]  # CPU seconds of the checksums computed on this thread
        try:
            with References(self.storage,
                            read_manifest(self.storage).snapshots if refer else ()) as references:
                stored_elsewhere, files = self.write_data_files(job, natives, buf, regions,
                                                                references, hashing)
                data_bytes = sum(f.size for f in files)
                for n, (region, fields) in enumerate(zip(regions, layout.replica_fields)):
                    if n in stored_elsewhere:
                        shard.add_stored(region.nbytes, region.itemsize, region.is_float,
                                         stored_elsewhere[n], **fields)
                    elif layout.written[n] in refer:
                        holder = refer[layout.written[n]]
                        shard.add_reference(region.nbytes, region.itemsize, region.is_float,
                                            reference_to(self.referred(references, holder, n,
                                                                       region), holder,
                                                         shard_file_name(self.rank), n))
                    else:
                        shard.add_storage(buf[region.offset:region.offset + region.nbytes],
                                          region.itemsize, region.is_float,
                                          None if job.checksums is None
                                          else job.checksums[layout.written[n]], **fields)
            shard.flush()  # every chunk is read: only then may the buffer be released
            hashing_started = time.thread_time()
            replicas = [Replica(entry, owner, plan.regions[i].nbytes,
                                checksum(buf[plan.regions[i].offset:
                                             plan.regions[i].offset + plan.regions[i].nbytes]))
                        for i, entry, owner in layout.replicas]
            hashing[0] += time.thread_time() - hashing_started
            release()
            t_written = time.monotonic()
            size, index_digest = shard.finish({
                "step": step, "rank": self.rank, "world_size": self.world_size,
                "created": time.time(), "tensors": list(layout.tensors), "tree": job.tree,
                **({"replicas": [r.to_json() for r in replicas]} if replicas else {}),
                **({"dtensors": [d.to_json() for d in job.dtensors]} if job.dtensors else {}),
                **({"files": [f.to_json() for f in files]} if files else {})})
        except BaseException:
            shard.abort()
            if self.world_size == 1 or self.own_root:  # a shared directory: rank 0 cleans
                self.storage.remove([job.dir])
            raise
        t_durable = time.monotonic()
        if not refer:  # a shard with references says little about how well the state encodes
            self.stored_ratio = (size + data_bytes) / max(raw_bytes, 1)
        return Attempt(job=job.job, step=step, dir=job.dir,
                       shard=ShardRecord(self.rank, shard_file_name(self.rank), size, index_digest),
                       replicas=replicas, raw_bytes=raw_bytes, figures=ShardFigures(
                           queue_s=t_start - job.submitted, write_s=t_written - t_start,
                           fsync_s=t_durable - t_written,
                           encode_cpu_s=shard.encode_cpu_s + hashing[0],
                           shard_bytes=size + data_bytes,
                           referred_bytes=referred_bytes, direct=sink.direct),
                       refers=tuple(sorted(set(refer.values()))), durable_at=t_durable,
                       data_bytes=data_bytes)

    def native_files(self, job: SnapshotJob, regions: list[Region]) -> list[NativeFile]:
        """The framework files of the job's markers that its shard can keep its storages in (a
        framework file is then the snapshot's bytes, linked after the commit, and nothing is
        written twice). A file the snapshot cannot be written as is left to ``derive``, whose
        error the marker reports; so is one whose layout fails on a bug (warned once per file):
        the snapshot keeps its state in the shard, as without the marker."""
        if job.job not in self.markers:
            return []
        _, markers = self.markers[job.job]
        wanted = dict.fromkeys(c for m in markers
                               for c in ([m.content] if m.files is None else
                                         [c for _, c in m.files]) if isinstance(c, Derived))
        where = f"the snapshot of step {job.step}"
        sizes = [r.nbytes for r in regions]
        natives = []
        for derived in wanted:
            try:  # the records the shard's index will hold, as a reader will see them
                natives.append(NativeFile(sizes, tensor_table(list(self.layout.tensors), where,
                                                              sizes), job.tree, derived, where))
            except LayoutError:
                continue
            except Exception as e:  # a bug: the snapshot is written all the same
                if derived not in self.unlaid:
                    self.unlaid.add(derived)
                    log.warning("cannot lay out the %s file of %s (step %d) as a data file, on a "
                                "bug (%s: %s); its state stays in the shard, and the file is made "
                                "from the committed snapshot. Please report it with this log",
                                derived.format, f"entry {derived.entry!r}" if derived.entry
                                else "the state", job.step, type(e).__name__, e, exc_info=e)
        return natives[:MAX_DATA_FILES]

    def write_data_files(self, job: SnapshotJob, natives: list[NativeFile], buf: memoryview,
                         regions: list[Region], references: References, hashing: list[float]
                         ) -> tuple[dict[int, list[Chunk]], list[DataFile]]:
        """Write the shard's data files (``native_files``) from the staging buffer, durably;
        returns the chunks of each storage kept in one (by storage number, each storage in the
        first file that holds it whole, never one referred to an earlier snapshot) and the
        index's ``files`` table; the CPU seconds of their checksums are added to
        ``hashing[0]``."""
        refer, written = dict(job.refer), self.layout.written
        chunks: dict[int, list[Chunk]] = {}
        files, paths = [], {}
        for number, native in enumerate(natives):
            name = data_file_name(self.rank, number, native.derived.format)
            kept = {n: [] for n in native.whole if n not in chunks and written[n] not in refer}
            chunks.update(kept)
            with self.storage.create_data_file(job.dir, name) as out:
                def pieces(n: int) -> Iterator[memoryview]:
                    if written[n] in refer:  # unchanged: not staged, read from where it is
                        return self.referred(references, refer[written[n]], n,
                                             regions[n]).storage_pieces(n)
                    return _recorded(buf[regions[n].offset:regions[n].offset + regions[n].nbytes],
                                     regions[n].itemsize, out, number, kept.get(n), hashing)
                native.write(out, pieces)
                files.append(DataFile(name, out.finish()))
            paths[native.derived] = self.storage.location(job.dir, name)
        self.data_files[job.job] = paths
        return chunks, files

    def referred(self, references: References, holder: str, n: int,
                 region: Region) -> ShardReader:
        """This rank's shard of committed snapshot ``holder``, whose storage ``n`` the trainer
        says stored ``region`` unchanged with the same plan (so at the same storage number):
        refused unless the manifest names it and the storage fits, before a byte of it is read
        (into a data file) or referred to."""
        target = references.open(holder, self.rank)
        if target.held_storage(n, region.nbytes, region.itemsize) is None:
            raise SnapshotWriteError(f"storage {n} of {target.path} is not the unchanged region "
                                     "the trainer referred to; the snapshot was not written")
        return target

    def derive(self, directory: str, derived: Derived) -> Callable[[BinaryIO], None]:
        """What writes ``derived`` of this rank's shard of the committed snapshot ``directory``
        to a file, read back from the shard (and what it refers to) and verified."""
        def write(out: BinaryIO) -> None:
            manifest = read_manifest(self.storage)
            record = next((s for s in manifest.snapshots if s.dir == directory), None)
            if record is None:
                raise SnapshotWriteError(f"{directory} was dropped before the files made from "
                                         "it were written")
            with References(self.storage, manifest.snapshots) as references:
                write_committed(out, references, record, self.rank, derived)
        return write

    def check_space(self, raw_bytes: int) -> None:
        """Refuse a snapshot that cannot fit before writing a byte of it."""
        need = int(raw_bytes * self.stored_ratio * 1.05) + self.reserve_bytes
        free = self.storage.free_bytes()
        if free < need:
            raise DiskFullError(
                f"not enough space for a snapshot in {self.root}: about {need / 1e6:.0f} MB needed "
                f"(incl. the {self.reserve_bytes / 1e6:.0f} MB reserve), {free / 1e6:.0f} MB free. "
                "Free space or lower keep_last; committed snapshots are intact")


class _Process:
    """A process to ``wait()`` on: its pidfd becomes readable when it exits."""

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def _process_handle(pid: int) -> Optional[_Process]:
    """A handle on process ``pid`` for ``wait()``, or None where pidfds are not available
    (Linux before 5.3): then the trainer's death is noticed when its socket closes."""
    try:
        return _Process(os.pidfd_open(pid))
    except (AttributeError, OSError):
        return None


def _unlink(files: tuple[str, ...]) -> Optional[Dropped]:
    """Delete the files a Drop names, a ``Marker``'s directory with what it holds (links are
    removed, never followed; gone already: fine); the failed Drop when one cannot be."""
    for path in files:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                remove_tree(path)  # logs what it cannot remove: then the check below fails
                if os.path.lexists(path):
                    raise OSError(errno.ENOTEMPTY, "not everything in it could be deleted")
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            return Dropped((), SnapshotWriteError(
                f"cannot delete {path} ({e.strerror}); the snapshots to drop with it are kept"))
    return None


def _recorded(data: memoryview, itemsize: int, out: BinaryIO, file: int,
              chunks: Optional[list[Chunk]], hashing: list[float]) -> Iterator[memoryview]:
    """``data`` in chunks as the shard cuts them; with ``chunks``, each also recorded there as a
    raw chunk of data file ``file`` at the position ``out`` has when it is handed out (where the
    file's writer writes it), the CPU seconds of its checksum added to ``hashing[0]``."""
    step = CHUNK_BYTES - CHUNK_BYTES % itemsize
    for start in range(0, len(data), step):
        piece = data[start:start + step]
        if chunks is not None:
            started = time.thread_time()
            digest = checksum(piece)
            hashing[0] += time.thread_time() - started
            chunks.append(Chunk(out.tell(), len(piece), len(piece), "raw", digest, file=file))
        yield piece


def _write_markers(committed: Committed, markers: tuple[Marker, ...],
                   derive: Callable[[Derived], Callable[[BinaryIO], None]],
                   data_files: dict[Derived, str], timeout: float) -> WriterEvent:
    """Write the markers of a committed snapshot (``derive(d)`` writes ``Derived`` d to a file;
    one its shard keeps as a data file is linked from ``data_files``), each once the files it
    comes ``after`` are in place (waiting up to ``timeout`` seconds for them); the event to
    send: ``committed``, or Failed when a marker could not be written (the snapshot stays
    committed, but whoever looks for the marker will not see it)."""
    def content(c: Union[bytes, Derived]) -> Content:
        if isinstance(c, Derived):
            return Linked(data_files[c], derive(c)) if c in data_files else derive(c)
        return c

    for marker in markers:
        try:
            _wait_for_files(marker.after, time.monotonic() + timeout)
            if marker.files is None:
                make_dirs(os.path.dirname(marker.path))
                atomic_write(marker.path, content(marker.content))
            else:
                atomic_directory(marker.path, [(name, content(c)) for name, c in marker.files])
        except (OSError, CheckpointError) as e:
            log.error("could not write %s: %s", marker.path, e)
            advice = (" Check that its directory is writable" if isinstance(e, OSError) else "")
            return Failed(committed.job, SnapshotWriteError(
                f"the snapshot was committed, but {marker.path} could not be written "
                f"({getattr(e, 'strerror', None) or e}): what looks for it will not find it."
                f"{advice}"))
        except Exception as e:  # a bug: the snapshot stays committed, and the writer serves on
            return Failed(committed.job, failure(e, "writing", f"{marker.path}, made from a "
                                                 "committed snapshot,"))
    return committed


def _wait_for_files(after: tuple[tuple[str, bytes], ...], deadline: float) -> None:
    """Return once every (path, record) of ``after`` is a regular file keeping that record;
    SnapshotWriteError naming the first one missing at ``deadline`` (monotonic)."""
    waiting = list(after)
    while True:
        waiting = [(path, record) for path, record in waiting if _record_of(path) != record]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise SnapshotWriteError(f"{waiting[0][0]}, which another rank's writer makes from the "
                                     "same snapshot, never appeared")
        time.sleep(POLL_INTERVAL_S)


def _record_of(path: str) -> Optional[bytes]:
    """The record the ``Derived`` torch file at ``path`` keeps; None when there is none (or no
    regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return Marker.record_in(f)


def _lower_priority(nice: int, io_idle: bool) -> None:
    if nice:
        os.nice(nice)
    if io_idle:
        try:
            psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
        except (psutil.Error, OSError, AttributeError) as e:
            log.debug("could not lower I/O priority: %s", e)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    config = conn.recv()
    if not isinstance(config, WriterConfig):
        raise TypeError(f"the writer's first message must be its WriterConfig, not {config!r}")
    # A terminal's Ctrl-C or a scheduler's SIGTERM reaches the whole process group; the writer
    # finishes what the trainer staged and exits when the trainer closes the socket (or dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format=f"async_ckpt writer[rank {config.rank}] %(levelname)s %(message)s")
    _lower_priority(config.nice, config.low_io_priority)
    join_rank_lock(config.lock)  # held until exit: no other engine cleans up under our feet
    conn.send(Ready(os.getpid()))
    SnapshotWriter(conn, config).serve()


if __name__ == "__main__":
    main()
