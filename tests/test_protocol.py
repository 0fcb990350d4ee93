"""The trainer <-> writer protocol (write/protocol.py): every message and every error crosses the
process boundary intact, and damage is a property of an error's class."""

import inspect
import pickle

import pytest

from async_ckpt import errors
from async_ckpt.format.layout import Plan, Region, TensorRecord
from async_ckpt.write.protocol import (Abandoned, Attach, Close, CommitFigures, Committed, Detach,
                                       Failed, Ready, Released, ShardFigures, SnapshotJob,
                                       WriterConfig)

ERROR_CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
                 if issubclass(c, errors.CheckpointError)]


def round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_class_and_message(cls):
    back = round_trip(cls("what went wrong; what to do"))
    assert type(back) is cls and str(back) == "what went wrong; what to do"
    assert back.is_damage == cls.is_damage


def test_preempted_pickles_with_its_step_and_signal():
    back = round_trip(errors.Preempted(12, 15))
    assert (type(back), back.step, back.signal, back.code) == (
        errors.Preempted, 12, 15, errors.PREEMPTED_EXIT_CODE)


def test_damage_is_what_an_older_snapshot_may_not_have():
    damage = {c for c in ERROR_CLASSES if c.is_damage}
    assert damage == {errors.CorruptSnapshotError, errors.ChecksumMismatchError,
                      errors.UnsupportedFormatError}
    assert not errors.InsufficientMemoryError.is_damage  # restore must not skip the newest

    class NewDamage(errors.ChecksumMismatchError):
        pass

    assert NewDamage("x").is_damage  # inherited: a new subclass keeps the fallback


def config(**changes):
    settings = dict(root="/ckpt", rank=1, world_size=4, spread_replicated=True,
                    commit_timeout=120.0, keep_last=3, keep_every=None, compression="zstd",
                    level=1, reserve_bytes=0, nice=10, low_io_priority=True,
                    lock="/ckpt/.lock.rank00001", log_level=20, remote=None,
                    remote_options=None, remote_keep_last=1, own_root=False, direct_io=False)
    return WriterConfig(**{**settings, **changes})


def test_the_writer_config_survives_the_socket():
    for c in (config(), config(keep_every=100, compression=None),
              config(remote="s3://bucket/run", remote_options={"region": "x"})):
        assert pickle.loads(pickle.dumps(c)) == c


def test_every_message_pickles():
    plan = Plan((Region(0, 64, 4, True, "model"),), (TensorRecord(0, 0, "float32", (16,), (1,)),),
                64)
    messages = [Attach(3, 4096), Detach(3), Close(), Ready(1234), Released(3, 7),
                SnapshotJob(job=5, step=7, buffer_id=3, dir="step-00000000000000000007.ab12cd34",
                            tree={"kind": "dict", "entries": {}}, plan=plan, submitted=1.5),
                SnapshotJob(job=6, step=8, buffer_id=3, dir="d", tree={}, plan=None, submitted=2.0),
                Committed(5, CommitFigures(ShardFigures(write_s=0.5), committed_at=2.0,
                                           commit_s=0.25, raw_bytes=64, stored_bytes=80,
                                           disk_free_bytes=10**9, dropped_steps=(4,))),
                Abandoned(5, "why")]
    for message in messages:
        assert round_trip(message) == message
    failed = round_trip(Failed(5, errors.DiskFullError("disk full; free space")))
    assert failed.job == 5 and type(failed.error) is errors.DiskFullError
    assert str(failed.error) == "disk full; free space"
