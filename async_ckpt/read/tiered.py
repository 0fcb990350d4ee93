"""A local checkpoint directory backed by an object store, as restore reads it.

``TieredStorage(local, remote)`` answers reads the way ``restore()`` needs them with a remote
tier: the manifest is that of the tier whose newest snapshot was committed last (the bucket's on a
fresh node, or when this node's directory fell behind it; the local one while uploads lag; always
the bucket's when the ranks share no directory, since a rank's own root holds only its shards), and
a shard is opened from the local directory when it is there, else downloaded into it first
(ranged GETs in parallel, into a ``*.partial`` file renamed once whole: the local directory is a
cache of what was read, and a shard's chunks are verified as every read verifies them), its data
files first (format version 6: those its index names, read from the store and checked against
the manifest's checksum of it; a local copy already of their size is kept). So each rank
downloads only the shards it reads. An object whose size is not the one the manifest records is
damage before a byte of it is downloaded. Writes go to the local directory.
"""

from __future__ import annotations

import logging
from typing import Hashable, Iterable, Optional, Type

from ..errors import CheckpointError, CorruptSnapshotError, RemoteStorageError
from ..format.manifest import Manifest, ShardRecord, read_manifest
from ..format.shard import ShardReader
from ..storage.base import DataFileSink, ShardSink, ShardSource, Storage
from ..storage.local import LocalStorage
from ..storage.remote import ObjectStorage

log = logging.getLogger(__name__)


class TieredStorage(Storage):
    """``local`` first, ``remote`` for what it lacks; see the module docstring."""

    def __init__(self, local: LocalStorage, remote: ObjectStorage):
        self.local, self.remote = local, remote
        self.manifest_tier, manifest = self._newest_tier()
        self._shards = _shard_records(manifest)

    def _newest_tier(self) -> tuple[Storage, Manifest]:
        """The tier whose manifest's newest snapshot was committed last, and that manifest. A
        store that cannot be read leaves the local tier, logged (a job resumes from its own disk
        when it can), unless the local one cannot restore the job by itself (a rank's own root)
        or holds nothing (starting from scratch could drop what the store holds): then it is a
        RemoteStorageError. A damaged local manifest leaves the remote one."""
        try:
            remote = read_manifest(self.remote)
        except CheckpointError as e:
            local = read_manifest(self.local)
            if local.rank is not None or not local.snapshots:
                raise RemoteStorageError(
                    f"cannot read the manifest of {self.remote.location()} ({e}), and "
                    f"{self.local.location()} " + (
                        "holds only this rank's shards (the ranks share no directory)"
                        if local.rank is not None else "holds no snapshot") +
                    ": restoring now could start over from an older state than the store "
                    "holds. Restart once the store can be read (check the URL, credentials and "
                    "endpoint)") from e
            log.warning("cannot read the remote manifest (%s); restoring from %s only", e,
                        self.local.location())
            return self.local, local
        try:
            local = read_manifest(self.local)
        except CheckpointError as e:
            log.warning("%s; restoring from %s", e, self.remote.location())
            return self.remote, remote
        newest = [m.snapshots[-1].committed_at if m.snapshots else -1.0 for m in (local, remote)]
        if local.rank is not None:
            return self.remote, remote
        if newest[1] > newest[0]:
            log.info("the newest committed snapshot is in %s (step %d); restoring from there",
                     self.remote.location(), remote.snapshots[-1].step)
            return self.remote, remote
        return self.local, local

    def location(self, *names: str) -> str:
        return self.manifest_tier.location(*names)

    def read_file(self, name: str, limit: int, error: Type[CheckpointError]) -> bytes:
        return self.manifest_tier.read_file(name, limit, error)

    def version(self, name: str) -> Optional[Hashable]:
        return self.manifest_tier.version(name)

    def open_shard(self, dir: str, file: str) -> ShardSource:
        local = dict(self.local.list_snapshot(dir))
        if file in local:
            return self.local.open_shard(dir, file)
        if (dir, file) not in self._shards:  # committed since this restore read the manifest
            self._shards = _shard_records(read_manifest(self.manifest_tier))
        record = self._shards.get((dir, file))
        if record is None:
            raise CorruptSnapshotError(f"{self.remote.location(dir, file)} is not a shard the "
                                       "manifest names")
        # its data files first (format version 6), as its index (checked against the manifest)
        # names them: a local shard has them beside it
        with ShardReader(self.remote.open_shard(dir, file), record.bytes,
                         record.index_xxh3) as reader:
            files = reader.data_files
        for name, size in (*files, (file, record.bytes)):
            if local.get(name) != size and not self._keep_copy(dir, name, size):
                return self.remote.open_shard(dir, file)  # read from the store, data files
                # too (ShardSource.sibling)
        return self.local.open_shard(dir, file)

    def _keep_copy(self, dir: str, file: str, size: int) -> bool:
        """Download ``dir/file`` into the local directory; False when no local copy can be kept
        (another rank downloads it now, or no room)."""
        try:
            self.local.make_snapshot_dir(dir)
            sink = self.local.create_shard(dir, file)
        except FileExistsError:  # another rank downloads it now: read it from the store
            return False
        except OSError as e:  # no room for a cache copy: read it from the store
            log.warning("cannot keep a local copy of %s (%s); reading it from the store",
                        self.remote.location(dir, file), e.strerror)
            return False
        try:
            self.remote.download(dir, file, sink, size)
            sink.finish()
        except BaseException:
            sink.abort()
            raise
        return True

    def list_snapshot(self, dir: str) -> tuple[tuple[str, int], ...]:
        return self.manifest_tier.list_snapshot(dir)

    def list_root(self) -> list[str]:
        return self.manifest_tier.list_root()

    def entry_bytes(self, name: str) -> int:
        return self.manifest_tier.entry_bytes(name)

    def exists(self, name: str) -> bool:
        return self.local.exists(name) or self.remote.exists(name)

    # Writes go to the local directory: the writer process owns the remote tier.

    def make_snapshot_dir(self, dir: str) -> None:
        self.local.make_snapshot_dir(dir)

    def create_shard(self, dir: str, file: str) -> ShardSink:
        return self.local.create_shard(dir, file)

    def create_data_file(self, dir: str, file: str) -> DataFileSink:
        return self.local.create_data_file(dir, file)

    def sync_snapshot(self, dir: str) -> None:
        self.local.sync_snapshot(dir)

    def publish(self, name: str, data: bytes) -> None:
        self.local.publish(name, data)

    def remove(self, names: Iterable[str]) -> None:
        self.local.remove(names)

    def free_bytes(self) -> int:
        return self.local.free_bytes()


def _shard_records(manifest: Manifest) -> dict[tuple[str, str], ShardRecord]:
    """(snapshot directory, shard file) -> its record in ``manifest``."""
    return {(s.dir, shard.file): shard for s in manifest.snapshots for shard in s.shards}
