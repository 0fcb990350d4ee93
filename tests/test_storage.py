"""The storage seam (storage/base.py): LocalStorage's spec, operation by operation, and an in-memory
Storage that the committer, the watcher, the manifest functions and the reader run against
unchanged, which shows that every byte they move goes through the seam."""

import argparse
import ctypes
import errno
import json
import os
import re
import shutil
import time
import types

import pytest

from async_ckpt.errors import CorruptSnapshotError, ManifestError, SnapshotWriteError
from async_ckpt.format.manifest import (Manifest, ShardRecord, leftovers, read_manifest,
                                        recover_manifest, write_manifest)
from async_ckpt.storage.names import MANIFEST_NAME, PARTIAL_SUFFIX, is_ours, shard_file_name
from async_ckpt.format.shard import ChunkEncoder, ShardReader, ShardWriter
from async_ckpt.read.snapshot import read_snapshot
from async_ckpt.storage.base import UNCOUNTED_SPACE, ShardSink, ShardSource, Storage
from async_ckpt.storage import local
from async_ckpt.storage.local import LocalStorage
from async_ckpt.tools import gc, inspect, ls, verify
from async_ckpt.tools.common import EXIT_OK, UsageError
from async_ckpt.write.commit import Attempt, Committer, CommitWatcher
from async_ckpt.write.protocol import Committed, ShardFigures

SNAP = "step-00000000000000000007.0000abcd"
SHARD = shard_file_name(0)


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(tmp_path / "ckpt")


def made(storage, data=b"shard bytes", snapshot=SNAP, file=SHARD) -> None:
    storage.make_snapshot_dir(snapshot)
    sink = storage.create_shard(snapshot, file)
    sink.write([data])
    sink.finish()


# --- LocalStorage ---------------------------------------------------------------------------------


def test_location_joins_names_under_the_root(storage):
    assert storage.location() == storage.root
    assert storage.location(SNAP, SHARD) == os.path.join(storage.root, SNAP, SHARD)


def test_a_snapshot_directory_is_made_durably_and_the_root_synced_when_it_was_there(storage, fsynced):
    storage.make_snapshot_dir(SNAP)
    assert os.path.isdir(storage.location(SNAP))
    assert fsynced[-1] == storage.root  # its parent, after creating it (and the missing root)
    fsynced.clear()
    storage.make_snapshot_dir(SNAP)  # another rank made it: it may not have fsynced the root yet
    assert fsynced == [storage.root]


def test_a_shard_is_invisible_under_its_final_name_until_finished(storage, fsynced):
    storage.make_snapshot_dir(SNAP)
    sink = storage.create_shard(SNAP, SHARD)
    assert isinstance(sink, ShardSink)
    sink.write([b"abc", memoryview(b"defg"), bytearray(b"h")])
    assert storage.list_snapshot(SNAP) == ((SHARD + PARTIAL_SUFFIX, 8),)
    fsynced.clear()
    sink.finish()
    assert storage.list_snapshot(SNAP) == ((SHARD, 8),)
    assert fsynced == [storage.location(SNAP)]  # the rename is durable
    with open(storage.location(SNAP, SHARD), "rb") as f:
        assert f.read() == b"abcdefgh"
    sink.abort()  # after finish: harmless
    assert storage.list_snapshot(SNAP) == ((SHARD, 8),)


def test_an_aborted_shard_leaves_nothing(storage):
    storage.make_snapshot_dir(SNAP)
    sink = storage.create_shard(SNAP, SHARD)
    sink.write([b"half"])
    sink.abort()
    sink.abort()
    assert storage.list_snapshot(SNAP) == ()


def test_a_shard_is_never_written_over_a_file_already_there(storage):
    storage.make_snapshot_dir(SNAP)
    storage.create_shard(SNAP, SHARD).abort()
    with open(storage.location(SNAP, SHARD + PARTIAL_SUFFIX), "wb") as f:
        f.write(b"someone else's")
    with pytest.raises(FileExistsError):
        storage.create_shard(SNAP, SHARD)


def test_a_shard_is_written_in_pieces_of_at_most_the_piece_size(storage, monkeypatch):
    pieces = []
    real = local.write_all
    monkeypatch.setattr(local, "write_all", lambda fd, data: (pieces.append(len(data)), real(fd, data)))
    data = os.urandom(local.WRITE_PIECE_BYTES * 2 + 5)
    made(storage, data)
    assert pieces == [local.WRITE_PIECE_BYTES, local.WRITE_PIECE_BYTES, 5]
    with open(storage.location(SNAP, SHARD), "rb") as f:
        assert f.read() == data


class _RecordedSyncFileRange:
    """A stand-in for libc's sync_file_range that records its calls and can fail."""

    def __init__(self, fail_with=None):
        self.calls, self.fail_with = [], fail_with

    def __call__(self, fd, offset, length, flags):
        self.calls.append((offset, length, flags))
        if self.fail_with is not None:
            ctypes.set_errno(self.fail_with)
            return -1
        return 0


def test_write_back_starts_each_window_and_waits_for_the_one_before(monkeypatch, tmp_path):
    recorded = _RecordedSyncFileRange()
    monkeypatch.setattr(local, "_sync_file_range", recorded)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        write_back = local.WriteBack(fd, window=100)
        for end in (60, 120, 150, 240, 330, 340):
            write_back.wrote(end)
    finally:
        os.close(fd)
    start, wait = 2, 1 | 2 | 4
    assert recorded.calls == [(0, 120, start), (120, 120, start), (0, 120, wait),
                              (240, 100, start), (120, 120, wait)]


def test_write_back_stops_where_unsupported_and_raises_real_errors(monkeypatch, tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        unsupported = _RecordedSyncFileRange(errno.EINVAL)
        monkeypatch.setattr(local, "_sync_file_range", unsupported)
        write_back = local.WriteBack(fd, window=10)
        write_back.wrote(10)
        write_back.wrote(20)
        assert len(unsupported.calls) == 1  # gave up after the first refusal: fsync does it all
        monkeypatch.setattr(local, "_sync_file_range", _RecordedSyncFileRange(errno.EIO))
        with pytest.raises(OSError) as failed:
            local.WriteBack(fd, window=10).wrote(10)
        assert failed.value.errno == errno.EIO
    finally:
        os.close(fd)


def test_the_real_sync_file_range_is_found_and_accepted_here(storage):
    assert local._sync_file_range is not None  # Linux and glibc: the CI machine's
    data = os.urandom(3 * 1000)
    storage.make_snapshot_dir(SNAP)
    sink = storage.create_shard(SNAP, SHARD)
    write_back = sink._writes._write_back = local.WriteBack(sink._fd, window=1000)
    sink.write([data])
    assert write_back._enabled and write_back._started == 3000
    sink.finish()
    with open(storage.location(SNAP, SHARD), "rb") as f:
        assert f.read() == data


def test_listing_is_sorted_and_empty_for_what_is_not_a_directory(storage, tmp_path):
    made(storage, b"12345", file=shard_file_name(1))
    made(storage, b"1", file=shard_file_name(0))
    os.symlink(tmp_path / "nowhere", storage.location(SNAP, "dangling"))  # does not break it
    listed = storage.list_snapshot(SNAP)
    assert [name for name, _ in listed] == ["dangling", shard_file_name(0), shard_file_name(1)]
    assert listed[1:] == ((shard_file_name(0), 1), (shard_file_name(1), 5))
    assert storage.list_snapshot("step-00000000000000000008.0000abcd") == ()  # gone
    os.symlink(storage.location(SNAP), storage.location("step-00000000000000000009.0000abcd"))
    assert storage.list_snapshot("step-00000000000000000009.0000abcd") == ()  # a link
    storage.publish(MANIFEST_NAME, b"{}")
    assert storage.list_snapshot(MANIFEST_NAME) == ()  # a file


def test_sync_snapshot_fsyncs_the_directory(storage, fsynced):
    storage.make_snapshot_dir(SNAP)
    fsynced.clear()
    storage.sync_snapshot(SNAP)
    assert fsynced == [storage.location(SNAP)]


def test_an_opened_shard_reads_byte_ranges_like_preadv(storage):
    made(storage, b"0123456789")
    source = storage.open_shard(SNAP, SHARD)
    assert isinstance(source, ShardSource)
    assert source.size == 10 and source.name == storage.location(SNAP, SHARD)
    buf = bytearray(4)
    assert source.read_into(buf, 3) == 4 and buf == b"3456"
    assert source.read_into(buf, 8) == 2 and buf[:2] == b"89"  # short only at the end
    assert source.read_into(buf, 10) == 0
    source.close()
    source.close()


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "symlink-to-dir"])
def test_a_shard_that_is_not_a_regular_file_is_damage(storage, tmp_path, kind):
    storage.make_snapshot_dir(SNAP)
    path = storage.location(SNAP, SHARD)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)  # opening it for reading would block forever without O_NONBLOCK
    elif kind == "symlink-to-dir":
        os.symlink(tmp_path, path)
    with pytest.raises(CorruptSnapshotError, match=re.escape(path)):
        storage.open_shard(SNAP, SHARD)


def test_a_small_file_is_read_whole_within_its_limit(storage):
    with pytest.raises(FileNotFoundError):
        storage.read_file(MANIFEST_NAME, 100, ManifestError)
    storage.make_snapshot_dir(SNAP)  # creates the root
    storage.publish(MANIFEST_NAME, b"x" * 100)
    assert storage.read_file(MANIFEST_NAME, 100, ManifestError) == b"x" * 100
    with pytest.raises(ManifestError, match="more than the 99"):
        storage.read_file(MANIFEST_NAME, 99, ManifestError)
    os.unlink(storage.location(MANIFEST_NAME))
    os.mkfifo(storage.location(MANIFEST_NAME))
    with pytest.raises(ManifestError):
        storage.read_file(MANIFEST_NAME, 100, ManifestError)


def test_publish_replaces_and_changes_the_version(storage, fsynced):
    storage.make_snapshot_dir(SNAP)
    assert storage.version(MANIFEST_NAME) is None
    storage.publish(MANIFEST_NAME, b"old")
    first = storage.version(MANIFEST_NAME)
    assert first is not None and storage.version(MANIFEST_NAME) == first  # stable while unchanged
    fsynced.clear()
    storage.publish(MANIFEST_NAME, b"new")
    assert storage.version(MANIFEST_NAME) != first
    assert storage.read_file(MANIFEST_NAME, 10, ManifestError) == b"new"
    assert fsynced == [storage.root]  # the replacement is durable
    assert storage.list_root() == [MANIFEST_NAME, SNAP]  # no temporary file left


def test_publish_is_atomic_a_failed_replace_leaves_the_old_file(storage, monkeypatch):
    storage.make_snapshot_dir(SNAP)
    storage.publish(MANIFEST_NAME, b"old")

    def crash(src, dst):  # as if the power went between the durable write and the replace
        raise OSError(5, "simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        storage.publish(MANIFEST_NAME, b"new")
    assert storage.read_file(MANIFEST_NAME, 10, ManifestError) == b"old"
    assert storage.list_root() == [MANIFEST_NAME, SNAP]


def test_exists_counts_any_entry_even_a_dangling_link(storage, tmp_path):
    storage.make_snapshot_dir(SNAP)
    assert storage.exists(SNAP) and not storage.exists(MANIFEST_NAME)
    os.symlink(tmp_path / "nowhere", storage.location(MANIFEST_NAME))
    assert storage.exists(MANIFEST_NAME) and storage.version(MANIFEST_NAME) is None


def test_remove_deletes_only_our_names_and_never_follows_links(storage, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"x")
    made(storage)
    os.symlink(outside, storage.location("step-00000000000000000008.0000abcd"))
    with open(storage.location("notes.txt"), "w") as f:
        f.write("keep")
    storage.remove([SNAP, "step-00000000000000000008.0000abcd", "notes.txt", "..",
                    "step-00000000000000000009.0000abcd"])  # the last one is not there: fine
    assert storage.list_root() == ["notes.txt"]
    assert (outside / "precious").read_bytes() == b"x"


def test_free_bytes_is_the_file_systems(storage):
    storage.make_snapshot_dir(SNAP)
    assert abs(storage.free_bytes() - shutil.disk_usage(storage.root).free) < 1 << 30


def test_a_file_system_that_reports_no_size_is_not_taken_for_a_full_one(storage, monkeypatch):
    """ramfs and some FUSE file systems report a total and a free space of 0: they keep no
    count, and a snapshot there must not fail the writer's space check."""
    monkeypatch.setattr(local.shutil, "disk_usage", 
                        lambda path: types.SimpleNamespace(total=0, used=0, free=0))
    assert storage.free_bytes() == UNCOUNTED_SPACE
    monkeypatch.setattr(local.shutil, "disk_usage", 
                        lambda path: types.SimpleNamespace(total=8, used=8, free=0))
    assert storage.free_bytes() == 0  # a full one


# --- an in-memory Storage: the seam is real ---------------------------------------------------------


class MemorySink(ShardSink):
    def __init__(self, files: dict, file: str):
        self.files, self.file, self.data = files, file, bytearray()

    def write(self, buffers) -> None:
        for b in buffers:
            self.data += b

    def finish(self) -> None:
        self.files[self.file] = bytes(self.data)

    def abort(self) -> None:
        self.data = bytearray()


class MemorySource(ShardSource):
    def __init__(self, name: str, data: bytes):
        self.name, self.size, self.data = name, len(data), data

    def read_into(self, buffer, offset: int) -> int:
        view = memoryview(buffer).cast("B")
        got = self.data[offset:offset + len(view)]
        view[:len(got)] = got
        return len(got)

    def close(self) -> None:
        pass


class MemoryStorage(Storage):
    """Snapshot directories and root files in dicts; a version is a publication count."""

    def __init__(self):
        self.dirs: dict[str, dict[str, bytes]] = {}
        self.files: dict[str, bytes] = {}
        self.published = 0

    def location(self, *names):
        return "memory:/" + "/".join(names)

    def make_snapshot_dir(self, dir):
        self.dirs.setdefault(dir, {})

    def create_shard(self, dir, file):
        return MemorySink(self.dirs[dir], file)

    def create_data_file(self, dir, file):
        raise SnapshotWriteError("no data files in memory")

    def list_snapshot(self, dir):
        return tuple(sorted((name, len(data)) for name, data in self.dirs.get(dir, {}).items()))

    def sync_snapshot(self, dir):
        pass

    def open_shard(self, dir, file):
        if file not in self.dirs.get(dir, {}):
            raise CorruptSnapshotError(f"{self.location(dir, file)} is missing")
        return MemorySource(self.location(dir, file), self.dirs[dir][file])

    def read_file(self, name, limit, error):
        if name not in self.files:
            raise FileNotFoundError(name)
        if len(self.files[name]) > limit:
            raise error(f"{name} is too large")
        return self.files[name]

    def publish(self, name, data):
        self.files[name] = bytes(data)
        self.published += 1

    def version(self, name):
        return self.published if name in self.files else None

    def exists(self, name):
        return name in self.files or name in self.dirs

    def list_root(self):
        return sorted([*self.files, *self.dirs])

    def entry_bytes(self, name):
        return len(self.files.get(name, b"")) + sum(map(len, self.dirs.get(name, {}).values()))

    def remove(self, names):
        for name in filter(is_ours, names):
            self.dirs.pop(name, None)
            self.files.pop(name, None)

    def free_bytes(self):
        return 1 << 40


TREE = {"kind": "dict", "entries": {"answer": {"kind": "value", "state": 42}}}


def write_memory_shard(storage: Storage, snapshot: str, rank: int, step: int) -> ShardRecord:
    storage.make_snapshot_dir(snapshot)
    writer = ShardWriter(storage.create_shard(snapshot, shard_file_name(rank)), ChunkEncoder("zstd"))
    writer.add_storage(memoryview(bytes([rank]) * 4096), 1, False)
    size, digest = writer.finish({"step": step, "rank": rank, "world_size": 2,
                                  "created": time.time(), "tensors": [], "tree": TREE})
    return ShardRecord(rank, shard_file_name(rank), size, digest)


def test_the_commit_stage_and_the_reader_run_on_any_storage():
    storage = MemoryStorage()
    rank0_events, rank1_events = [], []
    committer = Committer(storage, 2, keep_last=1, keep_every=None, commit_timeout=60,
                          send=rank0_events.append)
    watcher = CommitWatcher(storage, commit_timeout=60, send=rank1_events.append)
    steps = {7: "step-00000000000000000007.0000abcd", 8: "step-00000000000000000008.0000abcd"}
    for job, (step, snapshot) in enumerate(steps.items()):
        ours = write_memory_shard(storage, snapshot, 0, step)
        committer.add(Attempt(job=job, step=step, dir=snapshot, shard=ours, replicas=[],
                              raw_bytes=4096, figures=ShardFigures()))
        assert rank0_events[job:] == [] and read_manifest(storage).find(step) is None
        theirs = write_memory_shard(storage, snapshot, 1, step)
        watcher.add(Attempt(job=job, step=step, dir=snapshot, shard=theirs, replicas=[],
                            raw_bytes=4096, figures=ShardFigures()))
        committer.poll(trainer_gone=False)
        watcher.poll(trainer_gone=False)
        assert [type(e) for e in rank0_events[job:]] == [Committed]
        assert [type(e) for e in rank1_events[job:]] == [Committed] and watcher.pending == []
    manifest = read_manifest(storage)
    assert manifest.steps() == [8] and storage.list_root() == [MANIFEST_NAME, steps[8]]  # kept 1
    record = manifest.find(8)
    for rank in (0, 1):
        assert read_snapshot(storage, record, rank).plain() == {"answer": 42}
        with ShardReader(storage.open_shard(record.dir, shard_file_name(rank))) as reader:
            assert reader.verify() == [] and reader.path == storage.location(record.dir,
                                                                             shard_file_name(rank))


def test_the_manifest_functions_run_on_any_storage():
    storage = MemoryStorage()
    assert read_manifest(storage) == Manifest() and recover_manifest(storage) == Manifest()
    for rank in (0, 1):
        write_memory_shard(storage, SNAP, rank, 7)
    storage.make_snapshot_dir("step-00000000000000000009.0000abcd")  # interrupted: no shards
    recovered = recover_manifest(storage)  # no manifest, a complete snapshot: rebuilt, written
    assert recovered.steps() == [7] and read_manifest(storage) == recovered
    assert leftovers(storage, recovered) == ["step-00000000000000000009.0000abcd"]
    write_manifest(storage, Manifest())
    assert read_manifest(storage) == Manifest()
    storage.files[MANIFEST_NAME] = b"not json"
    with pytest.raises(ManifestError, match=re.escape(storage.location(MANIFEST_NAME))):
        read_manifest(storage)


def test_the_commands_run_on_any_storage(capsys):
    """ls, inspect, verify and gc on a Storage that no path names: the commands reach a
    checkpoint only through the seam (tests/test_cli_remote.py shows the same for a bucket)."""
    storage = MemoryStorage()
    committer = Committer(storage, 2, keep_last=10, keep_every=None, commit_timeout=60,
                          send=lambda event: None)
    snapshots = {step: f"step-{step:020d}.0000abcd" for step in (7, 8, 9)}
    for job, step in enumerate((7, 8)):
        ours, _ = [write_memory_shard(storage, snapshots[step], rank, step) for rank in (0, 1)]
        committer.add(Attempt(job=job, step=step, dir=snapshots[step], shard=ours, replicas=[],
                              raw_bytes=4096, figures=ShardFigures()))
        committer.poll(trainer_gone=False)
    storage.make_snapshot_dir(snapshots[9])  # an interrupted snapshot: a leftover
    assert ls.cmd_ls(argparse.Namespace(dir=storage, json=True)) == EXIT_OK
    listed = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in listed["snapshots"]] == [7, 8]
    assert [s["name"] for s in listed["leftovers"]] == [snapshots[9]]
    assert verify.cmd_verify(argparse.Namespace(dir=storage, step=None, all=True)) == EXIT_OK
    assert inspect.cmd_inspect(argparse.Namespace(dir=storage, step=7, rank=1)) == EXIT_OK
    assert "answer" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--force"):  # no locks: gc cannot tell who writes
        gc.cmd_gc(argparse.Namespace(dir=storage, keep_last=1, dry_run=False, force=False))
    assert gc.cmd_gc(argparse.Namespace(dir=storage, keep_last=1, dry_run=False,
                                        force=True)) == EXIT_OK
    assert read_manifest(storage).steps() == [8]
    assert storage.list_root() == [MANIFEST_NAME, snapshots[8]]


def test_heartbeats_are_the_local_directorys_own_files(storage):
    """Written atomically by rank; read back by name, skipping what is not a readable file."""
    assert storage.heartbeats() == []  # the directory does not exist yet
    os.makedirs(storage.root)
    storage.write_heartbeat(3, b'{"rank": 3}')
    storage.write_heartbeat(3, b'{"rank": 3, "step": 1}')  # replaced
    storage.write_heartbeat(1, b'{"rank": 1}')
    os.mkfifo(storage.location("heartbeat.rank00002.json"))  # would block a plain open
    os.mkdir(storage.location("heartbeat.rank00004.json"))
    assert storage.heartbeats() == [b'{"rank": 1}', b'{"rank": 3, "step": 1}']
