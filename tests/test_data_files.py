"""A shard's storages kept in data files (format version 6): a framework's file made from a
snapshot is the snapshot's own bytes, written once, linked after the commit; what reads the
snapshot checks a data file as it checks the shard."""

import dataclasses
import errno
import json
import os
import subprocess
import sys
from multiprocessing.reduction import send_handle

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import async_ckpt
import async_ckpt.format.manifest
from async_ckpt import CheckpointEngine, Derived, Marker
from async_ckpt.errors import (ChecksumMismatchError, CorruptSnapshotError, InternalError,
                               SnapshotWriteError)
from async_ckpt.format.layout import Plan, Region, TensorRecord
from async_ckpt.format.native import FORMATS
from async_ckpt.format.records import Chunk
from async_ckpt.format.shard import ChunkEncoder, ShardReader, ShardWriter, checksum
from async_ckpt.storage import local
from async_ckpt.storage.names import DATA_FILE, data_file_name, snapshot_dir_name
from async_ckpt.tools import cli
from async_ckpt.write.commit import with_shards
from async_ckpt.write import writer as writer_module
from async_ckpt.write.protocol import (Attach, CommitFigures, Committed, Failed, Released,
                                       ShardFigures, SnapshotJob)
from conftest import assert_same, connected_writer

safetensors_torch = pytest.importorskip("safetensors.torch")


def model_state():
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(300, 200), "b": torch.randn(200),
                      "half": torch.randn(64, 8).to(torch.bfloat16)},
            "optimizer": {"state": {0: {"exp_avg": torch.randn(300, 200), "step": torch.tensor(3.)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]}}


def hf_markers(out):
    return [Marker(str(out), files=(("model.safetensors", Derived("safetensors", "model")),
                                    ("optimizer.pt", Derived("torch", "optimizer"))))]


def state_bytes(state) -> int:
    return sum(t.untyped_storage().nbytes() for t in _tensors(state))


def _tensors(node):
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _tensors(v)
    elif isinstance(node, list):
        for v in node:
            yield from _tensors(v)


def bytes_in_files(*tops) -> int:
    """The bytes of the files under ``tops``, a file linked in several places counted once."""
    sizes = {}
    for top in tops:
        for parent, _, names in os.walk(top):
            for name in names:
                info = os.stat(os.path.join(parent, name))
                sizes[info.st_ino] = info.st_size
    return sum(sizes.values())


def snapshot_dir(root):
    (name,) = [n for n in os.listdir(root) if n.startswith("step-")]
    return os.path.join(root, name)


def clones_files(directory) -> bool:
    """Whether the file system of ``directory`` makes reflinks (Btrfs, XFS): a framework's file
    is then a clone of the data file, not a hard link to it."""
    (directory / "clone-source").write_bytes(b"x")
    try:
        return local._clone(str(directory / "clone-source"), str(directory / "clone"), False)
    finally:
        for name in ("clone-source", "clone"):
            if (directory / name).exists():
                os.unlink(directory / name)


def test_framework_files_are_the_snapshot_s_bytes_written_once(tmp_path):
    state = model_state()
    with CheckpointEngine(str(tmp_path / "ckpt"), {}) as engine:
        engine.snapshot(0, state=state, force=True, markers=hf_markers(tmp_path / "checkpoint-0"))
        engine.wait()
        counted = engine.stats()["snapshots"][-1]["shard_bytes"]
    clones = clones_files(tmp_path)  # a clone shares the blocks, as a link does, by another inode
    on_disk = bytes_in_files(snapshot_dir(tmp_path / "ckpt"),
                             *([] if clones else [tmp_path / "checkpoint-0"]))
    assert counted == on_disk
    (record,) = async_ckpt.format.manifest.read_manifest(
        local.LocalStorage(str(tmp_path / "ckpt"))).snapshots
    assert record.stored_bytes == on_disk  # what `ls` and retention's accounting show
    assert on_disk <= 1.05 * state_bytes(state)  # not the shard and the files: each byte once
    directory = snapshot_dir(tmp_path / "ckpt")
    for name, suffix in (("model.safetensors", "safetensors"), ("optimizer.pt", "pt")):
        linked = os.stat(tmp_path / "checkpoint-0" / name)
        (data,) = [n for n in os.listdir(directory) if n.endswith("." + suffix)]
        assert DATA_FILE.fullmatch(data)
        kept = os.stat(os.path.join(directory, data))
        if clones:
            assert linked.st_ino != kept.st_ino and (linked.st_nlink, kept.st_nlink) == (1, 1)
        else:
            assert (linked.st_ino, linked.st_nlink) == (kept.st_ino, 2)
        assert kept.st_mode & 0o222 == 0  # read-only: rewriting it in place would damage it
    weights = safetensors_torch.load_file(tmp_path / "checkpoint-0" / "model.safetensors")
    assert set(weights) == set(state["model"])  # in safetensors' order: largest elements first
    assert_same(weights, {name: state["model"][name] for name in weights})
    assert_same(torch.load(tmp_path / "checkpoint-0" / "optimizer.pt", weights_only=True),
                state["optimizer"])
    for mmap in (False, True):  # a torch entry maps aligned; safetensors' tensors are copied
        assert_same(async_ckpt.load(str(tmp_path / "ckpt"), mmap=mmap)[1], state)


def test_a_whole_snapshot_file_keeps_the_engine_s_own_entry_in_the_shard(tmp_path):
    target = tmp_path / "last.ckpt"
    state = {"w": torch.randn(1000), "views": torch.arange(12.)[3:9]}
    with CheckpointEngine(str(tmp_path / "ckpt"), {}) as engine:
        engine.snapshot(0, state=state, force=True, markers=[Marker(str(target),
                                                                    Derived("torch"))])
        engine.wait()
    assert os.stat(target).st_nlink == (1 if clones_files(tmp_path) else 2)
    assert_same(torch.load(target, weights_only=True), state)
    with ShardReader(os.path.join(snapshot_dir(tmp_path / "ckpt"), "rank-00000.ackpt")) as r:
        assert r.version in (6, 7)  # 7: written with direct I/O, aligned for it
        kept_in_file = [("file" in s["chunks"][0]) for s in r.index["storages"] if s["chunks"]]
    assert any(kept_in_file) and not all(kept_in_file)  # the RNG states stay in the shard


def test_storages_a_safetensors_file_does_not_hold_whole_stay_in_the_shard(tmp_path):
    shared = torch.randn(6, 4)
    model = {"embed": shared, "head": shared, "t": torch.randn(3, 5).t(),
             "cut": torch.arange(10)[2:7], "b": torch.arange(4.)}
    with CheckpointEngine(str(tmp_path / "ckpt"), {}) as engine:
        engine.snapshot(0, state={"model": model}, force=True, markers=[
            Marker(str(tmp_path / "m.safetensors"), Derived("safetensors", "model"))])
        engine.wait()
    loaded = safetensors_torch.load_file(tmp_path / "m.safetensors")
    assert set(loaded) == set(model) - {"head"}  # the same bytes as "embed": tied
    assert_same(loaded, {k: model[k].contiguous() for k in loaded})
    assert_same(async_ckpt.load(str(tmp_path / "ckpt"))[1], {"model": model})


def test_an_incremental_snapshot_s_file_holds_every_byte_and_refers_for_the_rest(tmp_path):
    frozen, trained = torch.randn(1000), torch.randn(10)
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root), {"model": {"frozen": frozen, "trained": trained}},
                          incremental=True, keep_last=5) as engine:
        for step in (0, 1):
            engine.snapshot(step, markers=[Marker(str(tmp_path / f"{step}.pt"),
                                                  Derived("torch", "model"))])
            engine.wait()
            trained.add_(1)
        assert engine.stats()["snapshots"][-1]["referred_bytes"] > 0
    assert_same(torch.load(tmp_path / "1.pt", weights_only=True),
                {"frozen": frozen, "trained": trained - 1})
    assert_same(async_ckpt.load(str(root), 1)[1]["model"],
                {"frozen": frozen, "trained": trained - 1})


def test_a_damaged_missing_or_cut_data_file_is_damage_of_its_snapshot(tmp_path):
    root = tmp_path / "ckpt"
    state = {"model": {"w": torch.randn(5000)}}
    with CheckpointEngine(str(root), {}) as engine:
        engine.snapshot(0, state=state, force=True, markers=[
            Marker(str(tmp_path / "m.safetensors"), Derived("safetensors", "model"))])
        engine.wait()
    directory = snapshot_dir(root)
    data = os.path.join(directory, data_file_name(0, 0, "safetensors"))
    os.unlink(tmp_path / "m.safetensors")  # the framework's link: the snapshot keeps its bytes
    assert_same(async_ckpt.load(str(root))[1], state)
    original = open(data, "rb").read()

    def replaced(content: bytes):
        os.unlink(data)
        with open(data, "wb") as f:
            f.write(content)

    damaged = bytearray(original)
    damaged[-100] ^= 1
    replaced(bytes(damaged))
    with pytest.raises(ChecksumMismatchError, match="fails its checksum"):
        async_ckpt.load(str(root), 0)
    replaced(original[:-1])
    with pytest.raises(CorruptSnapshotError, match="truncated or replaced"):
        async_ckpt.load(str(root), 0)
    os.unlink(data)
    with pytest.raises(CorruptSnapshotError, match="missing"):
        async_ckpt.load(str(root), 0)


@pytest.mark.parametrize("file_system", ["clones", "links", "neither"])
def test_a_marker_is_a_clone_else_a_link_else_a_copy(tmp_path, monkeypatch, file_system):
    """A clone (reflink) where the file system makes one: a file of its own, which a program can
    rewrite in place without touching the snapshot; else a hard link; else a copy."""
    def ioctl(fd, request, argument):
        if file_system != "clones" or request != local._FICLONE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        os.write(fd, os.pread(argument, 100, 0))  # what a clone holds, by another inode

    def cannot_link(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(local.fcntl, "ioctl", ioctl)
    if file_system == "neither":
        monkeypatch.setattr(local.os, "link", cannot_link)
    source = tmp_path / "source"
    source.write_bytes(b"bytes")
    local.atomic_write(str(tmp_path / "out"), local.Linked(str(source),
                                                           lambda f: f.write(b"copied")))
    out = os.stat(tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == (b"copied" if file_system == "neither" else b"bytes")
    assert (out.st_ino == os.stat(source).st_ino) == (file_system == "links")
    assert sorted(os.listdir(tmp_path)) == ["out", "source"]  # a refused clone left nothing


_CUT_WHILE_READ = """
import os, sys
import async_ckpt
from async_ckpt.format import shard

root, linked = sys.argv[1:]
mapped_storage = shard.ShardReader.mapped_storage

def cut_through_the_link(self, i, alignment):  # once mapped (or not), before a byte is read
    view = mapped_storage(self, i, alignment)
    if "file" in self.index["storages"][i]["chunks"][0] and os.path.getsize(linked) > 4096:
        os.chmod(linked, 0o644)  # the framework's user may, and root needs not
        os.truncate(linked, 4096)
    return view

shard.ShardReader.mapped_storage = cut_through_the_link
try:
    state = async_ckpt.load(root, 0, mmap=True)[1]  # lazily verified: its pages are touched
    print("loaded", float(state["model"]["w"].sum()))  # here
except async_ckpt.errors.CorruptSnapshotError as e:
    print(type(e).__name__, e)
"""


def test_a_linked_data_file_cut_while_it_is_read_is_damage_not_a_crash(tmp_path):
    """A framework's program truncates its file, a hard link to the snapshot's data file, while
    a restore reads it: a typed error (a mapping would have killed the process: SIGBUS). Run
    in a child process, so that a crash cannot take the test run with it."""
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root), {}) as engine:
        engine.snapshot(0, state={"model": {"w": torch.randn(64 << 10)}}, force=True,
                        markers=[Marker(str(tmp_path / "unused.pt"), Derived("torch", "model"))])
        engine.wait()
    linked = tmp_path / "framework.pt"  # a link, whatever the marker became on this file system
    os.link(os.path.join(snapshot_dir(root), data_file_name(0, 0, "torch")), linked)
    child = subprocess.run([sys.executable, "-c", _CUT_WHILE_READ, str(root), str(linked)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]  # -7: SIGBUS
    assert child.stdout.startswith("CorruptSnapshotError") and "short read" in child.stdout


def test_a_data_file_has_one_name_and_it_matches():
    for fmt in FORMATS:
        assert DATA_FILE.fullmatch(data_file_name(3, 7, fmt))
    assert [DATA_FILE.fullmatch(f"rank-00000.{n}.pt") is not None
            for n in ("0", "9", "10", "99", "00", "01", "100")] == [True] * 4 + [False] * 3


def crafted_shard(tmp_path, files, chunks_of, data=b"\0" * 128):
    """A version 6 shard of rank 0 whose one storage has ``chunks_of(xxh3)`` and whose index
    lists ``files``; its data file holds ``data``."""
    (tmp_path / data_file_name(0, 0, "torch")).write_bytes(data)
    writer = ShardWriter(str(tmp_path / "rank-00000.ackpt"), ChunkEncoder(None), version=6)
    writer.add_stored(64, 1, False, chunks_of(checksum(data[:64])))
    writer.finish({"step": 0, "rank": 0, "world_size": 1, "created": 0.0, "tensors": [],
                   "tree": {}, "files": files})
    return str(tmp_path / "rank-00000.ackpt")


def chunk(digest, **fields):
    return [Chunk(**{"offset": 0, "stored": 64, "raw": 64, "xxh3": digest, "codec": "raw",
                     "file": 0, **fields})]


@pytest.mark.parametrize("files, fields, problem", [
    ([{"name": "../../etc/passwd", "bytes": 128}], {}, "not named"),
    ([{"name": "rank-00001.0.pt", "bytes": 128}], {}, "not named"),  # another rank's
    ([{"name": "rank-00000.1.pt", "bytes": 128}], {}, "not named"),  # numbered otherwise
    ([{"name": "rank-00000.0.pt", "bytes": 32}], {}, "past the end"),
    ([{"name": "rank-00000.0.pt", "bytes": 128}], {"file": 1}, "names no data file"),
    ([{"name": "rank-00000.0.pt", "bytes": 128}], {"codec": "zstd"}, "malformed"),
    ([], {}, "malformed"),
])
def test_a_crafted_data_file_table_is_refused_before_a_file_is_opened(tmp_path, files, fields,
                                                                      problem):
    path = crafted_shard(tmp_path, files, lambda digest: chunk(digest, **fields))
    with pytest.raises(CorruptSnapshotError, match=problem):
        ShardReader(path)


def test_storages_that_overlap_in_a_data_file_are_refused(tmp_path):
    (tmp_path / data_file_name(0, 0, "torch")).write_bytes(b"\0" * 128)
    writer = ShardWriter(str(tmp_path / "rank-00000.ackpt"), ChunkEncoder(None), version=6)
    for offset in (0, 32):
        writer.add_stored(64, 1, False, chunk(checksum(b"\0" * 64), offset=offset))
    writer.finish({"step": 0, "rank": 0, "world_size": 1, "created": 0.0, "tensors": [],
                   "tree": {}, "files": [{"name": "rank-00000.0.pt", "bytes": 128}]})
    with pytest.raises(CorruptSnapshotError, match="overlap"):
        ShardReader(str(tmp_path / "rank-00000.ackpt"))


def test_a_crafted_shard_reads_its_data_file_verified(tmp_path):
    path = crafted_shard(tmp_path, [{"name": "rank-00000.0.pt", "bytes": 128}], chunk,
                         data=bytes(range(128)))
    with ShardReader(path) as reader:
        out = bytearray(64)
        reader.read_storage(0, out)
        assert bytes(out) == bytes(range(64))
        assert reader.verify() == []


HOSTILE = [None, -1, 0, 1, 2, 63, 64, 2**63, 1.5, "0", "../rank-00000.0.pt", "/etc/passwd",
           "rank-00000.0.pt", "rank-00000.1.safetensors", "rank-00000.0.pt\0", [], {}, True]


@pytest.fixture(scope="module")
def v6_snapshot(tmp_path_factory):
    """A committed snapshot whose storages are kept in a torch and a safetensors data file, as
    (root, the shard's path, its bytes, the state)."""
    root = tmp_path_factory.mktemp("v6") / "ckpt"
    state = model_state()
    with CheckpointEngine(str(root), {}) as engine:
        engine.snapshot(0, state=state, force=True, markers=hf_markers(root.parent / "out"))
        engine.wait()
    shard = os.path.join(snapshot_dir(root), "rank-00000.ackpt")
    return str(root), shard, open(shard, "rb").read(), state


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_crafted_data_file_fields_give_the_state_or_a_typed_error(v6_snapshot, data):
    """The attacker rewrites the index and its checksums (which then prove nothing): whatever it
    says of data files, a read returns the state bit for bit or raises a CheckpointError."""
    root, shard, original, state = v6_snapshot
    from fuzzing import TRAILER, rewrite_shard
    offset, length, _, _ = TRAILER.unpack(original[-TRAILER.size:])
    index = json.loads(original[offset:offset + length])
    in_files = [c for s in index["storages"] for c in s["chunks"] if "file" in c]
    target = data.draw(st.sampled_from(["file table", "chunk"]))
    if target == "file table":
        entry = index["files"][data.draw(st.integers(0, len(index["files"]) - 1))]
    else:
        entry = in_files[data.draw(st.integers(0, len(in_files) - 1))]
    key = data.draw(st.sampled_from(sorted(entry) + ["extra"]))
    if data.draw(st.booleans()) and key in entry:
        del entry[key]
    else:
        entry[key] = data.draw(st.sampled_from(HOSTILE))
    crafted, digest = rewrite_shard(original[:offset], json.dumps(index).encode())
    manifest_path = os.path.join(root, "manifest.json")
    manifest = json.load(open(manifest_path))
    saved = json.dumps(manifest)
    manifest["snapshots"][0]["shards"][0].update(bytes=len(crafted), index_xxh3=digest)
    try:
        with open(shard, "wb") as f:
            f.write(crafted)
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        try:
            loaded = async_ckpt.load(root, 0)[1]
        except async_ckpt.errors.CheckpointError:
            return
        assert_same(loaded, state)
    finally:
        with open(shard, "wb") as f:
            f.write(original)
        with open(manifest_path, "w") as f:
            f.write(saved)


def test_a_data_file_download_that_fails_leaves_nothing(tmp_path):
    storage = local.LocalStorage(str(tmp_path))
    storage.make_snapshot_dir("step-00000000000000000001.00000000")
    sink = storage.create_shard("step-00000000000000000001.00000000", data_file_name(0, 0, "torch"))
    sink.write([b"half of it"])
    sink.abort()  # the store went down mid-download
    assert os.listdir(tmp_path / "step-00000000000000000001.00000000") == []


def test_a_large_index_is_bounded_by_the_data_files_too(tmp_path):
    """A state whose index costs more to parse than the fixed allowance snapshots with a marker
    as it does without one: its tensors' bytes, now in the data file, count for the bound on
    both sides. The bound stays one of sizes: without the data file the index is refused
    unparsed. (Long names stand in for ~25,000 tensors: the same index cost, in ~1 s.)"""
    state = {"model": {f"{i:05d}" + "k" * 4000: torch.full((1024,), float(i))
                       for i in range(3000)}}
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root), {}) as engine:
        engine.snapshot(0, state=state, force=True, markers=[
            Marker(str(tmp_path / "m.safetensors"), Derived("safetensors", "model"))])
        engine.wait()
    assert_same(async_ckpt.load(str(root))[1], state)
    os.unlink(tmp_path / "m.safetensors")
    os.unlink(os.path.join(snapshot_dir(root), data_file_name(0, 0, "safetensors")))
    with pytest.raises(CorruptSnapshotError, match="index"):
        async_ckpt.load(str(root), 0)


def test_a_safetensors_entry_not_keyed_by_names_commits_and_says_why_no_file(tmp_path):
    """An entry with a key safetensors cannot name (a tuple) is no data file: the snapshot
    commits with its state in the shard, and the marker says why it has no file."""
    state = {"model": {(1, 2): torch.randn(10), "a": torch.randn(5)}}
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root), {}) as engine:
        engine.snapshot(0, state=state, force=True, markers=[
            Marker(str(tmp_path / "m.safetensors"), Derived("safetensors", "model"))])
        with pytest.raises(SnapshotWriteError, match="dict of tensors by name"):
            engine.wait()
        assert engine.committed_steps() == [0]
    assert not (tmp_path / "m.safetensors").exists()
    assert_same(async_ckpt.load(str(root))[1], state)


EMPTY = {"plan": Plan((), (), 0), "tree": {"kind": "dict", "entries": {}}}
ONE_TENSOR = {"plan": Plan((Region(0, 64, 4, True),), (TensorRecord(0, 0, "float32", (16,), (1,)),),
                           64),
              "tree": {"kind": "dict", "entries": {"w": {"kind": "tensor",
                                                         "state": {"$tensor": 0}}}}}


def staged_job(trainer, writer, job: int, markers, state=EMPTY, **fields) -> SnapshotJob:
    """Job ``job`` of ``state`` (a plan and a tree, staged as zeros) with ``markers``."""
    fd = os.memfd_create("staging")
    try:
        os.ftruncate(fd, 4096)
        trainer.send(Attach(job, 4096))
        send_handle(trainer, fd, os.getpid())
        assert writer.receive() is None
    finally:
        os.close(fd)
    return SnapshotJob(job=job, step=job, buffer_id=job, dir=snapshot_dir_name(job, "s", 0),
                       submitted=0.0, markers=tuple(markers), **state, **fields)


def test_a_bug_laying_out_a_framework_file_leaves_the_snapshot_and_the_writer(
        tmp_path, monkeypatch, caplog):
    """Laying a marker's file out fails on a bug (not a LayoutError): the snapshot is written
    with its state in the shard and committed, the file made from it after the commit; one
    warning however often it recurs."""
    def bug(*args):
        raise RuntimeError("a bug in the layout")

    monkeypatch.setattr(writer_module, "NativeFile", bug)
    os.mkdir(tmp_path / "ckpt")
    trainer, writer = connected_writer(tmp_path / "ckpt")
    try:
        for job in (1, 2):
            writer.handle(staged_job(trainer, writer, job, [
                Marker(str(tmp_path / f"{job}.pt"), Derived("torch"))]))
            assert trainer.recv() == Released(job, job)
            assert isinstance(trainer.recv(), Committed)
            assert torch.load(tmp_path / f"{job}.pt", weights_only=True) == {}
            assert os.stat(tmp_path / f"{job}.pt").st_nlink == 1  # made again, not linked
        warned = [r for r in caplog.records if "a bug in the layout" in r.getMessage()]
        assert len(warned) == 1 and "stays in the shard" in warned[0].getMessage()
    finally:
        trainer.close()
        writer.conn.close()


def test_a_bug_writing_a_framework_file_is_reported_not_raised(tmp_path):
    def derive(content):
        def write(out):
            raise RuntimeError("a bug in the format")
        return write

    committed = Committed(4, CommitFigures(ShardFigures(), 0.0, 0.0, 0, 0, 0))
    failed = writer_module._write_markers(committed, (Marker(str(tmp_path / "m.pt"),
                                                             Derived("torch")),), derive, {},
                                            timeout=1.0)
    assert isinstance(failed, Failed) and failed.job == 4
    assert type(failed.error) is InternalError and "a bug in the format" in str(failed.error)
    assert not (tmp_path / "m.pt").exists()


def test_a_referred_storage_is_checked_before_it_is_read_into_a_data_file(tmp_path):
    """An incremental snapshot's data file holds the bytes of storages it refers to, read from
    the earlier snapshot: only once the reference is checked (here the trainer refers to a
    storage the earlier shard does not have), never a file made of what is there instead."""
    os.mkdir(tmp_path / "ckpt")
    trainer, writer = connected_writer(tmp_path / "ckpt")
    try:
        writer.handle(staged_job(trainer, writer, 1, []))
        assert trainer.recv() == Released(1, 1) and isinstance(trainer.recv(), Committed)
        writer.handle(staged_job(trainer, writer, 2, [Marker(str(tmp_path / "2.pt"),
                                                             Derived("torch"))],
                                 ONE_TENSOR, refer=((0, snapshot_dir_name(1, "s", 0)),)))
        assert trainer.recv() == Released(2, 2)
        failed = trainer.recv()
        assert type(failed.error) is SnapshotWriteError
        assert "not the unchanged region" in str(failed.error)
        assert not os.path.exists(tmp_path / "ckpt" / snapshot_dir_name(2, "s", 0))
    finally:
        trainer.close()
        writer.conn.close()


def test_ls_repair_and_commit_find_a_missing_or_cut_data_file(tmp_path, capsys):
    """A snapshot whose shard is whole but a data file is not: `ls` says DAMAGED, the repair of
    a lost manifest does not take it for complete, and the committer refuses another rank's
    shard whose data file is not there, as for a missing shard."""
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root), {}) as engine:
        for step in (0, 1):
            engine.snapshot(step, state={"model": {"w": torch.randn(1000)}}, force=True,
                            markers=[Marker(str(tmp_path / f"{step}.pt"),
                                            Derived("torch", "model"))])
            engine.wait()
    manifest = async_ckpt.format.manifest.read_manifest(local.LocalStorage(str(root)))
    first, second = (os.path.join(root, s.dir) for s in manifest.snapshots)
    data = data_file_name(0, 0, "torch")
    os.unlink(os.path.join(first, data))
    os.truncate(os.path.join(second, data), 100)
    assert cli.main(["ls", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"{os.path.basename(first)}/{data} is missing" in out
    assert f"{os.path.basename(second)}/{data} has 100 bytes" in out
    assert out.count("DAMAGED") == 2

    os.unlink(os.path.join(root, "manifest.json"))
    assert async_ckpt.format.manifest.recover_manifest(local.LocalStorage(str(root)),
                                                       write=False).snapshots == ()

    record = manifest.snapshots[0]
    with pytest.raises(CorruptSnapshotError, match=f"{data} is missing"):
        with_shards(local.LocalStorage(str(root)), dataclasses.replace(record, shards=()), [],
                    [0])


def test_the_writer_keeps_nothing_of_a_job_once_it_is_done(tmp_path):
    os.mkdir(tmp_path / "ckpt")
    trainer, writer = connected_writer(tmp_path / "ckpt")
    try:
        for job, markers in ((1, []), (2, [Marker(str(tmp_path / "2.pt"), Derived("torch"))])):
            writer.handle(staged_job(trainer, writer, job, markers, ONE_TENSOR))
            assert trainer.recv() == Released(job, job) and isinstance(trainer.recv(), Committed)
        assert writer.data_files == {} and writer.markers == {}
    finally:
        trainer.close()
        writer.conn.close()
