"""A restore right after a snapshot takes the bytes from the staging slot they were written from
(issue 39): direct writes leave nothing in the page cache, so reading the shard would be a cold
read. Each storage is used only once its slot bytes match the shard's chunk checksums; anything
else (a slot staged into since, compressed or referred storages) is read from the files."""

import logging
import os

import pytest
import torch

import async_ckpt
from async_ckpt import CheckpointEngine
from async_ckpt.errors import NoSnapshotError
from async_ckpt.format.layout import Plan, Region
from async_ckpt.storage.local import LocalShardSink
from async_ckpt.train.staging import StagingPool

from conftest import assert_same


def state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def values(registered: dict) -> dict:
    return {name: {k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in obj.state_dict().items()} if name == "model"
            else obj.state_dict()["state"] for name, obj in registered.items()}


def perturb(registered: dict) -> None:
    with torch.no_grad():
        for p in registered["model"].parameters():
            p.add_(1.0)
        for entries in registered["optimizer"].state.values():
            entries["exp_avg"].mul_(3.0)


def shard_path(directory: str, step: int) -> str:
    [snapshot] = [d for d in os.listdir(directory) if d.startswith(f"step-{step:020d}.")]
    return os.path.join(directory, snapshot, "rank-00000.ackpt")


def written_slot(engine: CheckpointEngine):
    [slot] = [s for s in engine._pool.slots if s.written is not None]
    return slot


@pytest.fixture(params=[False, True], ids=["buffered", "direct"])
def direct_io(request, tmp_path) -> bool:
    """Both writers; the direct one only where tmp_path's file system takes O_DIRECT."""
    if request.param:
        sink = LocalShardSink(str(tmp_path / "probe"), str(tmp_path / "probe"), direct=True)
        direct = sink.direct
        sink.abort()
        if not direct:
            pytest.skip("the file system of tmp_path refuses O_DIRECT")
    return request.param


@pytest.mark.filterwarnings("ignore:snapshot of step 1 is unusable")
@pytest.mark.filterwarnings("ignore:restored step")
def test_a_restore_right_after_a_snapshot_reads_no_data_from_disk(ckpt_dir, direct_io):
    registered = state()
    with CheckpointEngine(ckpt_dir, registered, every=1, direct_io=direct_io) as engine:
        engine.snapshot(1)
        engine.wait()
        expected = {k: v.clone() for k, v in registered["model"].state_dict().items()}
        expected_moments = [s["exp_avg"].clone() for s in registered["optimizer"].state.values()]
        raw_bytes = engine.stats()["snapshots"][-1]["raw_bytes"]
        assert engine.stats()["snapshots"][-1]["direct"] is direct_io
        path = shard_path(ckpt_dir, 1)
        with open(path, "r+b") as f:  # zeros over the middle of the data, on disk
            f.seek(os.path.getsize(path) // 3)
            f.write(bytes(1 << 16))
        perturb(registered)
        assert engine.restore() == 1
        assert engine.stats()["restore_slot_bytes"] == raw_bytes
        assert engine.stats()["restored_from"] == "disk"
        assert_same(dict(registered["model"].state_dict()), expected)
        assert_same([s["exp_avg"] for s in registered["optimizer"].state.values()],
                    expected_moments)
    with pytest.raises(NoSnapshotError, match="damaged"):  # the zeros are where a read would be
        async_ckpt.load(ckpt_dir)


@pytest.mark.filterwarnings("ignore:restored step")
def test_bytes_changed_in_the_slot_since_are_read_from_the_file(ckpt_dir, caplog):
    registered = state()
    with CheckpointEngine(ckpt_dir, registered, every=1) as engine:
        engine.snapshot(1)
        engine.wait()
        expected = values(registered)
        raw_bytes = engine.stats()["snapshots"][-1]["raw_bytes"]
        written_slot(engine).tensor[:4096].add_(1)  # the first storage's bytes, changed
        perturb(registered)
        with caplog.at_level(logging.WARNING, logger="async_ckpt"):
            assert engine.restore() == 1
        assert 0 < engine.stats()["restore_slot_bytes"] < raw_bytes
        assert "differ from the staging slot" in caplog.text
        assert_same(values(registered), expected)


@pytest.mark.filterwarnings("ignore:restored step")
def test_compressed_shards_are_read_from_their_files(ckpt_dir, direct_io):
    registered = state()
    with CheckpointEngine(ckpt_dir, registered, every=1, compression="zstd",
                          direct_io=direct_io) as engine:
        engine.snapshot(1)
        engine.wait()
        expected = values(registered)
        assert all(s.written is None for s in engine._pool.slots)  # nothing kept for a restore
        perturb(registered)
        assert engine.restore() == 1
        assert engine.stats()["restore_slot_bytes"] == 0
        assert_same(values(registered), expected)


@pytest.mark.filterwarnings("ignore:restored step")
def test_storages_an_incremental_snapshot_refers_to_are_read_where_they_are_stored(ckpt_dir,
                                                                                   direct_io):
    registered = state()
    with CheckpointEngine(ckpt_dir, registered, every=1, incremental=True,
                          direct_io=direct_io) as engine:
        engine.snapshot(1)
        engine.wait()
        with torch.no_grad():
            registered["model"][1].bias.add_(1.0)  # the only change: the rest is referred to
        engine.snapshot(2)
        engine.wait()
        figures = engine.stats()["snapshots"][-1]
        assert figures["referred_bytes"] > 0
        expected = values(registered)
        perturb(registered)
        assert engine.restore() == 2
        assert 0 < engine.stats()["restore_slot_bytes"] <= figures["raw_bytes"] - figures[
            "referred_bytes"]
        assert_same(values(registered), expected)


@pytest.mark.filterwarnings("ignore:restored step")
def test_a_slot_staged_into_again_no_longer_serves_the_older_step(ckpt_dir):
    registered = state()
    with CheckpointEngine(ckpt_dir, registered, every=1, slots=1) as engine:
        engine.snapshot(1)
        engine.wait()
        first = values(registered)
        perturb(registered)
        engine.snapshot(2)
        engine.wait()
        second = values(registered)
        perturb(registered)
        assert engine.restore(step=1) == 1
        assert engine.stats()["restore_slot_bytes"] == 0
        assert_same(values(registered), first)
        assert engine.restore() == 2
        assert engine.stats()["restore_slot_bytes"] > 0
        assert_same(values(registered), second)


class WithExtraState(torch.nn.Linear):
    """A module whose extra state (kept by set_extra_state, not copied into a parameter) is a
    tensor."""

    def __init__(self):
        super().__init__(4, 4)
        self.table = torch.arange(1024.0)

    def get_extra_state(self):
        return {"table": self.table}

    def set_extra_state(self, state):
        self.table = state["table"]


@pytest.mark.filterwarnings("ignore:restored step")
def test_restored_state_kept_outside_tensors_gets_memory_of_its_own(ckpt_dir):
    """LBFGS keeps its history in lists of tensors and a module keeps its extra state as given:
    restored from the slot, they must not stay in it, where the next snapshot is staged."""
    torch.manual_seed(0)
    module, x = WithExtraState(), torch.randn(8, 4)
    optimizer = torch.optim.LBFGS(module.parameters(), history_size=2, max_iter=3)

    def closure():
        optimizer.zero_grad()
        loss = module(x).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    with CheckpointEngine(ckpt_dir, {"model": module, "optimizer": optimizer}, every=1) as engine:
        engine.snapshot(1)
        engine.wait()
        assert engine.restore() == 1 and engine.stats()["restore_slot_bytes"] > 0
        slots = [(s.tensor.data_ptr(), s.tensor.data_ptr() + s.nbytes) for s in engine._pool.slots
                 if s.tensor is not None]
        kept = [module.table] + [t for entries in optimizer.state.values()
                                 for value in entries.values() if isinstance(value, list)
                                 for t in value if isinstance(t, torch.Tensor)]
        assert len(kept) > 1 and not any(start <= t.data_ptr() < end for t in kept
                                         for start, end in slots)
        optimizer.step(closure)  # the history moves along its lists
        before = {k: [t.clone() for t in v] if isinstance(v, list) else v
                  for k, v in optimizer.state_dict()["state"][0].items()}
        engine.snapshot(2)  # staged into the slot the restore read
        engine.wait()
        assert_same({k: v for k, v in optimizer.state_dict()["state"][0].items()}, before)


def test_a_restore_never_decodes_into_a_slot_that_holds_written_bytes():
    pool = StagingPool(2)
    plan = Plan(regions=(Region(0, 4096, 1, False),), tensors=(), nbytes=4096)
    try:
        pool.fit(pool.slots[0], plan, pin=False)
        pool.wrote(pool.slots[0], 5, plan)
        assert pool.scratch() is None and pool.free_slot(empty=True) is pool.slots[1]
        assert pool.free_slot() is pool.slots[0]  # a snapshot may still stage into it
        pool.fit(pool.slots[1], plan, pin=False)
        assert pool.scratch().obj is pool.slots[1]._map
        pool.wrote(pool.slots[1], 5, plan)  # the same step written again: only the newer holds it
        assert [s.written for s in pool.slots] == [None, (5, plan)]
        assert pool.free_slot() is pool.slots[0]  # the one not holding a written step first
    finally:
        pool.close()
