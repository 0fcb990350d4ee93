"""The remote tier against a real S3-protocol server on loopback (tests/s3server.py): uploads
after the local commit, restore on a fresh node, a store that goes down, damage, retention, two
engines on one prefix. The uploader's own logic (order of publication, back-off, what local
retention keeps) is tested with an injected clock and a store of files, without a server."""

import dataclasses
import json
import os
import shutil
import time
import uuid
from concurrent.futures import Future

import psutil
import pytest
import torch

import async_ckpt
from async_ckpt import CheckpointEngine
from async_ckpt.errors import (RemoteConflictError, RemoteStorageError, ReplicaMismatchError,
                               SnapshotWriteError)
from async_ckpt.format.manifest import SnapshotRecord, read_manifest
from async_ckpt.storage.names import shard_file_name
from async_ckpt.storage.local import LocalStorage
from async_ckpt.storage.remote import ObjectStorage
from async_ckpt.write import upload
from async_ckpt.write.protocol import RemoteStatus
from conftest import FakeClock, assert_same

obstore = pytest.importorskip("obstore")


@pytest.fixture
def remote(server, monkeypatch):
    """A fresh prefix on the server, reached through the AWS environment alone."""
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    if server.process.poll() is not None:
        server.start()
    return server.url(f"run-{uuid.uuid4().hex[:8]}")


def model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))


def bump(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))


def restore_fresh(tmp_path, url, width=64, **options):
    """A new model restored on a node whose local directory is empty."""
    fresh = tmp_path / f"fresh-{uuid.uuid4().hex[:6]}"
    m = model(seed=99, width=width)
    with CheckpointEngine(fresh, {"m": m}, remote=url, **options) as engine:
        step = engine.restore()
    return step, m


@pytest.mark.parametrize("direct_io", [False, True])
def test_committed_snapshots_reach_the_bucket_and_restore_on_a_fresh_node(tmp_path, remote,
                                                                          direct_io):
    width = 1024 if direct_io else 64  # direct: a storage large enough to go from the slot
    m = model(width=width)
    with CheckpointEngine(tmp_path / "node1", {"m": m}, remote=remote,
                          direct_io=direct_io) as engine:
        for step in range(3):
            bump(m)
            engine.snapshot(step)
        engine.wait(remote=True)
        stats = engine.stats()
    assert stats["remote_step"] == 2 and stats["upload_lag_steps"] == 0
    assert stats["upload_lag_s"] == 0 and stats["upload_pending_bytes"] == 0
    steps = read_manifest(ObjectStorage(remote)).steps()
    assert steps[-1] == 2
    step, restored = restore_fresh(tmp_path, remote, width=width)
    assert step == 2
    assert_same(restored.state_dict(), m.state_dict())
    step, loaded = async_ckpt.load(remote)
    assert step == 2
    assert_same(loaded["m"], m.state_dict())


def test_data_files_reach_the_bucket_and_restore_from_it(tmp_path, remote):
    """A shard that keeps storages in data files (a framework's file, format version 6) is
    uploaded with them, read from the bucket directly, and downloaded with them."""
    m = model()
    with CheckpointEngine(tmp_path / "node1", {"m": m}, remote=remote) as engine:
        engine.snapshot(0, markers=[async_ckpt.Marker(str(tmp_path / "m.safetensors"),
                                                      async_ckpt.Derived("safetensors", "m"))])
        engine.wait(remote=True)
    store = ObjectStorage(remote)
    record = read_manifest(store).snapshots[-1]
    names = dict(store.list_snapshot(record.dir))
    assert names["rank-00000.0.safetensors"] == os.path.getsize(tmp_path / "m.safetensors")
    assert_same(async_ckpt.load(remote)[1]["m"], m.state_dict())  # ranged reads, no copy
    obstore.put(store.store, f"{record.dir}/rank-00000.1.pt", b"not named by the index")
    step, restored = restore_fresh(tmp_path, remote)  # a local copy, its data file beside it
    assert step == 0
    assert_same(restored.state_dict(), m.state_dict())
    (fresh,) = tmp_path.glob(f"fresh-*/{record.dir}")  # what the index names, not the listing
    assert sorted(os.listdir(fresh)) == ["rank-00000.0.safetensors", "rank-00000.ackpt"]


def test_an_object_store_takes_data_files_by_upload_only():
    """A data file is written in place (a zip's header last), never into an object."""
    with pytest.raises(SnapshotWriteError, match="by upload"):
        ObjectStorage("s3://bucket/prefix").create_data_file("step-00000000000000000001.0000abcd",
                                                             "rank-00000.0.pt")


def test_restore_prefers_the_newer_tier(tmp_path, remote, server):
    """The local directory is newer than the bucket while uploads lag; a fresh one is older."""
    m = model()
    local = tmp_path / "node1"
    with CheckpointEngine(local, {"m": m}, remote=remote) as engine:
        bump(m)
        engine.snapshot(0)
        engine.wait(remote=True)
        server.kill()
        bump(m)
        engine.snapshot(1)
        engine.wait()
        engine.close(timeout=0)
    server.start()
    m2 = model(seed=5)
    with CheckpointEngine(local, {"m": m2}, remote=remote) as engine:
        assert engine.restore() == 1
        engine.wait(remote=True)  # the next engine uploads what stayed local
    assert_same(m2.state_dict(), m.state_dict())


def test_a_store_that_goes_down_delays_uploads_not_training(tmp_path, remote, server):
    m = model(width=1024)  # 4 MB: the kill below lands while it uploads, or just before
    with CheckpointEngine(tmp_path / "node1", {"m": m}, remote=remote) as engine:
        bump(m)
        engine.snapshot(0)
        engine.wait(remote=True)
        bump(m)
        engine.snapshot(1)
        engine.wait()  # committed locally; the upload starts now
        server.kill()
        for step in range(2, 5):
            bump(m)
            engine.snapshot(step)
            engine.wait()
        assert engine.stats()["committed"] == 5  # every step committed locally while down
        with pytest.raises(RemoteStorageError):
            engine.wait(remote=True, timeout=2.0)
        stats = engine.stats()
        assert stats["remote_step"] == 0 and stats["upload_lag_steps"] == 4
        assert stats["upload_lag_s"] > 0 and stats["upload_pending_bytes"] > 0
        assert stats["upload_retries"] >= 1 and "RemoteStorageError" in stats["upload_last_error"]
        assert read_manifest(LocalStorage(engine.directory)).steps()[-1] == 4
        server.restart()  # an empty store: whatever was half uploaded is gone with it
        engine.wait(remote=True)
        assert engine.stats()["remote_step"] == 4
    step, restored = restore_fresh(tmp_path, remote, width=1024)
    assert step == 4
    assert_same(restored.state_dict(), m.state_dict())


def corrupt_newest(url: str, same_size: bool) -> int:
    """Damage the newest snapshot's shard in the bucket; returns its step."""
    storage = ObjectStorage(url)
    newest = read_manifest(storage).snapshots[-1]
    key = f"{newest.dir}/{shard_file_name(0)}"
    data = bytearray(bytes(obstore.get(storage.store, key).bytes()))
    if same_size:
        data[len(data) // 3] ^= 0xFF
    else:
        del data[-100:]
    obstore.put(storage.store, key, bytes(data))
    return newest.step


@pytest.mark.parametrize("same_size", [True, False], ids=["flipped byte", "truncated"])
def test_a_damaged_object_falls_back_to_the_previous_snapshot(tmp_path, remote, same_size):
    m = model()
    with CheckpointEngine(tmp_path / "node1", {"m": m}, remote=remote) as engine:
        bump(m)
        engine.snapshot(0)
        engine.wait(remote=True)
        kept = {k: v.clone() for k, v in m.state_dict().items()}
        bump(m)
        engine.snapshot(1)
        engine.wait(remote=True)
    assert corrupt_newest(remote, same_size) == 1
    with pytest.warns(RuntimeWarning, match="step 1 is unusable"):
        step, restored = restore_fresh(tmp_path, remote)
    assert step == 0
    assert_same(restored.state_dict(), kept)


def test_remote_retention_deletes_only_after_the_manifest_drops_them(tmp_path, remote):
    m = model()
    with CheckpointEngine(tmp_path / "node1", {"m": m}, remote=remote, keep_last=1,
                          remote_keep_last=2) as engine:
        for step in range(4):
            bump(m)
            engine.snapshot(step)
            engine.wait(remote=True)
    storage = ObjectStorage(remote)
    manifest = read_manifest(storage)
    assert manifest.steps() == [2, 3]
    assert [n for n in storage.list_root() if n.startswith("step-")] == sorted(
        s.dir for s in manifest.snapshots)
    assert len(read_manifest(LocalStorage(tmp_path / "node1")).steps()) == 1


def test_a_second_engine_on_one_prefix_is_refused(tmp_path, remote):
    first, second = model(), model(seed=1)
    with CheckpointEngine(tmp_path / "a", {"m": first}, remote=remote) as a:
        a.snapshot(0)
        a.wait(remote=True)
        b = CheckpointEngine(tmp_path / "b", {"m": second}, remote=remote)
        until(lambda: b.stats()["remote_step"] == 0)  # its writer has read the bucket's manifest
        a.snapshot(1)
        a.wait(remote=True)  # ...which the first engine then replaces
        b.snapshot(7)
        with pytest.raises(RemoteConflictError):
            b.wait(remote=True)
        assert "RemoteConflictError" not in str(a.stats()["upload_last_error"])
        b.close(timeout=0)
    assert read_manifest(ObjectStorage(remote)).steps() == [0, 1]


def until(condition, limit_s: float = 120.0) -> None:
    """Wait for the writer to report ``condition`` (a generous limit: a hang, not a timing)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the writer never reported it"
        time.sleep(0.02)


def test_credentials_never_reach_the_writer_command_line(tmp_path, remote, server):
    secret = "s3cr3t-" + uuid.uuid4().hex
    with CheckpointEngine(tmp_path / "node1", {"m": model()}, remote=remote,
                          remote_options={"endpoint_url": server.endpoint,
                                          "access_key_id": "testing",
                                          "secret_access_key": "testing",
                                          "session_token": secret}) as engine:
        cmdline = " ".join(psutil.Process(engine._writer.pid).cmdline())
    assert secret not in cmdline and "--fd" in cmdline


def test_a_bad_remote_is_refused_before_anything_starts(tmp_path):
    for url in ("s3://UPPER/x", "s3://bucket/../up", "gs://bucket/x", "s3://b"):
        with pytest.raises((ValueError, async_ckpt.errors.CheckpointDirError)):
            CheckpointEngine(tmp_path / "x", {"m": model()}, remote=url)
    assert not (tmp_path / "x").exists()


def test_a_store_that_is_down_at_restore_restores_from_local(tmp_path, remote, server):
    m = model()
    with CheckpointEngine(tmp_path / "node1", {"m": m}, remote=remote) as engine:
        engine.snapshot(0)
        engine.wait(remote=True)
    server.kill()
    m2 = model(seed=3)
    with CheckpointEngine(tmp_path / "node1", {"m": m2}, remote=remote) as engine:
        assert engine.restore() == 0
        engine.close(timeout=0)
    assert_same(m2.state_dict(), m.state_dict())
    with pytest.raises(RemoteStorageError):
        async_ckpt.load(remote)
    m3 = model(seed=4)  # a fresh node cannot tell what the bucket holds: it does not start over
    with CheckpointEngine(tmp_path / "node2", {"m": m3}, remote=remote) as engine:
        with pytest.raises(RemoteStorageError, match="holds no snapshot"):
            engine.restore()
        engine.close(timeout=0)
    assert_same(m3.state_dict(), model(seed=4).state_dict())
    server.start()


# --- the uploader's logic, with an injected clock and a store of files ---------------------------


class FileStore(LocalStorage):
    """An object store stand-in: a directory, with the upload call the uploader uses."""

    url = "file-store"

    def __init__(self, root, fail: int = 0):
        super().__init__(str(root))
        os.makedirs(root, exist_ok=True)
        self.fail = fail  # requests that fail before the store comes back
        self.published = []

    def upload_file(self, dir, file, path):
        self._maybe_fail()
        os.makedirs(self.location(dir), exist_ok=True)
        shutil.copyfile(path, self.location(dir, file))

    def list_snapshot(self, dir):
        self._maybe_fail()
        return super().list_snapshot(dir)

    def publish(self, name, data):
        self._maybe_fail()
        super().publish(name, data)
        self.published.append(read_manifest(self).steps())

    def _maybe_fail(self):
        if self.fail:
            self.fail -= 1
            raise RemoteStorageError("the store is down")


def right_now(step, *args) -> Future:
    future = Future()
    try:
        future.set_result(step(*args))
    except BaseException as e:
        future.set_exception(e)
    return future


def committed_record(local: LocalStorage, step: int, world_size: int) -> SnapshotRecord:
    """A snapshot directory with a shard file per rank, as the local commit leaves it."""
    from test_commit import write_shard

    name = f"step-{step:020d}.0000abcd"
    shards = [write_shard(local.root, name, rank, step, world_size=world_size)
              for rank in range(world_size)]
    return SnapshotRecord(step=step, seq=step, dir=name, committed_at=1000.0 + step,
                          world_size=world_size, shards=tuple(shards), raw_bytes=0,
                          stored_bytes=0)


def uploaders(tmp_path, world_size=2, fail=0):
    local, store, clock, sent = LocalStorage(str(tmp_path / "local")), FileStore(
        tmp_path / "bucket", fail), FakeClock(), []
    os.makedirs(local.root)
    made = [upload.Uploader(local, store, rank, world_size, 2, None, sent.append, clock,
                            right_now) for rank in range(world_size)]
    return local, store, clock, sent, made


def settle(clock, *made, rounds=10):
    for _ in range(rounds):
        clock.now += upload.LISTING_INTERVAL_S
        for uploader in made:
            uploader.poll()


def test_rank0_publishes_only_once_every_rank_shard_is_in_the_bucket(tmp_path):
    local, store, clock, sent, (rank0, rank1) = uploaders(tmp_path)
    record = committed_record(local, 5, 2)
    settle(clock, rank0, rank1)
    rank0.committed(record)
    settle(clock, rank0)
    assert store.published == [] and rank0.busy  # rank 1's shard is not there yet
    rank1.committed(record)
    settle(clock, rank1, rounds=2)
    assert rank1.busy  # uploaded; waits for rank 0 to publish
    settle(clock, rank0, rank1)
    assert store.published == [[5]] and not rank0.busy
    assert not rank1.busy and rank1.remote_step == 5
    assert [e.remote_step for e in sent if isinstance(e, RemoteStatus)][-1] == 5


def test_a_shard_is_uploaded_with_the_data_files_its_index_names(tmp_path):
    """Those its index names, not what the directory lists; a shard missing one is never
    published (the trainer is told)."""
    local, store, clock, sent, (rank0,) = uploaders(tmp_path, world_size=1)
    with CheckpointEngine(local.root, {}) as engine:
        for step in (0, 1):
            engine.snapshot(step, state={"m": {"w": torch.randn(100)}}, force=True, markers=[
                async_ckpt.Marker(str(tmp_path / f"{step}.pt"), async_ckpt.Derived("torch", "m"))])
            engine.wait()
    first, second = read_manifest(local).snapshots
    with open(local.location(first.dir, "rank-00000.3.pt"), "wb") as f:
        f.write(b"not named by the index")
    rank0.committed(first)
    settle(clock, rank0)
    assert sorted(dict(store.list_snapshot(first.dir))) == ["rank-00000.0.pt", "rank-00000.ackpt"]
    os.unlink(local.location(second.dir, "rank-00000.0.pt"))
    rank0.committed(second)
    settle(clock, rank0)
    assert store.published == [[0]] and not rank0.busy
    status = [e for e in sent if isinstance(e, RemoteStatus)][-1]
    assert status.rejections == 1 and "rank-00000.0.pt" in str(status.rejected)


def test_rank0_moves_on_at_once_when_another_rank_uploaded_a_newer_snapshot(tmp_path):
    """Each rank uploads the newest snapshot it has seen committed: rank 0 started on step 1,
    rank 1 saw steps 1 and 2 committed before it started and uploaded 2. Step 1 can never
    complete; rank 0 moves on without waiting PEER_WAIT_S, and step 2 is published."""
    local, store, clock, sent, (rank0, rank1) = uploaders(tmp_path)
    first, second = committed_record(local, 1, 2), committed_record(local, 2, 2)
    settle(clock, rank0, rank1)
    rank0.committed(first)
    settle(clock, rank0, rounds=2)  # uploaded its shard of step 1; waits for rank 1's
    rank1.queue.extend([(first, clock.now), (second, clock.now)])  # both seen before it starts
    rank1.pending_since = clock.now
    rank0.committed(second)
    settle(clock, rank0, rank1, rounds=12)  # 3 s of listings, far below PEER_WAIT_S
    assert store.published == [[2]] and not rank0.busy and not rank1.busy
    assert rank0.skipped == 1 and rank1.skipped == 1


def test_failed_requests_back_off_and_then_succeed(tmp_path):
    local, store, clock, sent, (rank0,) = uploaders(tmp_path, world_size=1, fail=4)
    settle(clock, rank0)
    rank0.committed(committed_record(local, 1, 1))
    delays = []
    while rank0.busy:
        before = rank0.failures
        rank0.poll()
        if rank0.failures > before:
            delays.append(rank0.retry_at - clock.now)
        clock.now = max(clock.now + upload.LISTING_INTERVAL_S, rank0.retry_at)
    assert delays == [upload.RETRY_FIRST_S * 2 ** i for i in range(4)]
    assert store.published == [[1]] and rank0.failures == 0
    assert "the store is down" in rank0.last_error


def test_the_snapshot_being_uploaded_is_kept_and_newer_ones_supersede_waiting_ones(tmp_path):
    local, store, clock, sent, (rank0,) = uploaders(tmp_path, world_size=1, fail=1)
    settle(clock, rank0)
    first = committed_record(local, 1, 1)
    rank0.committed(first)  # its upload fails: it stays current, waiting for the retry
    assert rank0.protected() == {first.dir}
    for step in (2, 3, 4):
        rank0.committed(committed_record(local, step, 1))
    while rank0.busy:
        clock.now += upload.RETRY_MAX_S
        rank0.poll()
    assert store.published == [[1], [1, 4]]  # 2 and 3 were superseded by 4
    assert rank0.skipped == 2 and rank0.protected() == set()


def own_roots_records(tmp_path, step: int, replicas: list) -> tuple[list, list]:
    """Two ranks without a shared directory: each one's root, holding its real shard of
    ``step``; returns the roots and each one's record as its own manifest would list it."""
    from test_commit import write_shard

    roots, records = [], []
    name = f"step-{step:020d}.0000abcd"
    for rank in range(2):
        root = LocalStorage(str(tmp_path / f"node{rank}"))
        shard = write_shard(root.root, name, rank, step, replicas, world_size=2)
        record = SnapshotRecord(step=step, seq=step, dir=name, committed_at=1000.0 + step,
                                world_size=2, shards=(shard,), raw_bytes=64, stored_bytes=shard.bytes)
        roots.append(root)
        records.append(record)
    return roots, records


def test_without_a_shared_directory_rank0_completes_the_record_from_the_bucket(tmp_path):
    store, clock, sent = FileStore(tmp_path / "bucket"), FakeClock(), []
    replicas = [{"entry": "model", "owner": 0, "nbytes": 64, "xxh3": "00000000000000aa"}]
    roots, records = own_roots_records(tmp_path, 5, replicas)
    rank0, rank1 = (upload.Uploader(roots[r], store, r, 2, 2, None, sent.append, clock, right_now)
                    for r in range(2))
    settle(clock, rank0, rank1)
    rank0.committed(records[0])
    settle(clock, rank0)
    assert store.published == [] and rank0.busy  # rank 1's shard is not in the bucket yet
    rank1.committed(records[1])
    settle(clock, rank0, rank1)
    assert store.published == [[5]] and not rank0.busy and not rank1.busy
    published = read_manifest(store).snapshots[-1]
    assert published.shards == (records[0].shards[0], records[1].shards[0])
    assert published.raw_bytes == 128 and published.stored_bytes == sum(
        s.bytes for s in published.shards)
    assert rank1.remote_step == 5


def test_without_a_shared_directory_replicas_that_differ_are_never_published(tmp_path):
    store, clock, sent = FileStore(tmp_path / "bucket"), FakeClock(), []
    roots, records = own_roots_records(tmp_path, 5, [
        {"entry": "model", "owner": 0, "nbytes": 64, "xxh3": "00000000000000aa"}])
    theirs = [{"entry": "model", "owner": 0, "nbytes": 64, "xxh3": "00000000000000bb"}]
    from test_commit import write_shard

    records[1] = dataclasses.replace(records[1], shards=(  # rank 1 held other bytes
        write_shard(roots[1].root, records[1].dir, 1, 5, theirs, world_size=2),))
    made = [upload.Uploader(roots[r], store, r, 2, 2, None, sent.append, clock, right_now)
            for r in range(2)]
    settle(clock, *made)
    for uploader, record in zip(made, records):
        uploader.committed(record)
    settle(clock, *made)
    assert store.published == [] and not made[0].busy
    status = [e for e in sent if isinstance(e, RemoteStatus) and e.rejections]
    assert type(status[-1].rejected) is ReplicaMismatchError
    assert "'model' differs between rank 0 and rank 1" in str(status[-1].rejected)


@pytest.mark.slow
def test_two_ranks_resume_from_the_bucket_after_their_directories_are_wiped(tmp_path, remote,
                                                                         server):
    """Two ranks, each with a directory of its own (nodes without a shared file system): they
    commit locally and upload; the store is stopped for two steps, which commit locally all the
    same while the upload lag shows in stats(). Both directories wiped, a restart restores the
    newest step from the bucket, bit for bit. (Ranks sharing a directory upload through the same
    uploader, whose protocol the tests above drive with an injected clock.)"""
    from test_distributed import torchrun

    program = os.path.join(os.path.dirname(__file__), "programs", "remote_ranks.py")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    for phase in ("save", "restore"):
        if phase == "restore":
            shutil.rmtree(ckpt)
        process = torchrun(program, 2, "--phase", phase, "--dir", str(ckpt), "--remote", remote,
                           "--out", str(out), "--own-dirs", "--pause", str(server.process.pid),
                           output=str(tmp_path / "log"))
        assert process.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
    saved = [json.loads((out / f"save-{r}.json").read_text()) for r in range(2)]
    restored = [json.loads((out / f"restore-{r}.json").read_text()) for r in range(2)]
    assert [s["remote_step"] for s in saved] == [4, 4]
    assert [(r["step"], r["same"]) for r in restored] == [(4, True), (4, True)]
    for figures in (s["stopped"] for s in saved):  # steps 3 and 4, while the store was stopped
        assert figures["committed"] == 5 and figures["remote_step"] == 2
        assert figures["upload_lag_steps"] == 2 and figures["upload_pending_bytes"] > 0
    # each rank downloaded its own shard into its own root, and rank 1 also rank 0's, which holds
    # the replicated model
    newest_dir = restored[0]["downloaded"][0].split("/")[2]
    assert restored[0]["downloaded"] == [
        f"node0/rank-00000/{newest_dir}/rank-00000.ackpt",
        f"node1/rank-00001/{newest_dir}/rank-00000.ackpt",
        f"node1/rank-00001/{newest_dir}/rank-00001.ackpt"]


def test_incremental_snapshots_upload_what_they_refer_to_and_retention_keeps_it(tmp_path, remote):
    frozen = torch.nn.Linear(256, 256).requires_grad_(False)
    head = torch.nn.Linear(256, 2)
    state = {"frozen": frozen, "head": head}
    with CheckpointEngine(tmp_path / "node1", state, remote=remote, incremental=True,
                          full_every=100, keep_last=1, remote_keep_last=1) as engine:
        for step in range(3):
            bump(head)
            engine.snapshot(step)
            engine.wait(remote=True)
    manifest = read_manifest(ObjectStorage(remote))
    assert manifest.steps() == [0, 2]  # step 2 refers to step 0's frozen weights: kept
    assert manifest.snapshots[-1].refers == (manifest.snapshots[0].dir,)
    fresh = {"frozen": torch.nn.Linear(256, 256), "head": torch.nn.Linear(256, 2)}
    with CheckpointEngine(tmp_path / "fresh", fresh, remote=remote) as engine:
        assert engine.restore() == 2
    assert_same(fresh["frozen"].state_dict(), frozen.state_dict())
    assert_same(fresh["head"].state_dict(), head.state_dict())
