"""Restore into the live objects' own memory, verified over the files' mappings, and
``load(mmap=True)``: what lands where, that nothing keeps a file mapped afterwards, and that
verification still comes before anything is overwritten."""

import copy
import gc
import glob
import os

import pytest
import torch
from torch.utils.data import TensorDataset

from async_ckpt import CheckpointEngine, load
from async_ckpt.data import ResumableLoader
from async_ckpt.errors import NoSnapshotError, StateMismatchError
from conftest import assert_same, bit_equal, make_training_state, train_step


def mapped_shards() -> list[str]:
    """Lines of this process's memory map that map a shard file (after collecting what an
    earlier test's exception tracebacks still hold)."""
    gc.collect()
    with open("/proc/self/maps") as f:
        return [line for line in f if ".ackpt" in line]


def shard_files(ckpt_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(ckpt_dir, "step-*", "*.ackpt")))


def addresses(model, opt) -> dict:
    """Where each parameter and optimizer state tensor's memory is."""
    found = {f"param {n}": p.data_ptr() for n, p in model.named_parameters()}
    for i, state in enumerate(opt.state.values()):
        found.update({f"state {i} {k}": v.data_ptr() for k, v in state.items()
                      if isinstance(v, torch.Tensor)})
    return found


def trained(ckpt_dir, steps=3, **options):
    model, opt, sched = make_training_state(seed=1)
    engine = CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}, **options)
    for step in range(steps):
        train_step(model, opt, sched)
        engine.snapshot(step, force=True)
    engine.wait()
    return engine, model, opt, sched


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_restore_copies_into_the_tensors_the_model_and_optimizer_already_hold(ckpt_dir, compression):
    engine, model, opt, sched = trained(ckpt_dir, compression=compression)
    with engine:
        expected = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        before = addresses(model, opt)
        train_step(model, opt, sched)  # move away from the snapshot
        assert engine.restore() == 2
        assert addresses(model, opt) == before  # no tensor was replaced by new memory
        assert_same(expected, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    gc.collect()
    assert mapped_shards() == []


def test_a_fresh_optimizer_gets_state_of_its_own_and_no_file_stays_mapped(ckpt_dir):
    engine, model, opt, sched = trained(ckpt_dir)
    engine.close()
    expected = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    model2, _, _ = make_training_state(seed=2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    assert not opt2.state
    with CheckpointEngine(ckpt_dir, {"model": model2, "optimizer": opt2}) as engine:
        assert engine.restore() == 2
        # No reference cycle keeps the mapping alive, and nothing restored points into it:
        gc.disable()
        try:
            assert engine.restore() == 2
            with open("/proc/self/maps") as f:
                assert not [line for line in f if ".ackpt" in line]
        finally:
            gc.enable()
    assert_same(expected, {"model": model2.state_dict(), "optimizer": opt2.state_dict()})
    torch.manual_seed(3)
    a = train_step(model, opt)
    torch.manual_seed(3)
    assert train_step(model2, opt2) == a  # the adopted state trains like the original


class Holder:
    """A user object that keeps the tensors its state dict hands it (two views of one tensor)."""

    def __init__(self):
        self.table = torch.zeros(64, 64)
        self.rows = self.table[:8]

    def state_dict(self):
        return {"table": self.table, "rows": self.rows}

    def load_state_dict(self, state):
        self.table, self.rows = state["table"], state["rows"]


def test_objects_that_keep_their_tensors_get_copies_that_still_share_memory(ckpt_dir):
    holder = Holder()
    holder.table.copy_(torch.randn(64, 64))
    saved = holder.table.clone()
    with CheckpointEngine(ckpt_dir, {"holder": holder, "plain": {"t": torch.ones(3)}}) as engine:
        engine.snapshot(0, force=True)
        engine.wait()
        holder.table.zero_()
        assert engine.restore() == 0
    assert mapped_shards() == []
    assert bit_equal(holder.table, saved)
    holder.rows.fill_(7)  # still a view of the table, as when saved
    assert bool((holder.table[:8] == 7).all())


def test_a_damaged_snapshot_changes_nothing_in_the_live_objects(ckpt_dir):
    engine, model, opt, sched = trained(ckpt_dir, steps=1)
    with engine:
        path, = shard_files(ckpt_dir)
        with open(path, "r+b") as f:  # flip a byte late in the data: most tensors verify
            f.seek(os.path.getsize(path) * 3 // 4)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        train_step(model, opt, sched)
        current = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        with pytest.raises(NoSnapshotError):
            engine.restore()
        assert_same(current, {"model": model.state_dict(), "optimizer": opt.state_dict()})


def test_a_misaligned_storage_is_read_instead_of_mapped(ckpt_dir):
    state = {"flags": torch.tensor([True, False, True]), "w": torch.randn(1000, dtype=torch.float64)}
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointEngine(ckpt_dir, state) as engine:
        engine.snapshot(0, force=True)
        engine.wait()
        for v in state.values():
            v.zero_()
        assert engine.restore() == 0
    assert all(bit_equal(state[k], expected[k]) for k in state)


def test_load_mmap_maps_uncompressed_tensors_without_checking_them(ckpt_dir):
    weights = torch.randn(256, 256)
    with CheckpointEngine(ckpt_dir, {"w": weights, "small": torch.arange(5)}) as engine:
        engine.snapshot(0, force=True)
        engine.wait()
    step, state = load(ckpt_dir, mmap=True)
    assert step == 0 and bit_equal(state["w"], weights) and mapped_shards() != []
    state["w"].add_(1)  # writes stay in this process
    del state
    assert mapped_shards() == []
    assert bit_equal(load(ckpt_dir)[1]["w"], weights)

    path, = shard_files(ckpt_dir)
    with open(path, "r+b") as f:  # damage the middle of the weights
        f.seek(16 + weights.nbytes // 2)
        f.write(b"\xff\xff\xff\xff")
    _, unchecked = load(ckpt_dir, mmap=True)  # not read, so not checked: as documented
    assert not bit_equal(unchecked["w"], weights)
    with pytest.raises(NoSnapshotError):
        load(ckpt_dir)


def test_load_mmap_reads_compressed_storages(ckpt_dir):
    weights = torch.zeros(512, 512)
    with CheckpointEngine(ckpt_dir, {"w": weights}, compression="zstd") as engine:
        engine.snapshot(0, force=True)
        engine.wait()
    _, state = load(ckpt_dir, mmap=True)
    assert bit_equal(state["w"], weights)
    assert mapped_shards() == []  # compressed: decoded into memory of its own


def slot_ranges(engine) -> list[range]:
    return [range(s.tensor.data_ptr(), s.tensor.data_ptr() + s.nbytes)
            for s in engine._pool.slots if s.tensor is not None]


def test_compressed_storages_are_decoded_into_a_free_staging_slot_and_never_kept_there(ckpt_dir):
    from async_ckpt.format.manifest import read_manifest
    from async_ckpt.read.snapshot import ReadOptions, read_snapshot
    from async_ckpt.storage.local import LocalStorage

    holder = Holder()
    holder.table.copy_(torch.randn(64, 64))
    saved = holder.table.clone()
    with CheckpointEngine(ckpt_dir, {"holder": holder}, compression="zstd") as engine:
        engine.snapshot(0, force=True)
        engine.wait()
        record = read_manifest(LocalStorage(ckpt_dir)).snapshots[-1]
        scratch = engine._pool.scratch()
        entry = read_snapshot(LocalStorage(ckpt_dir), record, how=ReadOptions(scratch=scratch))
        table = entry.value["holder"].value["table"]
        assert entry.borrowed and any(table.data_ptr() in r for r in slot_ranges(engine))
        assert bit_equal(table, saved)
        too_small = read_snapshot(LocalStorage(ckpt_dir), record,
                                  how=ReadOptions(scratch=scratch[:100]))
        assert not too_small.borrowed and bit_equal(too_small.value["holder"].value["table"], saved)
        del entry, table, too_small, scratch

        holder.table.zero_()
        assert engine.restore() == 0
        assert bit_equal(holder.table, saved)
        assert not any(holder.table.data_ptr() in r for r in slot_ranges(engine))
        engine.snapshot(1, force=True)  # overwrites a slot: the restored table must not change
        engine.wait()
        assert bit_equal(holder.table, saved)


class Refusing:
    """A registered object whose load_state_dict refuses what its state_dict gave."""

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        raise RuntimeError("not today")


class FailingCopy(torch.nn.Linear):
    """A module whose copy in place fails (as a device error would), after the checks passed."""

    fail = False

    def load_state_dict(self, state, strict=True):
        if self.fail:
            raise RuntimeError("device error")
        return super().load_state_dict(state, strict=strict)


def state_of(model, opt, other):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                          "other": other.state_dict()})


def test_an_object_that_refuses_its_state_puts_every_object_back(ckpt_dir):
    """README "Guarantees": an object's own load_state_dict refusing leaves nothing loaded."""
    model, opt, sched = make_training_state(seed=1)
    refusing = Refusing()
    with CheckpointEngine(ckpt_dir, {"optimizer": opt, "model": model, "x": refusing}) as engine:
        engine.snapshot(0, force=True)
        engine.wait()
        train_step(model, opt, sched)
        current = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        with pytest.raises(StateMismatchError, match="nothing was loaded"):
            engine.restore()
        assert_same(current, {"model": model.state_dict(), "optimizer": opt.state_dict()})


def test_a_refusal_puts_back_loaders_and_generators_by_their_state(ckpt_dir):
    """A loader's position lives in its sampler and a generator's state in C: neither is in
    the attributes restore keeps, so they are put back through their own state (the engine
    names the loaders to restore, which knows nothing of data.py)."""
    loader = ResumableLoader(TensorDataset(torch.arange(16.0)), batch_size=2, seed=3)
    generator = torch.Generator().manual_seed(5)
    state = {"loader": loader, "generator": generator, "x": Refusing()}
    with CheckpointEngine(ckpt_dir, state, rng=False) as engine:
        engine.snapshot(0, force=True)
        engine.wait()
        loader.advance(3)
        torch.rand(4, generator=generator)
        position, drawn = loader.state_dict(), generator.get_state()
        with pytest.raises(StateMismatchError, match="nothing was loaded"):
            engine.restore()
        assert loader.state_dict() == position and loader.consumed == 3
        assert torch.equal(generator.get_state(), drawn)


def test_a_failed_copy_in_place_is_not_undone_and_says_so(ckpt_dir):
    """README "Guarantees": the copies into modules and tensors are not undone; a module copied
    before the failure keeps the snapshot's values, objects are put back, and the error says
    to restore again."""
    model, opt, sched = make_training_state(seed=1)
    other = FailingCopy(4, 4)
    state = {"model": model, "other": other, "optimizer": opt}
    with CheckpointEngine(ckpt_dir, state) as engine:
        engine.snapshot(0, force=True)
        engine.wait()
        saved = state_of(model, opt, other)
        train_step(model, opt, sched)
        with torch.no_grad():
            other.weight.add_(1)
        current = state_of(model, opt, other)
        other.fail = True
        with pytest.raises(StateMismatchError, match="restore again before training"):
            engine.restore()
        after = state_of(model, opt, other)
        assert_same(saved["model"], after["model"])  # copied before the failure
        assert_same(current["other"], after["other"])
        assert_same(current["optimizer"], after["optimizer"])  # an object: put back
        other.fail = False
        assert engine.restore() == 0
        assert_same(saved, state_of(model, opt, other))


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the engine looks at to choose how to read."""

    @property
    def is_cuda(self):
        return True


def test_a_state_on_cuda_is_read_into_a_pinned_staging_slot_not_mapped(ckpt_dir, monkeypatch):
    """With CUDA tensors registered, restore reads every storage into a staging slot fitted to
    the state and page-locked (what tests/test_cuda.py runs on a device), so that the copies
    onto the device come from pinned memory; here CUDA is stood in for, on the CPU."""
    import async_ckpt.engine as engine_module

    model, opt, _ = make_training_state()
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}) as engine:
        engine.snapshot(1)
    expected = copy.deepcopy(model.state_dict())
    train_step(model, opt)

    registered = []

    class Runtime:
        def cudaHostRegister(self, ptr, nbytes, flags):
            registered.append(nbytes)
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    reads = []
    real_read = engine_module.read_committed

    def read_committed(*args, **kwargs):
        how = args[2]
        reads.append((how.mapped, how.scratch))
        return real_read(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(engine_module, "read_committed", read_committed)
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}) as engine:
        real_capture = engine._pipeline.capture

        def capture_on_cuda(state):
            captured = real_capture(state)
            captured.tensors = [t.detach().as_subclass(_OnCuda) for t in captured.tensors]
            return captured

        monkeypatch.setattr(engine._pipeline, "capture", capture_on_cuda)
        assert engine.restore() == 1
        slot = next(s for s in engine._pool.slots if s.pinned)
        assert registered == [slot.nbytes]
        [(mapped, scratch)] = reads
        assert not mapped and len(scratch) == slot.nbytes
    assert_same(model.state_dict(), expected)
