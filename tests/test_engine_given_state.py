"""The engine's entry points for code that builds what it saves anew each time and applies it
itself (a framework's checkpoint dict): ``snapshot(step, state=...)``, ``load()`` and ``drop()``."""

import copy
import os
import random

import pytest
import torch

import async_ckpt
from async_ckpt import CheckpointEngine
from async_ckpt.errors import EngineClosedError, NoSnapshotError
from conftest import assert_same, make_training_state, train_step


def framework_dict(model, opt, sched, step):
    """What a framework hands over at each save: a fresh dict whose tensors are the live
    parameters and optimizer state, next to counters, lists and strings."""
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [sched.state_dict()], "global_step": step,
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": step // 4}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": f"s{step}"}},
            "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.01, "layers": [3, 4]}}


def test_a_given_dict_is_snapshotted_in_reused_slots_and_loaded_back(ckpt_dir):
    model, opt, sched = make_training_state(seed=1)
    with CheckpointEngine(ckpt_dir, {}, keep_last=10, slots=1) as engine:
        pools = set()
        for step in range(4):
            train_step(model, opt, sched)
            engine.snapshot(step, state=framework_dict(model, opt, sched, step))
            expected = copy.deepcopy(framework_dict(model, opt, sched, step))
            pools.add(engine.stats()["pool_bytes"])
        assert len(pools) == 1  # the same slots, save after save
        with torch.no_grad():
            for p in model.parameters():  # changes after the snapshot never reach it
                p.add_(1.0)
        step, loaded = engine.load()
    assert step == 3
    assert_same(loaded, expected)


def test_load_sets_the_global_rng_as_it_was_at_the_snapshot(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {}) as engine:
        random.seed(5)
        torch.manual_seed(5)
        engine.snapshot(0, state={"x": torch.zeros(2)})
        draws = (random.random(), torch.rand(3))
        random.seed(99)
        torch.manual_seed(99)
        assert engine.load()[0] == 0
        assert random.random() == draws[0] and torch.equal(torch.rand(3), draws[1])


def test_load_of_a_step_and_of_nothing(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {}, keep_last=5) as engine:
        with pytest.raises(NoSnapshotError, match="no committed snapshot"):
            engine.load()
        with pytest.raises(NoSnapshotError, match="no committed snapshot"):
            async_ckpt.load(ckpt_dir)  # the same answer from the reader without an engine
        assert engine.restore() is None  # a job's first start
        for step in (1, 2):
            engine.snapshot(step, state={"v": torch.full((3,), float(step))})
        assert torch.equal(engine.load(1)[1]["v"], torch.full((3,), 1.0))
        assert torch.equal(engine.load()[1]["v"], torch.full((3,), 2.0))


def test_drop_takes_steps_out_once_committed_and_deletes_them(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1000)}, keep_last=10) as engine:
        for step in range(4):
            engine.snapshot(step)
        assert engine.drop([3, 1, 7]) == [1, 3]  # 3 was in flight: committed, then dropped
        assert engine.committed_steps() == [0, 2]
        assert len([n for n in os.listdir(engine.root) if n.startswith("step-")]) == 2
        assert engine.drop([]) == []
        with pytest.raises(ValueError):
            engine.drop(["1"])
    with pytest.raises(EngineClosedError):
        engine.drop([0])


@pytest.mark.parametrize("staging", ["eager", "lazy"])
def test_a_queued_drop_returns_at_once_and_applies_after_the_snapshots_before_it(ckpt_dir,
                                                                                  staging):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1000)}, keep_last=10,
                          staging=staging) as engine:
        for step in range(4):
            engine.snapshot(step)
            assert engine.drop([step - 1] if step else [], wait=False) is None
        engine.wait()  # also waits for the queued drops
        assert engine.committed_steps() == [3]
        assert engine.drop([3], wait=False) is None
    with CheckpointEngine(ckpt_dir, {}) as again:
        assert again.committed_steps() == []  # close() applied the last drop too


def test_markers_appear_once_the_snapshot_is_committed_and_never_for_a_failed_one(ckpt_dir,
                                                                                 tmp_path):
    from async_ckpt import Marker
    from async_ckpt.errors import DiskFullError

    pointer, directory = tmp_path / "out" / "last.ckpt", tmp_path / "out" / "checkpoint-7"
    with CheckpointEngine(ckpt_dir, {}) as engine:
        engine.snapshot(7, state={"v": torch.ones(4)}, markers=[
            Marker(str(pointer), b"step 7"),
            Marker(str(directory), files=(("state.json", b"{}"), ("pointer", b"7")))])
        engine.wait()
    assert pointer.read_bytes() == b"step 7"
    assert sorted(os.listdir(directory)) == ["pointer", "state.json"]
    assert [n for n in os.listdir(tmp_path / "out") if n.startswith(".")] == []  # no temporaries
    missing = tmp_path / "out" / "never.ckpt"
    with CheckpointEngine(ckpt_dir, {}, reserve_bytes=1 << 60) as engine:  # the disk is "full"
        engine.snapshot(8, state={"v": torch.ones(4)}, markers=[Marker(str(missing), b"8")])
        with pytest.raises(DiskFullError):
            engine.wait()
    assert not missing.exists()


def test_a_marker_directory_is_replaced_whole(tmp_path):
    from async_ckpt.storage.local import atomic_directory

    target = tmp_path / "checkpoint-3"
    atomic_directory(str(target), [("a", b"1"), ("b", b"2")])
    atomic_directory(str(target), [("c", b"3")])
    assert sorted(os.listdir(target)) == ["c"] and os.listdir(tmp_path) == ["checkpoint-3"]
    for bad in ("../x", "", "."):
        with pytest.raises(ValueError):
            atomic_directory(str(target), [(bad, b"")])
    assert sorted(os.listdir(target)) == ["c"] and os.listdir(tmp_path) == ["checkpoint-3"]


def test_a_drop_deletes_its_files_in_the_same_turn(ckpt_dir, tmp_path):
    from async_ckpt import Marker

    pointer = tmp_path / "out" / "a.ckpt"
    with CheckpointEngine(ckpt_dir, {}, keep_last=5) as engine:
        engine.snapshot(1, state={"v": torch.ones(2)}, markers=[Marker(str(pointer), b"1")])
        engine.drop([1], wait=False, files=[pointer])  # queued behind the save: it goes after
        engine.wait()
        assert engine.committed_steps() == [] and not pointer.exists()
        engine.snapshot(2, state={"v": torch.ones(2)})
        assert engine.drop([2], files=[tmp_path / "never-there"]) == [2]  # a missing file: fine
