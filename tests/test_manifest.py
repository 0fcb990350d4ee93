"""The root manifest and the durability helpers under it: retention, atomic replace, leftovers.

Everything is written under ``tmp_path``; failures are injected by monkeypatching fsutil.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat

import pytest

from async_ckpt.storage.local import LocalStorage
from async_ckpt.storage import local as fsutil
from async_ckpt.errors import (CheckpointDirError, DiskFullError, ManifestError, SnapshotWriteError,
                               UnsupportedFormatError)
from async_ckpt.format import values
from async_ckpt.format.manifest import (Manifest, ShardRecord, SnapshotRecord, leftovers, read_manifest,
                                 write_manifest)
from async_ckpt.storage.names import MANIFEST_NAME, snapshot_dir_name
from async_ckpt.storage.local import remove_entries

_attempts = iter(range(10**9))


def new_dir(step: int, session: str = "test-session") -> str:
    """A fresh attempt's directory name, as an engine names them."""
    return snapshot_dir_name(step, session, next(_attempts))


def record(step: int, seq: int = 0, world_size: int = 1, dir: str | None = None) -> SnapshotRecord:
    shards = tuple(ShardRecord(rank=r, file=f"rank-{r:05d}.ackpt", bytes=1000 + r,
                               index_xxh3=f"{step * 16 + r:016x}") for r in range(world_size))
    return SnapshotRecord(step=step, seq=seq, dir=dir or f"step-{step:020d}.{step:08x}",
                          committed_at=1_700_000_000.5 + step, world_size=world_size, shards=shards,
                          raw_bytes=4096 * world_size, stored_bytes=1000 * world_size + 7)


def commit_all(steps, keep_last, keep_every=None, manifest=None):
    """Commit ``steps`` in order; returns the final manifest and the steps dropped by each commit."""
    manifest = manifest or Manifest()
    dropped_per_commit = []
    for step in steps:
        manifest, dropped = manifest.commit(record(step), keep_last, keep_every)
        dropped_per_commit.append([d.step for d in dropped])
    return manifest, dropped_per_commit


# --- reading and writing -------------------------------------------------------------------------

def test_empty_directory_has_an_empty_manifest(tmp_path):
    manifest = read_manifest(LocalStorage(str(tmp_path)))
    assert manifest == Manifest()
    assert manifest.snapshots == () and manifest.next_seq == 0 and manifest.steps() == []
    assert os.listdir(tmp_path) == []  # reading never creates anything


@pytest.mark.parametrize("extra", [{}, {"engine": {"keep_last": 3}, "note": "x"}])
def test_write_then_read_round_trip(tmp_path, extra):
    snapshots = (record(10, seq=3, world_size=2), record(5, seq=4), record(20, seq=7, world_size=3))
    manifest = Manifest(snapshots, next_seq=8, extra=extra)
    write_manifest(LocalStorage(str(tmp_path)), manifest)
    back = read_manifest(LocalStorage(str(tmp_path)))
    assert back == manifest
    assert back.snapshots[0] == snapshots[0]
    assert back.snapshots[0].shards[1] == ShardRecord(1, "rank-00001.ackpt", 1001, f"{161:016x}")
    assert isinstance(back.snapshots[2].shards, tuple)
    assert back.steps() == [10, 5, 20]  # commit order, not step order
    assert os.listdir(tmp_path) == [MANIFEST_NAME]


def test_manifest_file_is_plain_json(tmp_path):
    write_manifest(LocalStorage(str(tmp_path)), Manifest((record(1, seq=0),), next_seq=1))
    doc = json.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert doc["format"] == "async_ckpt.manifest" and doc["version"] == 1
    assert doc["next_seq"] == 1 and "extra" not in doc
    assert doc["snapshots"][0]["step"] == 1
    assert doc["snapshots"][0]["shards"] == [
        {"rank": 0, "file": "rank-00000.ackpt", "bytes": 1000, "index_xxh3": f"{16:016x}"}]


def test_write_replaces_the_previous_manifest(tmp_path):
    write_manifest(LocalStorage(str(tmp_path)), Manifest((record(1),), next_seq=1))
    newer = Manifest((record(2, seq=1),), next_seq=2)
    write_manifest(LocalStorage(str(tmp_path)), newer)
    assert read_manifest(LocalStorage(str(tmp_path))) == newer
    assert os.listdir(tmp_path) == [MANIFEST_NAME]


# --- commit and retention ------------------------------------------------------------------------

def test_keep_last_keeps_the_newest_commits():
    manifest, dropped = commit_all(range(1, 7), keep_last=3)
    assert manifest.steps() == [4, 5, 6]
    assert dropped == [[], [], [], [1], [2], [3]]


def test_commit_returns_the_dropped_records_themselves():
    manifest, _ = commit_all([1, 2], keep_last=2)
    old = manifest.snapshots[0]
    manifest, dropped = manifest.commit(record(3), keep_last=2)
    assert dropped == [old]
    assert manifest.steps() == [2, 3]


def test_rewind_keeps_the_commit_just_made():
    """Steps 10, 11, 12 then a rewind to 5: the newest commit (5) and 12 stay, not 11 and 12."""
    manifest, dropped = commit_all([10, 11, 12, 5], keep_last=2)
    assert manifest.steps() == [12, 5]
    assert dropped == [[], [], [10], [11]]
    assert manifest.newest_first()[0].step == 5


def test_keep_last_one_keeps_only_the_newest_commit_even_after_a_rewind():
    manifest, dropped = commit_all([100, 3], keep_last=1)
    assert manifest.steps() == [3]
    assert dropped == [[], [100]]


def test_recommitting_a_step_replaces_it():
    manifest, _ = commit_all([1, 2, 3], keep_last=3)
    old_two = manifest.find(2)
    new_two = record(2, dir="step-00000000000000000002.ffffffff")
    manifest, dropped = manifest.commit(new_two, keep_last=3)
    assert dropped == [old_two]
    assert manifest.steps() == [1, 3, 2]
    assert manifest.find(2).dir == "step-00000000000000000002.ffffffff"
    assert manifest.find(2).seq == 3


def test_recommitting_a_step_with_retention_drops_both_the_old_copy_and_the_oldest():
    manifest, _ = commit_all([1, 2, 3], keep_last=2)
    assert manifest.steps() == [2, 3]
    old_two = manifest.find(2)
    manifest, dropped = manifest.commit(record(2, dir="new"), keep_last=2)
    assert manifest.steps() == [3, 2] and manifest.find(2).dir == "new"
    assert dropped == [old_two]


def test_recommitting_a_kept_forever_step_still_replaces_it():
    manifest, _ = commit_all([5, 6], keep_last=1, keep_every=5)
    assert manifest.steps() == [5, 6]
    old_five = manifest.find(5)
    manifest, dropped = manifest.commit(record(5, dir="again"), keep_last=1, keep_every=5)
    assert manifest.steps() == [5] and manifest.find(5).dir == "again"
    assert [d.step for d in dropped] == [5, 6] and dropped[0] == old_five


def test_keep_every_keeps_multiples_forever():
    manifest, dropped = commit_all(range(1, 23), keep_last=2, keep_every=5)
    assert manifest.steps() == [5, 10, 15, 20, 21, 22]
    assert [s for d in dropped for s in d] == [1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19]


def test_keep_every_keeps_step_zero():
    manifest, _ = commit_all([0, 1, 2, 3], keep_last=1, keep_every=10)
    assert manifest.steps() == [0, 3]


def test_seq_increments_and_overrides_the_records_seq():
    manifest = Manifest()
    for expected_seq, step in enumerate([7, 3, 9, 3]):
        manifest, _ = manifest.commit(record(step, seq=999), keep_last=10)
        assert manifest.next_seq == expected_seq + 1
        assert manifest.snapshots[-1].seq == expected_seq
    assert [s.seq for s in manifest.snapshots] == [0, 2, 3]


def test_commit_leaves_the_original_manifest_unchanged():
    manifest, _ = commit_all([1, 2], keep_last=5)
    before = (manifest.snapshots, manifest.next_seq)
    manifest.commit(record(3), keep_last=1)
    assert (manifest.snapshots, manifest.next_seq) == before


def test_commit_keeps_extra():
    manifest = Manifest(extra={"a": 1})
    manifest, _ = manifest.commit(record(1), keep_last=1)
    assert manifest.extra == {"a": 1}


def test_retention_survives_a_round_trip_through_disk(tmp_path):
    """The writer re-reads the manifest before each commit: order and seq come back from disk."""
    root = str(tmp_path)
    for step in [10, 11, 12, 5, 6]:
        manifest, _ = read_manifest(LocalStorage(root)).commit(record(step), keep_last=3)
        write_manifest(LocalStorage(root), manifest)
    manifest = read_manifest(LocalStorage(root))
    assert manifest.steps() == [12, 5, 6]
    assert [s.seq for s in manifest.snapshots] == [2, 3, 4] and manifest.next_seq == 5


def test_a_manifest_of_20000_ranks_and_3_snapshots_is_committed_and_read_back(tmp_path):
    """Issue 40: 60,000 shard records cost more than READ_ALLOWANCE to parse; what a job
    commits is readable all the same, because the budget grows with the shard files there, and
    the same manifest in a directory that does not hold them is refused unparsed."""
    root, world_size = str(tmp_path), 20_000
    records = [record(step, seq=step, world_size=world_size) for step in range(3)]
    for rec in records:  # the ranks' shards are in before rank 0 commits (links: made fast)
        os.mkdir(tmp_path / rec.dir)
        first = tmp_path / rec.dir / rec.shards[0].file
        first.touch()
        for shard in rec.shards[1:]:
            os.link(first, os.path.join(root, rec.dir, shard.file))
    manifest, _ = Manifest(tuple(records[:2]), next_seq=2).commit(records[2], keep_last=3)
    write_manifest(LocalStorage(root), manifest)
    assert values.json_cost((tmp_path / MANIFEST_NAME).read_bytes()) > values.READ_ALLOWANCE
    back = read_manifest(LocalStorage(root))
    assert back == manifest and back.steps() == [0, 1, 2]
    assert back.snapshots[2].shard_of(world_size - 1) == manifest.snapshots[2].shards[-1]

    remove_entries(root, [s.dir for s in manifest.snapshots])
    with pytest.raises(ManifestError, match="more than the 64 MiB a read allows"):
        read_manifest(LocalStorage(root))


def test_without_drops_steps():
    manifest, _ = commit_all([1, 2, 3], keep_last=3)
    smaller, dropped = manifest.without([2, 99])
    assert smaller.steps() == [1, 3] and [d.step for d in dropped] == [2]
    assert smaller.next_seq == manifest.next_seq


# --- read_manifest errors ------------------------------------------------------------------------

def write_raw_manifest(root, data) -> None:
    if not isinstance(data, bytes):
        data = json.dumps(data).encode()
    (root / MANIFEST_NAME).write_bytes(data)


def valid_doc() -> dict:
    return json.loads(Manifest((record(3, world_size=2),), next_seq=1).to_bytes())


@pytest.mark.parametrize("data", [b"\x00\xffgarbage", b"", b"{", b'{"format": "async_ckpt.manifest"',
                                  b"\xef\xbb\xbf\xff\xfe", b"[" * 100_000 + b"]" * 100_000],
                         ids=["garbage", "empty", "open-brace", "cut", "bad-utf8", "deep"])
def test_garbage_manifest_is_a_manifest_error(tmp_path, data):
    write_raw_manifest(tmp_path, data)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(str(tmp_path)))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_literal_is_not_json(tmp_path, literal):
    """Issue 28: Python's json read `"extra": {"a": NaN}`; gc then died writing it back with
    allow_nan=False, and every later commit failed. FORMAT.md says strict JSON: refused."""
    doc = valid_doc()
    doc["extra"] = {"a": 1.5}
    write_raw_manifest(tmp_path, json.dumps(doc).replace("1.5", literal).encode())
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(LocalStorage(str(tmp_path)))


@pytest.mark.parametrize("name", ["step-" + "\u0660" * 19 + "\u0665.20ce24e5",
                                  "step-" + "\uff10" * 19 + "\uff15.20ce24e5"])
def test_a_directory_name_with_other_digits_is_not_a_snapshot(name):
    """Issue 28: `\\d` also matches Arabic-Indic and full-width digits, so such a directory was
    taken as step 5 (and deleted by retention); FORMAT.md says [0-9]."""
    from async_ckpt.storage.names import snapshot_dir_step

    assert snapshot_dir_step(name) is None
    assert snapshot_dir_step("step-" + "0" * 19 + "5.20ce24e5") == 5


@pytest.mark.parametrize("doc", [[], None, 3, "async_ckpt.manifest", {},
                                 {"format": "other", "version": 1, "next_seq": 0, "snapshots": []},
                                 {"version": 1, "next_seq": 0, "snapshots": []},
                                 {".metadata": {}, "state_dict_metadata": {}}])
def test_json_of_another_format_is_a_manifest_error(tmp_path, doc):
    write_raw_manifest(tmp_path, doc)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(str(tmp_path)))


@pytest.mark.parametrize("version", [99, 4, 0])
def test_other_manifest_version_is_unsupported(tmp_path, version):
    doc = valid_doc()
    doc["version"] = version
    write_raw_manifest(tmp_path, doc)
    with pytest.raises(UnsupportedFormatError):
        read_manifest(LocalStorage(str(tmp_path)))


def _del(*path):
    def edit(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return edit


def _put(value, *path):
    def edit(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


MISSING_FIELDS = {
    "snapshots": _del("snapshots"),
    "next_seq": _del("next_seq"),
    "step": _del("snapshots", 0, "step"),
    "seq": _del("snapshots", 0, "seq"),
    "dir": _del("snapshots", 0, "dir"),
    "committed_at": _del("snapshots", 0, "committed_at"),
    "world_size": _del("snapshots", 0, "world_size"),
    "shards": _del("snapshots", 0, "shards"),
    "raw_bytes": _del("snapshots", 0, "raw_bytes"),
    "stored_bytes": _del("snapshots", 0, "stored_bytes"),
    "shard-rank": _del("snapshots", 0, "shards", 1, "rank"),
    "shard-file": _del("snapshots", 0, "shards", 0, "file"),
    "shard-bytes": _del("snapshots", 0, "shards", 0, "bytes"),
    "shard-index_xxh3": _del("snapshots", 0, "shards", 0, "index_xxh3"),
}


@pytest.mark.parametrize("field", list(MISSING_FIELDS))
def test_missing_fields_are_a_manifest_error(tmp_path, field):
    doc = valid_doc()
    MISSING_FIELDS[field](doc)
    write_raw_manifest(tmp_path, doc)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(str(tmp_path)))


MALFORMED_STRUCTURE = {
    "unknown-snapshot-field": _put(1, "snapshots", 0, "colour"),
    "unknown-shard-field": _put(1, "snapshots", 0, "shards", 0, "colour"),
    "snapshots-null": _put(None, "snapshots"),
    "snapshots-a-number": _put(3, "snapshots"),
    "snapshot-a-string": _put("step-1", "snapshots", 0),
    "snapshot-a-list": _put([1, 2], "snapshots", 0),
    "shards-null": _put(None, "snapshots", 0, "shards"),
    "shard-a-number": _put(5, "snapshots", 0, "shards", 0),
    "next_seq-not-a-number": _put("many", "next_seq"),
    "next_seq-null": _put(None, "next_seq"),
}


@pytest.mark.parametrize("case", list(MALFORMED_STRUCTURE))
def test_malformed_structure_is_a_manifest_error(tmp_path, case):
    doc = valid_doc()
    MALFORMED_STRUCTURE[case](doc)
    write_raw_manifest(tmp_path, doc)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(str(tmp_path)))


WRONG_TYPES = {
    # Each of these is read without complaint today, and fails later with an untyped error
    # (TypeError in os.path.join or in commit's retention arithmetic) or silently misbehaves.
    "step-a-string": _put("3", "snapshots", 0, "step"),
    "dir-a-number": _put(5, "snapshots", 0, "dir"),
    "shard-rank-a-string": _put("0", "snapshots", 0, "shards", 0, "rank"),
    "shard-bytes-a-string": _put("1000", "snapshots", 0, "shards", 0, "bytes"),
    "snapshots-an-object": _put({}, "snapshots"),
    "extra-a-list": _put([1], "extra"),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrong_field_types_are_a_manifest_error(tmp_path, case):
    doc = valid_doc()
    WRONG_TYPES[case](doc)
    write_raw_manifest(tmp_path, doc)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(str(tmp_path)))


def test_unreadable_manifest_is_a_manifest_error(tmp_path):
    (tmp_path / MANIFEST_NAME).mkdir()  # a directory where the file should be: EISDIR
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(str(tmp_path)))


# --- atomic replacement --------------------------------------------------------------------------

def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_after_half(real_write_all):
    def write_all(fd, data):
        view = memoryview(data).cast("B")
        real_write_all(fd, view[:len(view) // 2])
        _disk_full()
    return write_all


@pytest.mark.parametrize("where", ["write_all", "fsync"])
def test_failed_write_leaves_the_old_manifest_and_no_tmp_file(tmp_path, monkeypatch, where):
    root = str(tmp_path)
    old = Manifest((record(1), record(2, seq=1)), next_seq=2)
    write_manifest(LocalStorage(root), old)
    old_bytes = (tmp_path / MANIFEST_NAME).read_bytes()
    if where == "write_all":
        monkeypatch.setattr(fsutil, "write_all", _fail_after_half(fsutil.write_all))
    else:
        monkeypatch.setattr(fsutil.os, "fsync", _disk_full)
    new, _ = old.commit(record(3), keep_last=1)
    with pytest.raises(OSError) as excinfo:
        write_manifest(LocalStorage(root), new)
    assert excinfo.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert os.listdir(root) == [MANIFEST_NAME]
    assert (tmp_path / MANIFEST_NAME).read_bytes() == old_bytes
    assert read_manifest(LocalStorage(root)) == old
    assert leftovers(LocalStorage(root), read_manifest(LocalStorage(root))) == []


def test_failed_first_write_leaves_no_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(fsutil.os, "fsync", _disk_full)
    with pytest.raises(OSError):
        write_manifest(LocalStorage(str(tmp_path)), Manifest((record(1),), next_seq=1))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    assert read_manifest(LocalStorage(str(tmp_path))) == Manifest()


def test_atomic_write_fsyncs_the_file_before_the_rename(tmp_path, monkeypatch):
    """The order that makes the replace durable: write, fsync file, rename, fsync directory."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", stat.S_ISDIR(os.fstat(fd).st_mode)))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    monkeypatch.setattr(fsutil.os, "replace", replace)
    target = tmp_path / "file.bin"
    fsutil.atomic_write(str(target), b"new contents")
    monkeypatch.undo()
    assert events == [("fsync", False), ("replace", "file.bin"), ("fsync", True)]
    assert target.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["file.bin"]


def test_atomic_write_overwrites_a_stale_tmp_file_of_the_same_pid(tmp_path):
    target = tmp_path / "file.bin"
    stale = tmp_path / f"file.bin.tmp-{os.getpid()}"
    stale.write_bytes(b"x" * 10_000)
    fsutil.atomic_write(str(target), b"short")
    assert target.read_bytes() == b"short"
    assert not stale.exists()


def test_write_all_writes_every_byte_despite_short_writes(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(fsutil.os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        fsutil.write_all(fd, memoryview(bytes(range(100))))
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert path.read_bytes() == bytes(range(100))


# --- leftovers and snapshot directory names ------------------------------------------------------

def test_leftovers_lists_only_unreferenced_snapshot_dirs_and_tmp_manifests(tmp_path):
    root = str(tmp_path)
    kept = new_dir(10)
    stale = new_dir(11)
    stale_same_step = new_dir(10)
    manifest = Manifest((record(10, dir=kept),), next_seq=1)
    write_manifest(LocalStorage(root), manifest)
    for name in (kept, stale, stale_same_step, "step-5", "step-00000000000000000005.XYZW0123",
                 "step-00000000000000000005", "other-dir"):
        (tmp_path / name).mkdir()
    for name in ("manifest.json.tmp-123", "manifest.json.tmp-abc", "manifest.json.bak",
                 "xmanifest.json.tmp-1", "notes.txt", ".lock"):
        (tmp_path / name).write_bytes(b"")
    assert leftovers(LocalStorage(root), manifest) == sorted(["manifest.json.tmp-123", stale, stale_same_step])


def test_leftovers_of_an_empty_manifest_include_every_snapshot_dir(tmp_path):
    names = [new_dir(s) for s in (1, 2)]
    for name in names:
        (tmp_path / name).mkdir()
    assert leftovers(LocalStorage(str(tmp_path)), Manifest()) == sorted(names)


def test_snapshot_dirs_lists_every_snapshot_dir_committed_or_not(tmp_path):
    from async_ckpt.format.manifest import snapshot_dirs

    committed, uncommitted = new_dir(2), new_dir(1)
    write_manifest(LocalStorage(str(tmp_path)), Manifest((record(2, dir=committed),), next_seq=1))
    for name in (committed, uncommitted, "step-5", "step-00000000000000000005.XYZW0123"):
        (tmp_path / name).mkdir()
    (tmp_path / "manifest.json.tmp-1").write_bytes(b"")
    assert snapshot_dirs(LocalStorage(str(tmp_path))) == sorted([committed, uncommitted])


def test_lock_files_are_recognised_by_their_exact_name():
    from async_ckpt.storage.names import is_lock_file, lock_file_name

    assert is_lock_file(lock_file_name(0)) and is_lock_file(lock_file_name(12345))
    for name in (".lock-rank", ".lock-rank1", ".lock-rank00000.tmp", "x.lock-rank00000", None, 3):
        assert not is_lock_file(name)


def test_remove_entries_removes_dirs_and_files_and_tolerates_missing_ones(tmp_path):
    tree = tmp_path / new_dir(3)
    (tree / "sub").mkdir(parents=True)
    (tree / "rank-00000.ackpt").write_bytes(b"data")
    (tree / "sub" / "deep").write_bytes(b"data")
    (tmp_path / "manifest.json.tmp-9").write_bytes(b"{}")
    (tmp_path / "keep.txt").write_bytes(b"keep")
    remove_entries(str(tmp_path), [tree.name, "manifest.json.tmp-9", "never-existed",
                                 new_dir(4)])
    assert os.listdir(tmp_path) == ["keep.txt"]
    remove_entries(str(tmp_path), [tree.name, "manifest.json.tmp-9"])  # again: already gone
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_snapshot_dir_names_are_distinct_and_recognised_as_leftovers(tmp_path):
    names = [new_dir(7) for _ in range(200)] + [new_dir(7, session="other") for _ in range(200)]
    assert len(set(names)) == 400
    for name in names:
        prefix, suffix = name.split(".")
        assert prefix == "step-00000000000000000007"
        assert len(suffix) == 8 and all(c in "0123456789abcdef" for c in suffix)
    for name in names[:5]:
        (tmp_path / name).mkdir()
    assert leftovers(LocalStorage(str(tmp_path)), Manifest()) == sorted(names[:5])


def test_snapshot_dir_names_are_the_same_on_every_rank_of_a_session():
    assert snapshot_dir_name(5, "s1", 0) == snapshot_dir_name(5, "s1", 0)
    assert len({snapshot_dir_name(5, "s1", 0), snapshot_dir_name(5, "s1", 1),
                snapshot_dir_name(5, "s2", 0)}) == 3


@pytest.mark.parametrize("step", [0, 1, 10**6, 10**19, 10**20 - 1])
def test_snapshot_dir_names_sort_by_step_and_match_the_leftover_pattern(tmp_path, step):
    name = new_dir(step)
    assert name.startswith(f"step-{step:020d}.") and len(name) == 5 + 20 + 1 + 8
    (tmp_path / name).mkdir()
    assert leftovers(LocalStorage(str(tmp_path)), Manifest()) == [name]


def test_snapshot_dir_names_sort_in_step_order():
    names = [new_dir(s) for s in (2, 10, 100, 9)]
    assert sorted(names) == [names[0], names[3], names[1], names[2]]


# --- fsutil errors and directories ---------------------------------------------------------------

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_write_error_maps_disk_full(code):
    error = fsutil.write_error(OSError(code, os.strerror(code)), "step 3")
    assert type(error) is DiskFullError
    assert isinstance(error, SnapshotWriteError)
    assert "step 3" in str(error)


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES, errno.EROFS, errno.EBADF, None])
def test_write_error_maps_other_errors_to_snapshot_write_error(code):
    exc = OSError(code, os.strerror(code)) if code is not None else OSError("mystery")
    error = fsutil.write_error(exc, "step 3")
    assert type(error) is SnapshotWriteError
    assert not isinstance(error, DiskFullError)
    assert "step 3" in str(error)


def test_ensure_writable_dir_creates_nested_dirs(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    got = fsutil.ensure_writable_dir(target)
    assert got == str(target) and os.path.isabs(got) and target.is_dir()
    assert fsutil.ensure_writable_dir(str(target)) == str(target)  # idempotent


def test_ensure_writable_dir_returns_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = fsutil.ensure_writable_dir("rel/dir")
    assert got == str(tmp_path / "rel" / "dir") and (tmp_path / "rel" / "dir").is_dir()


def test_ensure_writable_dir_refuses_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x")
    with pytest.raises(CheckpointDirError):
        fsutil.ensure_writable_dir(path)
    with pytest.raises(CheckpointDirError):
        fsutil.ensure_writable_dir(path / "below" / "it")
    assert path.read_bytes() == b"x"


def test_fsync_dir_takes_directories_only(tmp_path):
    fsutil.fsync_dir(str(tmp_path))
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsutil.fsync_dir(str(tmp_path / "f"))


def test_retention_over_a_long_chain_of_references_is_linear_and_right():
    """Issue 28: a 20,000-record ``refers`` chain made ``gc --keep-last 1`` take 45 s (records
    compared field by field in list membership tests, one pass per dropped link). Each snapshot
    here refers to the one before: keeping the newest keeps the whole chain; once the oldest is
    replaced (a rewind to its step), nothing after it can restore, and all of it goes."""
    n = 20_000
    chain = []
    for step in range(n):
        r = record(step, seq=step)
        chain.append(dataclasses.replace(r, refers=(chain[-1].dir,) if chain else ()))
    manifest = Manifest(tuple(chain), next_seq=n)
    kept, dropped = manifest.without(range(n - 1))
    assert len(kept.snapshots) == n and not dropped
    rewound, dropped = manifest.commit(record(0, dir="step-00000000000000000000.0000beef"),
                                       keep_last=n + 1)
    assert [s.dir for s in rewound.snapshots] == ["step-00000000000000000000.0000beef"]
    assert len(dropped) == n


# --- a rank's own manifest (ranks without a shared directory) ------------------------------------


def own_record(step: int, rank: int, world_size: int = 4) -> SnapshotRecord:
    """A record of rank ``rank``'s own manifest: only its shard of ``world_size``."""
    full = record(step, world_size=world_size)
    return dataclasses.replace(full, shards=(full.shards[rank],))


def test_a_ranks_own_manifest_round_trips_as_version_3(tmp_path):
    manifest, _ = Manifest(rank=2).commit(own_record(5, 2), keep_last=3)
    write_manifest(LocalStorage(str(tmp_path)), manifest)
    doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert (doc["version"], doc["rank"]) == (3, 2)
    again = read_manifest(LocalStorage(str(tmp_path)))
    assert again == manifest and again.rank == 2
    assert again.snapshots[0].shard_of(2).file == "rank-00002.ackpt"
    assert again.snapshots[0].shard_of(0) is None
    assert json.loads(Manifest().to_bytes())["version"] == 1 and "rank" not in json.loads(
        Manifest().to_bytes())


OWN_MANIFEST_DAMAGE = {
    "rank without version 3": lambda d: d.update(version=1),
    "version 3 without rank": lambda d: d.pop("rank"),
    "rank not an int": lambda d: d.update(rank="2"),
    "rank negative": lambda d: d.update(rank=-1),
    "another rank's shard": lambda d: d["snapshots"][0]["shards"][0].update(
        rank=1, file="rank-00001.ackpt"),
    "every shard": lambda d: d["snapshots"][0].update(
        shards=json.loads(Manifest((record(5, world_size=4),), 1).to_bytes())[
            "snapshots"][0]["shards"]),
    "rank past the world size": lambda d: d["snapshots"][0].update(world_size=2),
}


@pytest.mark.parametrize("case", list(OWN_MANIFEST_DAMAGE))
def test_a_damaged_own_manifest_is_a_manifest_error(tmp_path, case):
    doc = json.loads(Manifest((own_record(5, 2),), next_seq=1, rank=2).to_bytes())
    OWN_MANIFEST_DAMAGE[case](doc)
    write_raw_manifest(tmp_path, doc)
    with pytest.raises(ManifestError):
        read_manifest(LocalStorage(str(tmp_path)))


def test_a_ranks_own_manifest_keeps_its_rank_through_retention():
    manifest = Manifest(rank=1)
    for step in range(4):
        manifest, _ = manifest.commit(own_record(step, 1), keep_last=2)
    assert manifest.rank == 1 and manifest.steps() == [2, 3]
    assert manifest.without([2])[0].rank == 1
