"""capture.py and staging.py alone, without an engine or a writer: the layout of a state's tensors
in a slot, and the slot's bytes after staging."""

import os
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from async_ckpt.train.capture import Planner, capture
from async_ckpt.errors import EncodingError, LayoutError
from async_ckpt.format.layout import ALIGNMENT
from async_ckpt.format.shard import checksum
from async_ckpt.train import staging
from async_ckpt.train.staging import StagingPool


def _slot_bytes(slot, region):
    return slot.tensor[region.offset:region.offset + region.nbytes]


def test_views_of_one_storage_share_one_region_and_keep_their_offsets():
    base = torch.arange(100, dtype=torch.float32)
    view, other = base[10:30].view(4, 5).t(), torch.ones(3, dtype=torch.float64)
    plan, sources = Planner().plan([base, view, other, torch.empty(0)])
    assert len(plan.regions) == 2 and len(sources) == 2
    assert [r.region for r in plan.tensors] == [0, 0, 1, None]
    assert plan.tensors[1].offset == 40 and plan.tensors[1].stride == (1, 5)
    assert plan.regions[0].nbytes == 400 and plan.regions[0].itemsize == 4
    assert plan.regions[0].is_float and plan.regions[1].itemsize == 8
    assert all(r.offset % ALIGNMENT == 0 for r in plan.regions)
    assert plan.nbytes >= plan.raw_bytes == 400 + 24


def test_only_storages_every_tensor_of_which_is_replicated_are_replicas():
    shared = torch.zeros(8)
    plan, _ = Planner().plan([shared, shared[2:], torch.zeros(4), torch.zeros(2)],
                          ["model", None, "model", "optimizer"])
    assert [r.replica_of for r in plan.regions] == [None, "model", "optimizer"]


def test_the_planner_keeps_its_plan_while_the_layout_does_and_no_tensor():
    """Between two snapshots only the storages' addresses may change (an RNG state is a new
    tensor each time): the plan is kept, the sources are the new tensors'. A change of shape or
    of which tensors share a storage is a new plan; the planner holds no storage alive."""
    planner = Planner()
    a, b = torch.randn(6), torch.randn(2, 3)
    plan, sources = planner.plan([a, b, a[2:]])
    fresh = torch.randn(6)
    again, fresh_sources = planner.plan([fresh, b, fresh[2:]])
    assert again is plan
    assert fresh_sources[0].storage.data_ptr() == fresh.untyped_storage().data_ptr()
    assert torch.equal(fresh_sources[0].view(), fresh.view(torch.uint8))
    assert planner.plan([a, b, a[1:]])[0] != plan  # another view of a
    assert planner.plan([a, b.t(), a[2:]])[0] != plan  # another shape and stride
    shared = planner.plan([a, a, torch.randn(4)])[0]
    apart = planner.plan([a, torch.randn(6), torch.randn(4)])[0]
    assert len(shared.regions) == 2 and len(apart.regions) == 3
    kept = StorageWeakRef(fresh.untyped_storage())
    del fresh, fresh_sources
    assert kept.expired()


def test_a_lazy_copy_reads_the_storage_of_the_snapshot_not_a_later_one():
    """``p.data = x`` after ``start`` and before the copy thread gets to it: the slot still gets
    the bytes the tensor had when the copy was started."""
    pool = StagingPool(1)
    gate = threading.Event()
    try:
        param = torch.nn.Parameter(torch.arange(1000, dtype=torch.float32))
        plan, sources = Planner().plan([param.detach()])
        slot = pool.free_slot()
        pool.fit(slot, plan, pin=False)
        pool._copy_thread().submit(gate.wait)  # the copy thread is busy until the gate opens
        copy = pool.start(plan, sources, slot)
        param.data = torch.zeros(10)
        del sources
        gate.set()
        copy.wait()
        assert torch.equal(_slot_bytes(slot, plan.regions[0]),
                           torch.arange(1000, dtype=torch.float32).view(torch.uint8))
    finally:
        gate.set()
        pool.close()


def test_staging_copies_every_region_and_reuses_the_slot(tmp_path):
    pool = StagingPool(2)
    try:
        tensors = [torch.randn(1000), torch.arange(7, dtype=torch.int16)]
        plan, sources = Planner().plan(tensors)
        slot = pool.free_slot()
        assert pool.fit(slot, plan, pin=False) is True
        pool.stage(plan, sources, slot)
        for region, tensor in zip(plan.regions, tensors):
            assert bytes(_slot_bytes(slot, region).numpy()) == tensor.numpy().tobytes()
        buffer_id = slot.buffer_id
        assert pool.fit(slot, plan, pin=False) is False and slot.buffer_id == buffer_id
        bigger, bigger_sources = Planner().plan([torch.randn(1 << 20)])
        assert pool.fit(slot, bigger, pin=False) is True and slot.buffer_id != buffer_id
        with os.fdopen(os.dup(slot.fd), "rb") as f:  # what the writer process maps
            pool.stage(bigger, bigger_sources, slot)
            assert f.read(16) == bigger_sources[0].view()[:16].numpy().tobytes()
    finally:
        pool.close()
    assert all(s.fd == -1 and s.nbytes == 0 for s in pool.slots)


@pytest.mark.parametrize("background", [True, False], ids=["lazy", "eager"])
def test_a_copy_with_checksums_checksums_each_chunk_of_each_region_as_copied(monkeypatch,
                                                                           background):
    """What the memory tier's keeper would make of the slot, made while copying, in pieces
    (small ones here, so that a chunk spans several and a region several chunks)."""
    monkeypatch.setattr(staging, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(staging, "HASH_PIECE_BYTES", 1000)
    pool = StagingPool(1)
    try:
        tensors = [torch.randn(3000), torch.arange(7, dtype=torch.int16), torch.zeros(0)]
        plan, sources = Planner().plan(tensors)
        slot = pool.free_slot()
        pool.fit(slot, plan, pin=False)
        copy = pool.start(plan, sources, slot, background=background, checksums=True)
        assert copy.checksums is None  # not before the copy is waited for
        copy.wait()
        memory = slot.tensor.numpy()
        assert copy.checksums == tuple(
            tuple(checksum(memory[r.offset + at:r.offset + min(at + 4096, r.nbytes)])
                  for at in range(0, r.nbytes, 4096)) for r in plan.regions)
        assert [len(c) for c in copy.checksums][:1] == [3]  # 12000 bytes: 3 chunks
        for region, tensor in zip(plan.regions, tensors):
            assert bytes(_slot_bytes(slot, region).numpy()) == tensor.numpy().tobytes()
        skipping = pool.start(plan, sources, slot, skip={1}, checksums=True)
        skipping.wait()
        assert skipping.checksums == (copy.checksums[0], None)  # region 1 was not copied
        assert pool.start(plan, sources, slot).wait() >= 0
    finally:
        pool.close()


def test_a_slot_is_free_once_the_writer_and_the_keeper_each_released_it():
    pool = StagingPool(2)
    try:
        plan, _ = Planner().plan([torch.zeros(4)])
        first = pool.free_slot()
        pool.fit(first, plan, pin=False)
        pool.acquire(first, writer=True, keeper=True)
        second = pool.free_slot()
        assert second is not first
        pool.fit(second, plan, pin=False)
        pool.acquire(second, writer=True, keeper=False)
        assert pool.free_slot() is None
        pool.release_written(first.buffer_id)
        assert pool.free_slot() is None  # the keeper still holds it
        pool.release_held(first.buffer_id)
        assert pool.free_slot() is first
        pool.acquire(first, writer=False, keeper=True)
        pool.release(second)  # staged, never handed over
        assert pool.free_slot() is second
        pool.release_held()  # the keeper is gone: every slot it held comes back
        assert not (first.busy or first.held)
    finally:
        pool.close()


def test_capture_turns_the_state_into_a_safe_tree_and_a_tensor_list():
    model = torch.nn.Linear(2, 2)
    captured = capture({"model": model, "step": {"n": 3, "t": torch.ones(1)}})
    assert captured.tree["entries"]["model"]["kind"] == "object"
    assert captured.tree["entries"]["step"]["entries"]["n"] == {"kind": "value", "state": 3}
    assert len(captured.tensors) == 3 and captured.entry_of == ["model", "model", "step"]


@pytest.mark.parametrize("value, error", [
    (torch.zeros(3).to_sparse(), LayoutError),
    (object(), EncodingError),
])
def test_capture_refuses_what_it_cannot_restore(value, error):
    with pytest.raises(error):
        capture({"x": value})


def test_a_slot_cuda_refuses_to_pin_stays_pageable_said_once_counted_and_not_asked_again(
        monkeypatch, caplog):
    calls = []

    class RefusingRuntime:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(flags)
            return 712  # cudaErrorHostMemoryAlreadyRegistered: any code but 0 is a refusal

    monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingRuntime())
    plan, _ = Planner().plan([torch.ones(1000)])
    pool = StagingPool(2)
    try:
        with caplog.at_level("WARNING", logger="async_ckpt"):
            for slot in pool.slots:
                pool.fit(slot, plan, pin=True)
                pool.fit(slot, plan, pin=True)  # the same memory: not asked again
        assert calls == [1, 1] and pool.pin_failures == 2  # cudaHostRegisterPortable
        assert not any(slot.pinned for slot in pool.slots)
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert len(caplog.records) == 1 and "pin_failures" in caplog.records[0].message
    finally:
        pool.close()


def test_copy_nice_lowers_only_the_copy_thread():
    """``copy_nice`` (the engine's option) is added to the copy thread's niceness, not to the
    calling thread's."""

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    pool = StagingPool(1, copy_nice=3)
    try:
        before = niceness()
        assert pool._copy_thread().submit(niceness).result() == min(19, before + 3)
        assert niceness() == before
    finally:
        pool.close()
