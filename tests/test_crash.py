"""Real processes killed with SIGKILL at random moments, and file systems that run out of space:
every committed snapshot must still restore bit for bit, and nothing else may be restorable.

The random moments come from ``seeded_random`` (conftest.py): a failure reports its seed, and
ASYNC_CKPT_TEST_SEED=N makes the same choices again."""

import os
import resource
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.errors import DiskFullError, SnapshotWriteError
from async_ckpt.format.manifest import read_manifest
from conftest import assert_same

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")
sys.path.insert(0, PROGRAMS)
from snapshot_loop import frozen_at, state_at  # noqa: E402

pytestmark = pytest.mark.slow
MB = 24


def start_loop(directory, compression=None, incremental=False):
    return subprocess.Popen([sys.executable, os.path.join(PROGRAMS, "snapshot_loop.py"), directory,
                             str(MB)] + ([compression] if compression else [])
                            + (["incremental"] if incremental else []),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_a_commit(process):
    while True:
        line = process.stdout.readline()
        assert line, f"the training process exited early with code {process.wait()}"
        if not line.rstrip().endswith("[]"):
            return


def kill_group(process):
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    process.stdout.close()


def assert_every_committed_snapshot_exact(directory):
    steps = read_manifest(LocalStorage(directory)).steps()
    for step in steps:
        got_step, state = load(directory, step)
        expected = state_at(step, MB)
        assert got_step == step
        assert_same(expected["weights"], state["weights"])
        assert_same(expected["step_tensor"], state["step_tensor"])
        assert state["meta"] == expected["meta"]
    return steps


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_job_killed_at_random_moments_resumes_from_an_exact_snapshot(tmp_path, compression,
                                                                      seeded_random):
    directory = str(tmp_path / "ckpt")
    newest = -1
    for round_no in range(4):
        process = start_loop(directory, compression)
        wait_for_a_commit(process)
        time.sleep(seeded_random.uniform(0.0, 0.6))
        kill_group(process)  # trainer and writer together, as when a node dies
        steps = assert_every_committed_snapshot_exact(directory)
        assert steps, f"nothing committed after round {round_no}"
        assert steps[-1] >= newest, "a committed snapshot went missing"
        newest = steps[-1]


def test_killed_mid_incremental_snapshot_every_committed_one_restores(tmp_path, seeded_random):
    directory = str(tmp_path / "ckpt")
    for _ in range(3):
        process = start_loop(directory, incremental=True)
        wait_for_a_commit(process)
        time.sleep(seeded_random.uniform(0.0, 0.4))
        kill_group(process)
        steps = assert_every_committed_snapshot_exact(directory)
        frozen = frozen_at(MB)
        for step in steps:
            assert_same(frozen, load(directory, step)[1]["frozen"])


def test_trainer_killed_mid_snapshot_lets_its_writer_finish(tmp_path):
    directory = str(tmp_path / "ckpt")
    process = start_loop(directory)
    wait_for_a_commit(process)
    writer = psutil.Process(process.pid).children()[0]
    process.kill()  # the trainer only: its writer commits what was staged, then exits
    process.wait()
    process.stdout.close()
    writer.wait(timeout=60)
    assert_every_committed_snapshot_exact(directory)

    # A restarted job takes the directory over and resumes from the newest committed step.
    resumed = start_loop(directory)
    wait_for_a_commit(resumed)
    kill_group(resumed)
    assert_every_committed_snapshot_exact(directory)


_FORKING_TRAINER = """
import sys, time, torch
from async_ckpt import CheckpointEngine
from async_ckpt.data import ResumableLoader
loader = ResumableLoader(list(range(64)), batch_size=4, num_workers=2, seed=0)
engine = CheckpointEngine(sys.argv[1], {"m": torch.nn.Linear(4, 4), "loader": loader},
                          heartbeat_interval=None)
batches = iter(loader)
next(batches)  # the workers, forked from the trainer, now hold its end of the writer's socket
engine.snapshot(0)
engine.wait()
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_trainers_writer_exits_though_its_forked_workers_hold_the_socket(tmp_path):
    """Data loader workers forked from the trainer inherit its end of the writer's socket: the
    writer must not wait for them to notice the trainer's death (they are stopped here, so
    without the writer's own watch on the trainer it would wait for ever), and a restart must
    not wait for the writer."""
    trainer = subprocess.Popen([sys.executable, "-c", _FORKING_TRAINER, str(tmp_path / "ckpt")],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        children = psutil.Process(trainer.pid).children(recursive=True)
        writer = next(c for c in children if "async_ckpt.write.writer" in " ".join(c.cmdline()))
        workers = [c for c in children if c.pid != writer.pid]
        assert workers
        for worker in workers:
            worker.suspend()
        trainer.kill()
        writer.wait(timeout=60)  # a hang, not a timing: without the watch it never ends
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    with CheckpointEngine(tmp_path / "ckpt", {"m": torch.nn.Linear(4, 4)}, lock_timeout=0.5,
                          heartbeat_interval=None) as engine:
        assert engine.committed_steps() == [0]


def test_writer_killed_mid_write_leaves_previous_snapshot_restorable(tmp_path):
    directory = str(tmp_path / "ckpt")
    process = start_loop(directory)
    wait_for_a_commit(process)
    writer = psutil.Process(process.pid).children()[0]
    writer.kill()
    assert process.wait(timeout=60) != 0  # the trainer sees WriterDiedError instead of hanging
    process.stdout.close()
    steps = assert_every_committed_snapshot_exact(directory)
    assert steps

    state = state_at(0, MB)
    with CheckpointEngine(directory, state) as engine:
        restored = engine.restore()
        assert restored == steps[-1]
        assert_same(state_at(restored, MB)["weights"], state["weights"])
    leftovers = [d for d in os.listdir(directory) if d.startswith("step-")]
    assert len(leftovers) == len(steps)  # the half-written directory was cleaned up


@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount_point)],
                            capture_output=True)
    if result.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    yield str(mount_point)
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_disk_full_is_refused_up_front_and_committed_snapshots_survive(small_tmpfs):
    directory = os.path.join(small_tmpfs, "ckpt")
    state = {"w": torch.randn(1 << 20)}  # 4 MB: fits
    with CheckpointEngine(directory, state, keep_last=3) as engine:
        engine.snapshot(0)
        engine.wait()
        saved = state["w"].clone()
        state["w"] = torch.randn(4 << 20)  # 16 MB: cannot fit
        engine.snapshot(1)
        with pytest.raises(DiskFullError, match="not enough space"):
            engine.wait()
        assert engine.committed_steps() == [0]
    assert_same(saved, load(directory)[1]["w"])


def test_disk_full_mid_write_discards_the_snapshot_and_keeps_committed_ones(small_tmpfs):
    directory = os.path.join(small_tmpfs, "ckpt")
    # Zeros compress to almost nothing, so the space estimate for the next snapshot is tiny, and
    # once something else has taken part of the disk the writer really hits ENOSPC half-way
    # through the random data that follows.
    n = 10 << 18  # 10 MiB of int32 on a 12 MiB file system
    state = {"w": torch.zeros(n, dtype=torch.int32)}
    with CheckpointEngine(directory, state, compression="zstd") as engine:
        engine.snapshot(0)
        engine.wait()
        with open(os.path.join(small_tmpfs, "other-data"), "wb") as f:
            f.write(b"x" * (4 << 20))
        state["w"].copy_(torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32))
        engine.snapshot(1)
        with pytest.raises(DiskFullError, match="disk full"):
            engine.wait()
        assert engine.committed_steps() == [0]
        assert [d for d in os.listdir(directory) if d.startswith("step-")] == [read_manifest(LocalStorage(directory)).snapshots[0].dir]
        os.unlink(os.path.join(small_tmpfs, "other-data"))
        state["w"].zero_()
        engine.snapshot(2)  # space is back: the engine goes on
        engine.wait()
        assert engine.committed_steps() == [0, 2]
    assert torch.count_nonzero(load(directory)[1]["w"]) == 0


def test_write_failure_surfaces_as_typed_error(ckpt_dir):
    state = {"w": torch.randn(1 << 16)}
    with CheckpointEngine(ckpt_dir, state) as engine:
        engine.snapshot(0)
        engine.wait()
        # Writes past 2 MB now fail with EFBIG in the writer process.
        resource.prlimit(engine._writer.pid, resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        state["w"] = torch.randn(1 << 20)
        engine.snapshot(1)
        with pytest.raises(SnapshotWriteError, match="File too large") as info:
            engine.wait()
        assert not isinstance(info.value, DiskFullError)
        assert engine.committed_steps() == [0]
        state["w"] = torch.randn(1 << 16)
        engine.snapshot(2)  # small enough: the engine goes on
        engine.wait()
        assert engine.committed_steps() == [0, 2]
