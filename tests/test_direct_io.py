"""Direct I/O (issue 39): shards written with O_DIRECT from the staging slot's memory, several
writes in flight (storage/local.py ``_DirectWrites``), storages aligned for it (format version 7),
the fallback to the page cache where a file system refuses, and the slot never released while a
write still reads it."""

import errno
import logging
import mmap
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest

from async_ckpt.format.layout import DIRECT_BYTES, slot_alignment
from async_ckpt.format import shard
from async_ckpt.format.shard import STORAGE_ALIGNMENT, ChunkEncoder, ShardReader, ShardWriter
from async_ckpt.storage import local
from async_ckpt.storage.base import DIRECT_ALIGNMENT
from async_ckpt.storage.local import LocalShardSink, LocalStorage

SNAP = "step-00000000000000000007.0000abcd"
SHARD = "rank-00000.ackpt"


def direct_sink(path) -> LocalShardSink:
    sink = LocalShardSink(str(path), str(path), direct=True)
    if not sink.direct:
        sink.abort()
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    return sink


def aligned(data: bytes, offset: int = 0) -> memoryview:
    """``data`` in page-aligned memory (as a staging slot holds it), ``offset`` bytes in."""
    block = mmap.mmap(-1, offset + len(data))
    block[offset:offset + len(data)] = data
    return memoryview(block)[offset:offset + len(data)]


@pytest.fixture
def recorded_writes(monkeypatch):
    """Every direct write as (file offset, length, memory address)."""
    writes, real = [], local._write_at
    monkeypatch.setattr(local, "_write_at", lambda fd, view, offset: (
        writes.append((offset, len(view), local._address(view))), real(fd, view, offset))[1])
    return writes


def test_direct_writes_go_from_aligned_memory_and_everything_else_through_a_bounce(
        tmp_path, recorded_writes):
    head = os.urandom(100)  # leaves the end unaligned: what follows is copied
    misaligned = aligned(os.urandom(3 * DIRECT_ALIGNMENT), 64)
    big = aligned(os.urandom(local.DIRECT_PIECE_BYTES + 2 * DIRECT_ALIGNMENT + 10))
    pad = bytes(-(len(head) + len(misaligned)) % DIRECT_ALIGNMENT)
    path = tmp_path / "f"
    sink = direct_sink(path)
    assert sink.writes_directly(big) and not sink.writes_directly(misaligned)
    sink.write([head, misaligned, pad, big, b"tail"])
    sink.finish()
    expected = head + bytes(misaligned) + pad + bytes(big) + b"tail"
    assert path.read_bytes() == expected  # cut back to its length after the padded last block
    start = len(head) + len(misaligned) + len(pad)
    direct = [(o, n) for o, n, address in recorded_writes[1:]  # [0]: the probe
              if address in (local._address(big), local._address(big) + local.DIRECT_PIECE_BYTES)]
    assert direct == [(start, local.DIRECT_PIECE_BYTES),
                      (start + local.DIRECT_PIECE_BYTES, 2 * DIRECT_ALIGNMENT)]
    assert all(o % DIRECT_ALIGNMENT == 0 and n % DIRECT_ALIGNMENT == 0
               and address % DIRECT_ALIGNMENT == 0 for o, n, address in recorded_writes)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_direct_shard_aligns_its_storages_and_reads_back(tmp_path, monkeypatch, compression):
    """Version 7: a large storage the sink writes from its memory starts at a multiple of
    DIRECT_ALIGNMENT, the others (small, or misaligned in memory) at one of STORAGE_ALIGNMENT;
    zstd chunks (bounced) too."""
    monkeypatch.setattr(shard, "DIRECT_BYTES", 8192)  # "large", in a test's sizes
    floats = np.random.default_rng(0).normal(0, 0.02, 3333).astype(np.float32)
    storages = [(aligned(os.urandom(10)), 1, False), (aligned(floats.tobytes()), 4, True),
                (aligned(os.urandom(9000), 64), 1, False), (aligned(os.urandom(9000)), 1, False),
                (aligned(os.urandom(5000)), 1, False)]
    path = tmp_path / SHARD
    writer = ShardWriter(direct_sink(path), ChunkEncoder(compression), chunk_bytes=8192,
                         version=7, workers=2)
    for data, itemsize, is_float in storages:
        writer.add_storage(data, itemsize, is_float)
    writer.finish({"step": 7, "rank": 0})
    with ShardReader(str(path)) as reader:
        firsts = [s["chunks"][0]["offset"] for s in reader.index["storages"]]
        ends = [s["chunks"][-1]["offset"] + s["chunks"][-1]["stored"]
                for s in reader.index["storages"]]
        assert reader.verify() == []
        for i, (data, _, _) in enumerate(storages):
            out = bytearray(len(data))
            reader.read_storage(i, out)
            assert out == data
    assert firsts[1] % DIRECT_ALIGNMENT == firsts[3] % DIRECT_ALIGNMENT == 0
    assert firsts[1] > ends[0] + STORAGE_ALIGNMENT  # padded to the block
    assert firsts[2] == ends[1] + -ends[1] % STORAGE_ALIGNMENT  # not padded: memory misaligned
    assert firsts[4] == ends[3] + -ends[3] % STORAGE_ALIGNMENT  # not padded: small


def test_flush_returns_only_once_no_direct_write_reads_the_memory(tmp_path, monkeypatch):
    """The writer releases the slot after ``flush``: a write still in flight must hold it."""
    entered, proceed, events = threading.Event(), threading.Event(), []
    sink = direct_sink(tmp_path / SHARD)
    real = local._write_at

    def slow(fd, view, offset):
        entered.set()
        proceed.wait()
        real(fd, view, offset)
        events.append("written")

    monkeypatch.setattr(local, "_write_at", slow)
    monkeypatch.setattr(shard, "DIRECT_BYTES", DIRECT_ALIGNMENT)  # "large", in a test's sizes
    writer = ShardWriter(sink, ChunkEncoder(None), version=7, workers=2)
    writer.add_storage(aligned(os.urandom(4 * DIRECT_ALIGNMENT)), 1, False)
    flushing = threading.Thread(target=lambda: (writer.flush(), events.append("flushed")))
    flushing.start()
    assert entered.wait(10)
    flushing.join(0.1)
    assert flushing.is_alive() and events == []  # held by the write in flight
    proceed.set()
    flushing.join()
    assert events[-1] == "flushed" and "written" in events
    writer.abort()


def test_a_failed_direct_write_is_raised_and_abort_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / SHARD
    sink = direct_sink(path)

    def failing(fd, view, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(local, "_write_at", failing)
    sink.write([aligned(os.urandom(DIRECT_ALIGNMENT))])
    with pytest.raises(OSError) as failed:
        sink.settle()
    assert failed.value.errno == errno.EIO
    sink.abort()
    assert not path.exists()


@pytest.mark.parametrize("refused_at", ["open", "first write"])
def test_where_direct_io_is_refused_the_shard_goes_through_the_page_cache_logged_once(
        tmp_path, monkeypatch, caplog, refused_at):
    real_open, real_write = os.open, local._write_at
    einval = OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    def open_(path, flags, *args, **kwargs):
        if refused_at == "open" and flags & os.O_DIRECT:  # as Linux does: created, then refused
            os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kwargs))
            raise einval
        return real_open(path, flags, *args, **kwargs)

    def write_at(fd, view, offset):
        if refused_at == "first write" and local.fcntl.fcntl(fd, local.fcntl.F_GETFL) & os.O_DIRECT:
            raise einval
        return real_write(fd, view, offset)

    monkeypatch.setattr(local.os, "open", open_)
    monkeypatch.setattr(local, "_write_at", write_at)
    monkeypatch.setattr(local, "_refusals_logged", set())
    storage = LocalStorage(tmp_path, direct_io=True)
    storage.make_snapshot_dir(SNAP)
    with caplog.at_level(logging.WARNING, logger="async_ckpt.storage.local"):
        for name in ("rank-00000.ackpt", "rank-00001.ackpt"):
            sink = storage.create_shard(SNAP, name)
            assert not sink.direct and not sink.writes_directly(aligned(bytes(DIRECT_ALIGNMENT)))
            sink.write([b"abc", aligned(b"d" * DIRECT_ALIGNMENT)])
            sink.finish()
            assert (tmp_path / SNAP / name).read_bytes() == b"abc" + b"d" * DIRECT_ALIGNMENT
    assert [r.getMessage().count("refuses direct I/O") for r in caplog.records] == [1]


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mounted for the test: a real file system whose kernel refuses O_DIRECT at open
    (tmpfs takes it since Linux 6.6, so it cannot stand in for one any more)."""
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mount_point)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("mounting a ramfs needs root with CAP_SYS_ADMIN")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.filterwarnings("ignore:restored step 3, but the snapshot holds no data position")
def test_an_engine_on_a_file_system_that_refuses_direct_io_snapshots_through_the_page_cache(
        ramfs, capfd):
    """The kernel's refusal, not a simulated one: the writer process says so once on its
    stderr, commits every snapshot, and a restarted process restores the newest exactly."""
    import torch

    from async_ckpt import CheckpointEngine
    from conftest import assert_same

    with pytest.raises(OSError) as refused:
        os.open(ramfs / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    assert refused.value.errno == errno.EINVAL
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: a storage the direct path would take
    directory = str(ramfs / "ckpt")
    with CheckpointEngine(directory, {"model": model}, every=1, direct_io=True) as engine:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(step)
            engine.snapshot(step)
            engine.wait()
        assert [(s["step"], s["direct"]) for s in engine.stats()["snapshots"]] == [
            (1, False), (2, False), (3, False)]
    assert capfd.readouterr().err.count("refuses direct I/O") == 1
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    restored = torch.nn.Linear(1024, 1024)
    with CheckpointEngine(directory, {"model": restored}, direct_io=True) as engine:
        assert engine.restore() == 3
    assert_same(restored.state_dict(), expected)


def test_direct_io_off_writes_through_the_page_cache(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.make_snapshot_dir(SNAP)
    sink = storage.create_shard(SNAP, SHARD)
    assert not sink.direct
    sink.abort()


def test_large_storages_start_page_aligned_in_a_slot():
    """So that the writer writes them from the slot's memory; small ones stay packed."""
    import torch

    from async_ckpt.train.capture import Planner
    sizes = [3, DIRECT_BYTES // 4, 5, DIRECT_BYTES // 4 + 1, 7]
    plan, _ = Planner().plan([torch.zeros(n) for n in sizes])
    offsets = [r.offset for r in plan.regions]
    assert [o % DIRECT_ALIGNMENT == 0 for o in offsets[1::2]] == [True, True]
    assert offsets[2] == offsets[1] + DIRECT_BYTES and offsets[1] > 64  # 5 floats: packed at 64
    assert slot_alignment(DIRECT_BYTES - 1) == 64
