"""The storage seam: every byte the writer, the committer, the watcher and the reader move goes
through a ``Storage``, so that a new backend (an object store) is one more implementation.

A storage is one checkpoint root. Names are relative to it: a snapshot directory ``dir`` (or the
manifest) at the top, a file inside one as ``(dir, file)``. Every name is a single path component
that the caller has already checked against ``storage.names`` (names read from files pass
``checked_name`` first); implementations never interpret separators.

Call order of one snapshot, and what each step guarantees when it returns:

1. writer of every rank: ``make_snapshot_dir(dir)``: the directory exists, and keeps existing after
   a power cut.
2. (format version 6) ``create_data_file(dir, file)`` -> ``DataFileSink`` for each data file of
   the shard, written in place and ``finish()``ed: durable before the shard names it.
   ``create_shard(dir, file)`` -> ``ShardSink``; ``write(buffers)`` as often as needed
   (``settle()``: none of their memory is read any more); then
   ``finish()``: the bytes are durable under ``file``, which no reader could see before (a rank's
   final name is its promise to the committer). ``abort()`` instead leaves no trace of the file.
3. rank 0's committer: ``list_snapshot(dir)`` until every rank's final name is there;
   ``sync_snapshot(dir)`` (what the other ranks' ``finish`` made visible is durable here too);
   ``open_shard`` to check each index; ``publish(MANIFEST, bytes)``: the commit point, atomic (a
   crash leaves the old or the new manifest, whole) and durable; only then ``remove`` of what the
   new manifest no longer names.
4. the other ranks' watchers: ``version(MANIFEST)`` to notice a new manifest cheaply,
   ``read_file`` to read it, ``exists(dir)`` to notice a directory rank 0 gave up.
5. readers: ``read_file(MANIFEST)``, then ``open_shard`` -> ``ShardSource`` for byte ranges.

Errors: a missing file raises FileNotFoundError where a method says so; other I/O failures raise
OSError (the caller turns it into the library's typed error, e.g. ENOSPC into DiskFullError).
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from typing import Callable, ContextManager, Hashable, Iterable, Optional, Type

from ..errors import CheckpointError, UnsupportedFormatError

UNCOUNTED_SPACE = 1 << 62
"""The free space of a storage that keeps no count of it (a bucket; a ramfs or a FUSE file
system that reports a size of 0): large enough that no space check refuses a snapshot."""

DIRECT_ALIGNMENT = 4096
"""What direct I/O (``O_DIRECT``) is aligned to: file offsets, lengths and memory addresses of the
writes that go from memory to the disk without a copy. A multiple of every logical block size in
common use (512, 4096); a file system that needs more is written through the page cache. Staging
slots place large storages at multiples of it (``format.layout``), and shards (format version 7,
docs/FORMAT.md 3.4) their first chunks."""


class ShardSink(ABC):
    """A file being written as a stream. Not visible under its final name until ``finish``."""

    direct = False
    """Whether it writes with direct I/O: a shard then aligns storages for it (format 7)."""

    @abstractmethod
    def write(self, buffers: Iterable) -> None:
        """Append every byte of each buffer, in order. A sink that writes from the buffers' memory
        in the background (direct I/O) may return while they are still read: they must stay
        unchanged until ``settle``, ``finish`` or ``abort`` returns."""

    def settle(self) -> None:
        """Return once no buffer given to ``write`` is read any more (its bytes are written)."""

    def writes_directly(self, data) -> bool:
        """Whether ``data``, appended at a multiple of ``DIRECT_ALIGNMENT``, is written from its
        own memory straight to the disk (direct I/O): a shard then places it there."""
        return False

    @abstractmethod
    def finish(self) -> None:
        """Make the bytes durable and only then visible under the final name; closes the sink."""

    @abstractmethod
    def abort(self) -> None:
        """Close and discard what was written; harmless after ``finish`` or a previous ``abort``."""


class DataFileSink(ABC):
    """A shard's new data file (docs/FORMAT.md 3.8), written under its final name by a framework
    format's writer, as a file: ``write``, ``tell``, ``seek`` (it goes back to complete a
    header: a zip's), ``flush``; then ``finish``. A context manager: leaving it closes the
    file (what is not finished is the shard's to never name)."""

    @abstractmethod
    def write(self, data) -> int:
        """Write ``data`` (any buffer) at the position; returns its length."""

    @abstractmethod
    def tell(self) -> int:
        """The position."""

    @abstractmethod
    def seek(self, offset: int, whence: int = 0) -> int:
        """Move the position, as ``os.lseek``; returns it."""

    def flush(self) -> None:
        """Nothing is buffered here."""

    @abstractmethod
    def finish(self) -> int:
        """Make the file durable; returns its size."""

    @abstractmethod
    def close(self) -> None:
        """Release the file."""

    def __enter__(self) -> "DataFileSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardSource(ABC):
    """A file opened for random reads. ``name`` says where it is, for messages; ``size`` is its
    size when opened."""

    name: str
    size: int
    linked = False
    """Whether the file has other names (hard links) when opened, through which a program may
    rewrite or truncate it in place while it is read (a framework's file linked to a data
    file)."""

    @abstractmethod
    def read_into(self, buffer, offset: int) -> int:
        """Fill ``buffer`` (writable) from ``offset`` on, like ``preadv``: returns the bytes read,
        fewer than asked only at the end of the file."""

    def map(self) -> Optional[mmap.mmap]:
        """A private mapping of the whole file (writes to it never reach the file), or None where
        this storage cannot map: readers then read into memory of their own. Mapping lets a
        restore verify and copy a file the page cache holds without reading it into a second
        buffer first. The file must not shrink while mapped (access past its end is SIGBUS)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the file; harmless when already closed. A mapping outlives it."""

    def sibling(self, name: str) -> "ShardSource":
        """The file ``name`` (a checked name) of the same snapshot directory, for reading: a
        shard's data files (docs/FORMAT.md 3.8). Storages that do not keep data files say so."""
        raise UnsupportedFormatError(f"{self.name} keeps its chunks in a data file ({name}), "
                                     "which this storage does not read; read the snapshot from "
                                     "the local directory that wrote it")

    def siblings(self) -> tuple[tuple[str, int], ...]:
        """The (name, size) of every file of the same snapshot directory, as
        ``Storage.list_snapshot`` gives them: what bounds the index of a shard whose data files
        are among them (``format.shard.ShardReader``). Empty where the storage does not list."""
        return ()


class Storage(ABC):
    """One checkpoint root. See the module docstring for the call order and the guarantees."""

    @abstractmethod
    def location(self, *names: str) -> str:
        """Where the root (no names), an entry of it or a file in one is, as a user should read it
        in a message."""

    @abstractmethod
    def make_snapshot_dir(self, dir: str) -> None:
        """Create snapshot directory ``dir`` durably. Several ranks race to create the same one;
        each returns only once the directory's existence is durable, whoever created it."""

    @abstractmethod
    def create_shard(self, dir: str, file: str) -> ShardSink:
        """A sink for a new file ``file`` in ``dir``; never overwrites or exposes a file there."""

    @abstractmethod
    def create_data_file(self, dir: str, file: str) -> DataFileSink:
        """A sink for the new data file ``file`` of a shard of ``dir`` (format version 6),
        written in place under its final name: the shard that names it is made durable after
        it. A storage that cannot write a file in place refuses (SnapshotWriteError)."""

    @abstractmethod
    def list_snapshot(self, dir: str) -> tuple[tuple[str, int], ...]:
        """The (name, size) of every entry in ``dir``, sorted; empty when ``dir`` is gone. Sizes
        only need to change when an entry does (the committer notes progress by them)."""

    @abstractmethod
    def sync_snapshot(self, dir: str) -> None:
        """Make durable the entries that other processes' ``finish`` created in ``dir``."""

    @abstractmethod
    def open_shard(self, dir: str, file: str) -> ShardSource:
        """``file`` in ``dir`` for reading. A shard that is missing or is not a regular file is
        damage: CorruptSnapshotError."""

    @abstractmethod
    def read_file(self, name: str, limit: int, error: Type[CheckpointError]) -> bytes:
        """The whole file ``name``, refused with ``error`` when larger than ``limit`` bytes (before
        reading it) or not a regular file. FileNotFoundError when it is missing."""

    @abstractmethod
    def publish(self, name: str, data: bytes) -> None:
        """Replace file ``name`` with ``data`` atomically and durably: readers and a crash see
        the old content or the new, whole, never neither."""

    @abstractmethod
    def version(self, name: str) -> Optional[Hashable]:
        """A token that changes whenever ``name`` is replaced (None when it is missing): lets a
        poller skip re-reading an unchanged file."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether an entry ``name`` is there, whatever it is."""

    @abstractmethod
    def list_root(self) -> list[str]:
        """The names of the root's entries, sorted."""

    @abstractmethod
    def entry_bytes(self, name: str) -> int:
        """Bytes of the root entry ``name``: a file's size, or everything a directory holds (at
        any depth); 0 when it is gone. What removing it frees, as tools report it."""

    @abstractmethod
    def remove(self, names: Iterable[str]) -> None:
        """Delete the named root entries (a directory with what it holds); missing ones are fine.
        Only names of ours (``storage.names.is_ours``) are deleted; others are logged and kept."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Bytes a new snapshot can still use (``UNCOUNTED_SPACE`` where the storage keeps no
        count)."""

    def exclude_engines(self) -> Optional[ContextManager[Callable[[], None]]]:
        """A context manager that keeps every engine and writer out of this root while it is
        held (DirectoryInUseError when one is active) and yields a function that checks again
        (for engines started since); None where the storage cannot tell whether an engine writes
        to it (an object store has no locks)."""
        return None
