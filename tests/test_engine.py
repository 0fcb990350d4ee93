"""The engine end to end, in one process: snapshot, commit, retention, restore, errors."""

import copy
import logging
import math
import os
import resource
import signal

import numpy as np
import psutil
import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.errors import (CheckpointDirError, CorruptSnapshotError, DirectoryInUseError,
                               DistributedSetupError, EncodingError, InvalidArgumentError,
                               EngineClosedError, LayoutError, ManifestError, NoSnapshotError,
                               StagingMemoryError, StateMismatchError, WriterDiedError)
from async_ckpt.format.manifest import read_manifest
from conftest import assert_same, bit_equal, make_training_state, train_step


def test_round_trip_restores_model_optimizer_scheduler_bit_for_bit(ckpt_dir):
    model, opt, sched = make_training_state(seed=1)
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt, "scheduler": sched}) as engine:
        assert engine.restore() is None
        for step in range(4):
            train_step(model, opt, sched)
            engine.snapshot(step)
        engine.wait()
        assert engine.committed_steps() == [1, 2, 3]
    expected = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                              "scheduler": sched.state_dict()})

    model2, opt2, sched2 = make_training_state(seed=2)
    with CheckpointEngine(ckpt_dir, {"model": model2, "optimizer": opt2, "scheduler": sched2}) as engine:
        assert engine.restore() == 3
    assert_same(expected, {"model": model2.state_dict(), "optimizer": opt2.state_dict(),
                           "scheduler": sched2.state_dict()})
    # Training continues identically from the restored state.
    torch.manual_seed(7)
    a = train_step(model, opt, sched)
    torch.manual_seed(7)
    assert train_step(model2, opt2, sched2) == a


def test_snapshot_is_an_image_of_the_state_when_it_returned(ckpt_dir):
    weights = torch.randn(512, 1024)
    before = weights.clone()
    with CheckpointEngine(ckpt_dir, {"w": weights}, slots=1) as engine:
        engine.snapshot(0)
        weights.add_(1.0)  # the writer is most likely still writing: this must not leak in
        weights[0, 0] = float("nan")
        engine.wait()
    assert bit_equal(load(ckpt_dir)[1]["w"], before)


def test_every_and_force(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(3)}, every=5, keep_last=10) as engine:
        taken = [engine.snapshot(step) for step in range(12)]
        assert engine.snapshot(13, force=True)
        engine.wait()
        assert taken == [step % 5 == 0 for step in range(12)]
        assert engine.committed_steps() == [0, 5, 10, 13]


def test_keep_last_and_keep_every_delete_only_dropped_snapshots(ckpt_dir):
    t = torch.zeros(4)
    with CheckpointEngine(ckpt_dir, {"t": t}, keep_last=2, keep_every=4) as engine:
        for step in range(10):
            t.fill_(step)
            engine.snapshot(step)
        engine.wait()
        assert engine.committed_steps() == [0, 4, 8, 9]
    dirs = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step-"))
    assert [int(d[5:25]) for d in dirs] == [0, 4, 8, 9]
    for step in (0, 4, 8, 9):
        assert load(ckpt_dir, step)[1]["t"].tolist() == [float(step)] * 4


def test_sync_mode_returns_after_commit(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.ones(8)}, mode="sync") as engine:
        engine.snapshot(3)
        assert engine.committed_steps() == [3]
        stats = engine.stats()
        assert stats["in_flight"] == 0
        record = stats["snapshots"][-1]
        assert record["blocking_s"] >= record["write_s"] + record["fsync_s"]  # it waited for all


def test_skip_when_every_slot_is_busy(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.ones(8)}, slots=1, when_busy="skip") as engine:
        engine.snapshot(0)
        engine.wait()
        os.kill(engine._writer.pid, signal.SIGSTOP)  # the writer cannot free the slot
        try:
            assert engine.snapshot(1)
            assert not engine.snapshot(2)
            assert not engine.snapshot(3)
        finally:
            os.kill(engine._writer.pid, signal.SIGCONT)
        engine.wait()
        assert engine.stats()["skipped"] == 2
        assert engine.committed_steps() == [0, 1]


def test_wait_for_slot_when_every_slot_is_busy(ckpt_dir):
    t = torch.zeros(1000)
    with CheckpointEngine(ckpt_dir, {"t": t}, slots=1, keep_last=5) as engine:
        for step in range(5):
            t.fill_(step)
            assert engine.snapshot(step)
        engine.wait()
        assert engine.committed_steps() == [0, 1, 2, 3, 4]
        assert [load(ckpt_dir, s)[1]["t"][0].item() for s in range(5)] == [0, 1, 2, 3, 4]


def test_layout_change_replans_the_pool(ckpt_dir):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters())  # no state until the first step
    state = {"model": model, "optimizer": opt}
    with CheckpointEngine(ckpt_dir, state) as engine:
        engine.snapshot(0)
        train_step(torch.nn.Sequential(model), opt)
        engine.snapshot(1)
        state["extra"] = torch.arange(100000)
        engine.snapshot(2)
        engine.wait()
    _, loaded = load(ckpt_dir, 1)
    assert set(loaded) == {"model", "optimizer"} and len(loaded["optimizer"]["state"]) == 2
    _, loaded = load(ckpt_dir, 2)
    assert torch.equal(loaded["extra"], torch.arange(100000))
    assert_same(loaded["optimizer"], opt.state_dict())


ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
              torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_dtype_and_tensor_shape_round_trips(ckpt_dir, compression):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in ALL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        base = (torch.randn(4096, generator=g) * 100).to(torch.float64)
        tensors[name] = base.to(dtype) if not dtype.is_complex else torch.complex(base, -base).to(dtype)
        tensors[name + "_scalar"] = tensors[name][3].clone()  # 0-d
        tensors[name + "_empty"] = torch.empty(0, 7, dtype=dtype)
    big = torch.randn(64, 48, generator=g)
    tensors.update(transposed=big.t(), sliced=big[5:9, ::3], expanded=torch.randn(3, 1).expand(3, 5),
                   nan_inf=torch.tensor([math.nan, math.inf, -math.inf, -0.0]),
                   conj=torch.randn(4, dtype=torch.complex64, generator=g).conj())
    with CheckpointEngine(ckpt_dir, {"tensors": tensors}, compression=compression) as engine:
        engine.snapshot(0)
        engine.wait()
    _, loaded = load(ckpt_dir)
    for name, t in tensors.items():
        got = loaded["tensors"][name]
        assert got.shape == t.shape and got.dtype == t.dtype, name
        assert bit_equal(got, t.resolve_conj()), name
    assert loaded["tensors"]["transposed"].stride() == big.t().stride()


def test_tensors_sharing_storage_share_it_again(ckpt_dir):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.head = torch.nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    base = torch.arange(20.0)
    with CheckpointEngine(ckpt_dir, {"model": model, "views": {"a": base[:10], "b": base[5:]}},
                          rng=False) as engine:
        engine.snapshot(0)
        engine.wait()
        stored = engine.stats()["snapshots"][-1]["raw_bytes"]
    assert stored < 2 * 50 * 8 * 4  # the tied weight is written once
    _, loaded = load(ckpt_dir)
    sd = loaded["model"]
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    a, b = loaded["views"]["a"], loaded["views"]["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(a, base[:10]) and torch.equal(b, base[5:])

    fresh = Tied()
    with CheckpointEngine(ckpt_dir, {"model": fresh, "views": {"a": torch.empty(10), "b": torch.empty(15)}}) as engine:
        engine.restore()
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_plain_values_round_trip(ckpt_dir):
    values = {
        "big_int": 2 ** 100 + 1, "neg": -(2 ** 70), "floats": [math.inf, -math.inf, -0.0, 1e-300],
        "nan": math.nan, "text": "résumé ✓", "raw": b"\x00\xff", "tuple": (1, (2, "x")),
        "int_keys": {1: "a", -5: "b"}, "none": None, "flag": True,
        "array": np.arange(12, dtype=np.int16).reshape(3, 4), "scalar": np.float32(1.5),
        "rng": np.random.RandomState(3).get_state(), "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
    }
    state = {"values": dict(values)}
    with CheckpointEngine(ckpt_dir, state) as engine:
        engine.snapshot(0)
        engine.wait()
        state["values"].clear()
        assert engine.restore() == 0
    restored = state["values"]
    for key, value in values.items():
        if isinstance(value, np.ndarray):
            assert restored[key].dtype == value.dtype and np.array_equal(restored[key], value)
        elif key == "rng":
            assert restored[key][0] == value[0] and np.array_equal(restored[key][1], value[1])
            assert restored[key][2:] == value[2:]
        elif key == "nan":
            assert math.isnan(restored[key])
        else:
            assert restored[key] == value and type(restored[key]) is type(value), key
    assert math.copysign(1, restored["floats"][2]) == -1


def test_unencodable_value_is_refused_with_its_path_when_registered(tmp_path):
    """At CheckpointEngine(), not after ``every`` steps of training (issue 26)."""
    with pytest.raises(EncodingError, match=r"config\.schedule\.fn"):
        CheckpointEngine(tmp_path / "ckpt", {"config": {"schedule": {"fn": lambda x: x}}})
    assert not (tmp_path / "ckpt").exists()


def test_a_value_that_becomes_unencodable_is_refused_at_the_snapshot(ckpt_dir):
    state = {"config": {"schedule": {"fn": "linear"}}}
    with CheckpointEngine(ckpt_dir, state) as engine:
        state["config"]["schedule"]["fn"] = lambda x: x
        with pytest.raises(EncodingError, match=r"config\.schedule\.fn"):
            engine.snapshot(0)
        assert engine.committed_steps() == []
        state["config"]["schedule"]["fn"] = "linear"
        engine.snapshot(1)  # the engine is still usable
        engine.wait()
        assert engine.committed_steps() == [1]


class _Opaque:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, _Opaque) and other.x == self.x


def test_pickle_only_when_opted_in(ckpt_dir):
    state = {"meta": {"obj": _Opaque(3)}}
    with CheckpointEngine(ckpt_dir, state, allow_pickle=True) as engine:
        engine.snapshot(0)
        engine.wait()
    with pytest.raises(EncodingError, match="allow_pickle"):
        load(ckpt_dir)
    assert load(ckpt_dir, allow_pickle=True)[1]["meta"]["obj"] == _Opaque(3)


def test_unsupported_tensor_is_refused_with_its_path(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"m": {"sparse": torch.eye(3).to_sparse()}}) as engine:
        with pytest.raises(LayoutError, match=r"m\.sparse"):
            engine.snapshot(0)


def test_mismatched_state_is_refused_before_anything_loads(ckpt_dir):
    model, opt, _ = make_training_state(width=16)
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}) as engine:
        engine.snapshot(0)
        engine.wait()

    other = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4),
                                torch.nn.Linear(4, 4))
    before = copy.deepcopy(other.state_dict())
    other_opt = torch.optim.AdamW(other.parameters())
    with CheckpointEngine(ckpt_dir, {"model": other, "optimizer": other_opt, "new": torch.zeros(2)}) as engine:
        with pytest.raises(StateMismatchError) as info:
            engine.restore()
    message = str(info.value)
    assert 'model["3.weight"]' in message and "new" in message  # missing from the checkpoint
    assert 'model["0.weight"]' in message  # shape mismatch
    assert_same(before, other.state_dict())  # nothing half-loaded

    # strict=False loads what fits.
    partial = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4),
                                  torch.nn.Linear(4, 4))
    with CheckpointEngine(ckpt_dir, {"model": partial}) as engine:
        assert engine.restore(strict=False) == 0
    assert torch.equal(partial[0].weight, model[0].weight)


def test_restore_of_an_uncommitted_step_is_refused(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(2)}) as engine:
        engine.snapshot(1)
        engine.wait()
        with pytest.raises(NoSnapshotError, match="step 5 is not committed"):
            engine.restore(step=5)
        assert engine.restore(step=1) == 1


def test_restore_skips_the_named_entries_and_loads_the_rest(ckpt_dir):
    t, position = torch.zeros(2), {"batch": 0}
    with CheckpointEngine(ckpt_dir, {"t": t, "position": position}) as engine:
        t.fill_(3)
        position["batch"] = 7
        engine.snapshot(1)
        t.fill_(-1)
        position["batch"] = 9
        assert engine.restore(skip=["position"]) == 1
        assert t.tolist() == [3, 3] and position == {"batch": 9}
        with pytest.raises(InvalidArgumentError, match="collection of entry names"):
            engine.restore(skip="position")  # a string is not a collection of names


def test_restore_after_rewind_takes_the_newest_commit(ckpt_dir):
    t = torch.zeros(2)
    with CheckpointEngine(ckpt_dir, {"t": t}, keep_last=3) as engine:
        for step in (10, 11, 12):
            t.fill_(step)
            engine.snapshot(step)
        engine.wait()
        engine.restore(step=10)
        t.fill_(-11)
        engine.snapshot(11)  # a new timeline from step 10
        engine.wait()
        assert engine.committed_steps() == [10, 12, 11]
        assert engine.restore() == 11 and t[0].item() == -11


def test_dead_writer_raises_instead_of_hanging(ckpt_dir):
    t = torch.zeros(1 << 20)
    engine = CheckpointEngine(ckpt_dir, {"t": t})
    engine.snapshot(0)
    engine.wait()
    os.kill(engine._writer.pid, signal.SIGKILL)
    engine._writer.process.wait()
    with pytest.raises(WriterDiedError, match="killed by signal 9"):
        engine.snapshot(1)
    with pytest.raises(WriterDiedError):
        engine.wait()
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.snapshot(2)
    with CheckpointEngine(ckpt_dir, {"t": t}) as fresh:
        assert fresh.restore() == 0


def test_second_engine_on_the_same_directory_is_refused(ckpt_dir):
    """As the directory in use, not as a bad directory (issue 28, finding 7)."""
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(2)}):
        with pytest.raises(DirectoryInUseError, match="another engine"):
            CheckpointEngine(ckpt_dir, {"t": torch.zeros(2)}, lock_timeout=0.2)


def test_unusable_directory_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointDirError):
        CheckpointEngine(str(blocker / "ckpt"), {"t": torch.zeros(1)})
    with pytest.raises(CheckpointDirError):
        CheckpointEngine(str(blocker), {"t": torch.zeros(1)})


def test_invalid_arguments_are_refused(ckpt_dir):
    for kwargs in ({"mode": "fast"}, {"every": 0}, {"keep_last": 0}, {"when_busy": "drop"},
                   {"compression": "lz4"}, {"rank": 1}):
        with pytest.raises(ValueError):
            CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, **kwargs)
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}) as engine:
        for step in (-1, 1.5, True):
            with pytest.raises(ValueError):
                engine.snapshot(step)


def test_stats_report_every_stage(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.randn(1 << 18)}) as engine:
        engine.snapshot(0)
        engine.wait()
        stats = engine.stats()
        assert psutil.Process(stats["writer_pid"]).ppid() == os.getpid()  # the writer process
    (record,) = stats["snapshots"]
    for key in ("blocking_s", "staging_s", "capture_s", "write_s", "fsync_s", "commit_s",
                "to_commit_s", "staging_gbps", "durable_gbps"):
        assert record[key] >= 0, key
    assert 0 < record["encode_cpu_s"]  # a megabyte checksummed
    assert record["to_commit_s"] >= record["blocking_s"]
    assert record["raw_bytes"] >= 4 << 18 and record["stored_bytes"] > record["raw_bytes"]
    assert stats["committed"] == 1 and stats["pool_bytes"] >= 2 * (4 << 18)
    assert stats["writer_rss"] > 0 and stats["trainer_rss"] > 0


def test_compression_shrinks_float_and_integer_state(ckpt_dir):
    state = {"w": (torch.randn(1 << 18) * 0.02), "ids": torch.zeros(1 << 18, dtype=torch.int64)}
    with CheckpointEngine(ckpt_dir, state, compression="zstd") as engine:
        engine.snapshot(0)
        engine.wait()
        record = engine.stats()["snapshots"][-1]
    assert record["stored_bytes"] < 0.6 * record["raw_bytes"]
    _, loaded = load(ckpt_dir)
    assert_same(loaded, state)


def test_host_memory_stays_flat_over_a_hundred_snapshots(ckpt_dir):
    """From snapshot 40 (slots, pools and caches warm) to 160, neither process grows by 16 MiB:
    a leak of a staging copy (4 MiB here) or of 140 KB per snapshot would."""
    model, opt, sched = make_training_state(width=256)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "big": torch.randn(1 << 20)}
    with CheckpointEngine(ckpt_dir, state, keep_last=2) as engine:
        for step in range(160):
            engine.snapshot(step)
            if step == 40:
                engine.wait()
                early = engine.stats()
        engine.wait()
        late = engine.stats()
    assert late["committed"] == 160
    growth_trainer = late["trainer_rss"] - early["trainer_rss"]
    growth_writer = late["writer_rss"] - early["writer_rss"]
    assert growth_trainer < 16 << 20, growth_trainer
    assert growth_writer < 16 << 20, growth_writer
    assert len([d for d in os.listdir(ckpt_dir) if d.startswith("step-")]) == 2


def test_writer_process_never_imports_torch():
    import subprocess
    import sys
    code = "import sys, async_ckpt.write.writer; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_closes_on_context_exit_even_after_an_error(ckpt_dir):
    with pytest.raises(RuntimeError):
        with CheckpointEngine(ckpt_dir, {"t": torch.zeros(2)}) as engine:
            engine.snapshot(0)
            raise RuntimeError("training crashed")
    assert engine._closed
    assert load(ckpt_dir)[0] == 0
    CheckpointEngine(ckpt_dir, {"t": torch.zeros(2)}, lock_timeout=5).close()


def test_module_state_dict_metadata_survives(ckpt_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with CheckpointEngine(ckpt_dir, {"model": model}) as engine:
        engine.snapshot(0)
        engine.wait()
    loaded = load(ckpt_dir)[1]["model"]
    assert loaded._metadata == model.state_dict()._metadata
    assert loaded._metadata["1"]["version"] == torch.nn.BatchNorm1d._version


def test_staging_memory_failure_is_typed_and_recoverable(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(4 << 20)}) as engine:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, hard))  # memfd slots count as files
        try:
            with pytest.raises(StagingMemoryError, match="staging buffer"):
                engine.snapshot(0)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        engine.snapshot(1)
        engine.wait()
        assert engine.committed_steps() == [1]


def _newest_shard(directory):
    record = read_manifest(LocalStorage(directory)).snapshots[-1]
    return os.path.join(directory, record.dir, record.shards[0].file)


def _three_snapshots(ckpt_dir):
    t = torch.zeros(1 << 16)
    with CheckpointEngine(ckpt_dir, {"t": t}, compression="zstd") as engine:
        for step in range(3):
            t.copy_(torch.randn(1 << 16) * 0.02)
            engine.snapshot(step)
            engine.wait()
    return t.clone()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_newest_snapshot_falls_back_to_the_previous_one(ckpt_dir, damage, caplog):
    _three_snapshots(ckpt_dir)
    expected_step1 = load(ckpt_dir, 1)[1]["t"]
    path = _newest_shard(ckpt_dir)
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x10]))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.unlink(path)
    target = {"t": torch.empty(1 << 16)}
    with CheckpointEngine(ckpt_dir, target) as engine:
        assert engine.restore() == 1
        with pytest.raises(CorruptSnapshotError):
            engine.restore(step=2)  # an explicit step never falls back
    assert bit_equal(target["t"], expected_step1)
    assert "step 2 is unusable" in caplog.text


def test_every_snapshot_damaged_raises_and_loads_nothing(ckpt_dir):
    _three_snapshots(ckpt_dir)
    for record in read_manifest(LocalStorage(ckpt_dir)).snapshots:
        path = os.path.join(ckpt_dir, record.dir, record.shards[0].file)
        os.truncate(path, 100)
    target = {"t": torch.full((1 << 16,), 7.0)}
    with CheckpointEngine(ckpt_dir, target) as engine:
        with pytest.raises(NoSnapshotError, match="every committed snapshot"):
            engine.restore()
    assert torch.all(target["t"] == 7.0)


def test_the_fallback_is_decided_by_the_error_s_class_even_for_a_new_one(ckpt_dir):
    from async_ckpt.errors import CheckpointError
    from async_ckpt.read.snapshot import read_committed

    class NewKindOfDamage(CorruptSnapshotError):
        pass

    class NotDamage(CheckpointError):
        pass

    _three_snapshots(ckpt_dir)
    seen = []

    def newest_is(error_type):
        def check(entry):
            seen.append(entry)
            if len(seen) == 1:
                raise error_type("the newest snapshot fails the check")
        return check

    record, _ = read_committed(LocalStorage(ckpt_dir), check=newest_is(NewKindOfDamage))
    assert record.step == 1 and len(seen) == 2
    seen.clear()
    with pytest.raises(NotDamage):
        read_committed(LocalStorage(ckpt_dir), check=newest_is(NotDamage))  # raised, not skipped
    assert len(seen) == 1


def test_garbage_manifest_is_a_typed_error(ckpt_dir):
    _three_snapshots(ckpt_dir)
    with open(os.path.join(ckpt_dir, "manifest.json"), "wb") as f:
        f.write(b"\x00garbage{")
    with pytest.raises(ManifestError):
        load(ckpt_dir)


def test_global_rng_states_are_saved_and_restored(ckpt_dir):
    import random
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}) as engine:
        engine.snapshot(0)
        engine.wait()
        expected = (random.random(), np.random.rand(), torch.rand(3))
        random.seed(9)
        np.random.seed(9)
        torch.manual_seed(9)
        assert engine.restore() == 0
        got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_rng_can_be_left_alone(ckpt_dir):
    torch.manual_seed(3)
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, rng=False) as engine:
        engine.snapshot(0)
        engine.wait()
        torch.manual_seed(9)
        expected = torch.rand(3)
        torch.manual_seed(9)
        engine.restore()
        assert torch.equal(torch.rand(3), expected)
    assert "__async_ckpt_rng__" not in load(ckpt_dir)[1]


def test_user_generators_are_ordinary_state(ckpt_dir):
    gen = torch.Generator().manual_seed(5)
    np_gen = np.random.default_rng(6)
    legacy = np.random.RandomState(7)
    with CheckpointEngine(ckpt_dir, {"gen": gen, "np_gen": np_gen, "legacy": legacy}) as engine:
        engine.snapshot(0)
        engine.wait()
        expected = (torch.rand(4, generator=gen), np_gen.random(3), legacy.rand(2))
        gen.manual_seed(123)
        np_gen.random(10)
        legacy.seed(1)
        engine.restore()
    assert torch.equal(torch.rand(4, generator=gen), expected[0])
    assert np.array_equal(np_gen.random(3), expected[1])
    assert np.array_equal(legacy.rand(2), expected[2])


def test_a_lost_manifest_is_rebuilt_instead_of_deleting_every_snapshot(ckpt_dir, caplog):
    expected = _three_snapshots(ckpt_dir)
    os.unlink(os.path.join(ckpt_dir, "manifest.json"))
    os.mkdir(os.path.join(ckpt_dir, "step-00000000000000000009.0badc0de"))  # an interrupted write
    target = {"t": torch.empty(1 << 16)}
    with CheckpointEngine(ckpt_dir, target) as engine:
        assert engine.committed_steps() == [0, 1, 2]
        assert engine.restore() == 2
    assert bit_equal(target["t"], expected)
    assert "rebuilt it from 3 complete snapshot(s)" in caplog.text
    assert not os.path.exists(os.path.join(ckpt_dir, "step-00000000000000000009.0badc0de"))


def test_several_ranks_need_torch_distributed(ckpt_dir):
    with pytest.raises(DistributedSetupError, match="init_process_group"):
        CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, rank=0, world_size=2)
    with pytest.raises(ValueError, match="both rank and world_size"):
        CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, rank=1)
    assert not os.path.exists(ckpt_dir)  # refused before the directory was touched
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}) as engine:
        assert (engine.rank, engine.world_size) == (0, 1)


def test_an_engine_dropped_without_close_frees_the_directory(ckpt_dir):
    import gc
    engine = CheckpointEngine(ckpt_dir, {"t": torch.ones(3)})
    engine.snapshot(0)
    writer = engine._writer.process
    del engine
    gc.collect()
    assert writer.wait(timeout=60) == 0  # it finished what was staged, then exited
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(3)}, lock_timeout=5) as engine:
        assert engine.restore() == 0


def test_non_strict_restore_leaves_an_optimizer_whose_state_fits_other_parameters(ckpt_dir, caplog):
    """Adam moments shaped for other parameters are not loaded (the first step would crash);
    what was skipped is reported, and what fits is loaded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    with CheckpointEngine(ckpt_dir, {"model": model, "optimizer": opt}) as engine:
        engine.snapshot(0)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))  # head resized
    wider_opt = torch.optim.AdamW(wider.parameters())
    with CheckpointEngine(ckpt_dir, {"model": wider, "optimizer": wider_opt}) as engine:
        with pytest.raises(StateMismatchError, match="exp_avg"):
            engine.restore()
        with caplog.at_level(logging.WARNING, logger="async_ckpt"):
            assert engine.restore(strict=False) == 0
    assert "optimizer" in caplog.text and "left these as they were" in caplog.text
    assert torch.equal(wider[0].weight, model[0].weight) and wider_opt.state == {}
    wider(torch.randn(3, 8)).sum().backward()
    wider_opt.step()  # consistent: it starts from fresh moments


@pytest.mark.parametrize("make", [torch.optim.NAdam, torch.optim.Adam, torch.optim.SGD,
                                  torch.optim.Adagrad, torch.optim.RMSprop])
def test_every_builtin_optimizer_state_fits_its_parameters(ckpt_dir, make):
    model = torch.nn.Linear(3, 2)
    opt = make(model.parameters(), lr=0.1, **({"momentum": 0.9} if make is torch.optim.SGD else {}))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with CheckpointEngine(ckpt_dir, {"optimizer": opt}, heartbeat_interval=None) as engine:
        engine.snapshot(0)
    fresh = make(torch.nn.Linear(3, 2).parameters(), lr=0.1,
                 **({"momentum": 0.9} if make is torch.optim.SGD else {}))
    with CheckpointEngine(ckpt_dir, {"optimizer": fresh}, heartbeat_interval=None) as engine:
        assert engine.restore() == 0
    assert_same(opt.state_dict()["state"], fresh.state_dict()["state"])


def test_stats_committed_at_is_unix_time_like_the_manifest(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(4)}, heartbeat_interval=None) as engine:
        engine.snapshot(2)
        engine.wait()
        ours = engine.stats()["snapshots"][-1]["committed_at"]
    manifest = read_manifest(LocalStorage(ckpt_dir)).find(2).committed_at
    assert abs(ours - manifest) < 60  # same clock (a monotonic time would be decades off)


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mapped"])
def test_damage_names_the_tensors_of_the_damaged_storage(ckpt_dir, mmap):
    from async_ckpt.errors import ChecksumMismatchError

    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with CheckpointEngine(ckpt_dir, {"model": model}, rng=False) as engine:
        engine.snapshot(0)
    from async_ckpt.format.shard import ShardReader

    record = read_manifest(LocalStorage(ckpt_dir)).snapshots[-1]
    shard = os.path.join(ckpt_dir, record.dir, record.shards[0].file)
    with ShardReader(shard) as reader:
        offset = reader.index["storages"][0]["chunks"][0]["offset"] + 100
    with open(shard, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError, match=r'storage 0 .*\(it holds model\["0\.weight"\]\)'):
        load(ckpt_dir, 0, mmap=mmap, verify=True)
