"""Following an incremental snapshot's references to the earlier snapshots that hold its bytes.

A storage of a version-3 shard may be a reference (``ref``, docs/FORMAT.md 3.4) to a storage of
the same rank's shard in an earlier committed snapshot. The names in it come from an untrusted
file: they were matched against the patterns of ``storage.names`` when the index was validated, and
here the directory must also be one the manifest names, committed before the referencing
snapshot and listed in its ``refers`` (so retention keeps it), and the target must be the very
storage that was referred to (``shard.check_reference``). Anything else is damage of the
referencing snapshot. The writer (to refer), the restore path and ``verify`` all open targets
here, so they never disagree about what a reference means.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import CorruptSnapshotError
from ..storage.base import Storage
from .manifest import SnapshotRecord
from ..storage.names import shard_file_name
from .records import StorageEntry
from .shard import ShardReader, check_reference


class References:
    """Opens shards of the committed snapshots ``records`` (the manifest's), each once: the
    snapshot being read and those its references point at."""

    def __init__(self, storage: Storage, records: Iterable[SnapshotRecord]):
        self.storage = storage
        self._records: dict[str, SnapshotRecord] = {}
        self._readers: dict[tuple[str, int], ShardReader] = {}
        self.add(records)

    def add(self, records: Iterable[SnapshotRecord]) -> None:
        """Also open shards of ``records`` (read the manifest only once a reference needs it)."""
        self._records.update((s.dir, s) for s in records)

    def open(self, directory: str, rank: int) -> ShardReader:
        """``rank``'s shard of the committed snapshot ``directory``, its size and index checked
        against the manifest."""
        key = (directory, rank)
        if key not in self._readers:
            record = self._records.get(directory)
            shard = None if record is None else next(
                (s for s in record.shards if s.rank == rank), None)
            if shard is None:
                raise CorruptSnapshotError(f"{directory} is not a committed snapshot with a shard "
                                           f"of rank {rank}")
            reader = ShardReader(self.storage.open_shard(directory, shard.file), shard.bytes,
                                 shard.index_xxh3)
            try:
                reader.check_step(record.step)
            except CorruptSnapshotError:
                reader.close()
                raise
            self._readers[key] = reader
        return self._readers[key]

    def resolve(self, referencing: SnapshotRecord, rank: int, entry: StorageEntry,
                where: str) -> tuple[ShardReader, int]:
        """The shard and storage number holding the bytes of reference ``entry``, found in
        ``rank``'s shard of ``referencing``."""
        ref = entry.ref
        assert ref is not None
        target = self._records.get(ref.dir)
        if target is None or target.seq >= referencing.seq or ref.dir not in referencing.refers:
            raise CorruptSnapshotError(
                f"{where} refers to {ref.dir}, which is not a committed snapshot that step "
                f"{referencing.step} lists among those it refers to")
        if ref.file != shard_file_name(rank):
            raise CorruptSnapshotError(f"{where} refers to {ref.file}, another rank's shard")
        reader = self.open(ref.dir, rank)
        return reader, check_reference(entry, reader, where)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> "References":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
