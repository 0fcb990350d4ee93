"""What the training process and its writer process say to each other, as typed messages.

The messages travel pickled over the socketpair the trainer creates for its own writer: both ends
are our own processes, never data read from a checkpoint directory, so unpickling them runs no code
that anyone else wrote. Errors cross as ``CheckpointError`` objects (``Failed.error``), so the
trainer raises the very class the writer saw and ``isinstance`` keeps working for subclasses.
The writer's settings cross once, as the first message (``WriterConfig``): never on its command
line, which every user of the machine can read, since they may hold the object store's keys.

  trainer -> writer: WriterConfig; then Attach (then the memfd itself), Detach, SnapshotJob, Drop,
                     Close
  writer -> trainer: Ready once started; then per job Released, and one ``JobOutcome``:
                     Committed, Abandoned or Failed; per Drop, Dropped; with a remote tier,
                     RemoteStatus whenever the upload moves on
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import BinaryIO, Optional, Union

from ..errors import CheckpointError
from ..format.layout import Plan
from ..format.native import Derived, read_record
from ..format.records import DTensorPiece
from ..storage.names import REPLACEMENT_FILE


@dataclass(frozen=True)
class WriterConfig:
    """The writer process's settings, fixed for its lifetime: the options' (``EngineOptions.
    writer_settings``, their one declaration, so none has a default here) and the session's."""

    root: str
    rank: int
    world_size: int
    spread_replicated: bool
    commit_timeout: float
    keep_last: int
    keep_every: Optional[int]
    compression: Optional[str]
    level: int
    reserve_bytes: int
    nice: int
    low_io_priority: bool
    lock: str  # this rank's lock file, which the writer joins (storage/locks.py)
    log_level: int
    remote: Optional[str]  # the object store's URL (write/upload.py), if any
    remote_options: Optional[dict]  # its settings, credentials perhaps
    remote_keep_last: int
    own_root: bool  # the ranks share no directory: ``root`` is this rank's alone
    direct_io: bool  # shards written with direct I/O where the file system allows it


# --- trainer -> writer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Attach:
    """A staging buffer of ``nbytes``; its memfd follows on the socket (``send_handle``), and the
    writer maps it read-only."""

    buffer_id: int
    nbytes: int


@dataclass(frozen=True)
class Detach:
    """The trainer replaced the buffer (the state outgrew it); the writer unmaps it, which frees
    the memory once the trainer has closed it too."""

    buffer_id: int


@dataclass(frozen=True)
class Marker:
    """What a snapshot makes visible outside the checkpoint directory once it is committed, and
    never before: a file ``path`` holding ``content``, or, given ``files``, a directory ``path``
    holding those (name, content) pairs. A content is bytes, or a ``Derived``: the snapshot (or
    an entry of it) in a framework's file format, made from the committed shard
    (``format/native.py``). The writer writes it atomically and durably right after the commit,
    even when the trainer is gone by then. For code that finds checkpoints by their files (a
    framework's own resume: a Lightning ``.ckpt`` path, a ``checkpoint-N`` directory) and for
    what its users do with those files.

    ``after``: (path, record) of ``Derived`` torch files that other ranks' writers make from the
    same snapshot once they learn of its commit; this marker is written only once each of them
    is in place keeping that record (a framework's "latest" file that names a checkpoint every
    rank writes part of), and fails if one is still missing after the writer's
    ``commit_timeout``."""

    path: str  # absolute
    content: Union[bytes, Derived] = b""
    files: Optional[tuple[tuple[str, Union[bytes, Derived]], ...]] = None
    after: tuple[tuple[str, bytes], ...] = ()

    @staticmethod
    def is_being_written(name: str) -> bool:
        """Whether the file name ``name`` is a marker file's replacement the writer is still
        writing (``NAME.tmp-PID``, renamed over ``NAME`` once whole; left behind when the writer
        was killed in between): it names nothing, the file it becomes or replaces does."""
        return REPLACEMENT_FILE.fullmatch(name) is not None

    @staticmethod
    def record_in(file: BinaryIO) -> Optional[bytes]:
        """The record a ``Derived`` torch file keeps, from the file open as ``file``; None for
        any other file (one ``torch.save`` wrote, one that is not in torch's format). The file
        is untrusted: only its archive directory and that record are read, boundedly."""
        return read_record(file)


@dataclass(frozen=True)
class SnapshotJob:
    """Write the snapshot staged in buffer ``buffer_id`` into directory ``dir`` of the root."""

    job: int  # the trainer's number for this snapshot, echoed in the answers
    step: int
    buffer_id: int
    dir: str
    tree: dict  # the state tree (docs/FORMAT.md), stored in the shard's index
    plan: Optional[Plan]  # None: the same plan as the previous job's
    submitted: float  # time.monotonic() in the trainer: the writer's queue time starts here
    # Incremental snapshots: (region, dir) for each region not staged because it is unchanged
    # since committed snapshot ``dir`` stored it (same plan); the shard refers to it there.
    refer: tuple[tuple[int, str], ...] = ()
    # Sharded tensors: the index's ``dtensors`` records (docs/FORMAT.md 3.6), in tree order.
    dtensors: tuple[DTensorPiece, ...] = ()
    markers: tuple[Marker, ...] = ()  # written once the snapshot is committed
    # By region of the plan: its chunk checksums, made as it was staged (None: not made, the
    # writer makes them); taken where a chunk is stored raw, so the slot is not read for them.
    checksums: Optional[tuple[Optional[tuple[str, ...]], ...]] = None


@dataclass(frozen=True)
class Drop:
    """Take these committed steps out of the manifest and delete their snapshots (what a kept
    snapshot refers to stays): retention decided by the caller (a framework's own), applied by
    the writer, which alone writes the manifest, once the snapshots sent before it are settled.
    ``files`` (absolute paths, a framework's files or ``Marker`` directories that stand for
    snapshots: the reverse of ``Marker``) are deleted first, in the same turn, so that a kill
    leaves both or neither."""

    steps: tuple[int, ...]
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Close:
    """The trainer is done: finish what is staged, then exit."""


# --- writer -> trainer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The writer has started and holds its share of this rank's lock (``storage/locks.py``).

    From here on the lock stays held until the writer has finished, even if the trainer dies."""

    pid: int


@dataclass(frozen=True)
class Released:
    """The writer no longer reads buffer ``buffer_id``: the trainer may stage into it again."""

    buffer_id: int
    step: int


@dataclass(frozen=True)
class JobOutcome:
    """How job ``job`` ended: exactly one outcome is sent per job, and the trainer forgets it."""

    job: int


@dataclass(frozen=True)
class ShardFigures:
    """What writing this rank's shard of one snapshot cost, measured by the writer
    (``write/writer.py``): seconds queued, writing and making it durable (the index written and
    every file fsynced); CPU seconds of every checksum and of compression, summed over the
    threads that computed them during ``write_s`` (so possibly more than ``write_s``); bytes
    written, and bytes not written because an earlier snapshot holds them (incremental); and
    whether the shard went to the disk with direct I/O (False where ``direct_io`` is off or its
    file system refused it)."""

    queue_s: float = 0.0
    write_s: float = 0.0
    fsync_s: float = 0.0
    encode_cpu_s: float = 0.0
    shard_bytes: int = 0
    referred_bytes: int = 0
    direct: bool = False


@dataclass(frozen=True)
class CommitFigures:
    """A committed snapshot as its writer saw it: ``shard``'s figures, then the commit's
    (``write/commit.py``). ``committed_at`` is the writer's ``time.monotonic()`` at the commit;
    ``wait_ranks_s`` (waiting for the other ranks' shards) and ``dropped_steps`` (retention)
    only where this rank committed it: rank 0, else None. ``CheckpointEngine.stats()`` reports
    them under these names (``as_dict``)."""

    shard: ShardFigures
    committed_at: float
    commit_s: float
    raw_bytes: int
    stored_bytes: int
    disk_free_bytes: int
    wait_ranks_s: Optional[float] = None
    dropped_steps: Optional[tuple[int, ...]] = None

    def as_dict(self) -> dict:
        """The figures by name, flat, those this rank has none of left out."""
        figures = {**asdict(self.shard), "committed_at": self.committed_at,
                   "commit_s": self.commit_s, "raw_bytes": self.raw_bytes,
                   "stored_bytes": self.stored_bytes, "disk_free_bytes": self.disk_free_bytes}
        if self.wait_ranks_s is not None:
            figures["wait_ranks_s"] = self.wait_ranks_s
        if self.dropped_steps is not None:
            figures["dropped_steps"] = list(self.dropped_steps)
        return figures


@dataclass(frozen=True)
class Committed(JobOutcome):
    """In the manifest; ``figures``: its timings and sizes (see ``stats()``)."""

    figures: CommitFigures


@dataclass(frozen=True)
class Abandoned(JobOutcome):
    """Given up because some rank never finished its shard: not an error of this rank, so it is
    logged and counted, not raised."""

    message: str


@dataclass(frozen=True)
class Failed(JobOutcome):
    """Writing or committing it failed; the trainer raises ``error`` at its next call.

    The error object itself crosses (a ``CheckpointError`` pickles with its class and message),
    so the trainer raises the class the writer saw, subclasses included."""

    error: CheckpointError


@dataclass(frozen=True)
class Dropped:
    """The answer to a Drop: the steps taken out of the manifest (the others it named were not
    in it, or a kept snapshot refers to them), or the error that kept the manifest unchanged."""

    steps: tuple[int, ...]
    error: Optional[CheckpointError] = None


@dataclass(frozen=True)
class RemoteStatus:
    """Where this rank's uploads stand (``write/upload.py``), sent whenever that changes.

    ``remote_step``: the newest step the bucket's manifest names, as this rank knows;
    ``pending_since``: the writer's ``time.monotonic()`` at the local commit of the oldest
    snapshot not uploaded (None: none); ``pending_bytes`` of this rank's shards still to upload;
    ``upload_retries``: failures in a row; ``last_error``: text, kept after a success;
    ``conflict``: the error that stopped uploading for good (another engine publishes to the
    bucket); ``rejected`` and ``rejections``: the error of the last snapshot whose shards failed
    the checks before publication, and how many have."""

    remote_step: Optional[int] = None
    pending_since: Optional[float] = None
    pending_bytes: int = 0
    uploaded_bytes: int = 0
    upload_retries: int = 0
    upload_skipped: int = 0
    last_error: Optional[str] = None
    conflict: Optional[CheckpointError] = None
    rejected: Optional[CheckpointError] = None
    rejections: int = 0


TrainerMessage = Union[Attach, Detach, SnapshotJob, Drop, Close]
WriterEvent = Union[Ready, Released, Committed, Abandoned, Failed, Dropped, RemoteStatus]
