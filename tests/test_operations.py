"""Operating a job: preemption signals, heartbeats, and the engine's health figures."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.errors import PREEMPTED_EXIT_CODE, Preempted
from async_ckpt.tools.supervisor import read_heartbeats
from async_ckpt.train.heartbeat import heartbeat_path
from async_ckpt.format.manifest import read_manifest
from conftest import FakeClock

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "preemptible.py")


def run_until(directory, mb, every, line_prefix, step_at_least, signum=signal.SIGTERM):
    """Start the program, send ``signum`` when it prints ``line_prefix N`` with N >= step_at_least,
    and return (exit code, the last step it announced)."""
    process = subprocess.Popen([sys.executable, PROGRAM, directory, str(mb), str(every)],
                               stdout=subprocess.PIPE, text=True)
    last_step = None
    signalled = False
    for line in process.stdout:
        kind, number = line.split()
        if kind == "step":
            last_step = int(number)
        if not signalled and kind == line_prefix and int(number) >= step_at_least:
            process.send_signal(signum)
            signalled = True
    return process.wait(timeout=120), last_step


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_commits_the_step_at_which_the_signal_was_handled(tmp_path, signum):
    directory = str(tmp_path / "ckpt")
    code, last_step = run_until(directory, 1, 5, "step", 7, signum)
    assert code == PREEMPTED_EXIT_CODE
    newest = read_manifest(LocalStorage(directory)).snapshots[-1].step
    assert newest == last_step and newest % 5 != 0 or newest == last_step
    step, state = load(directory)
    assert step == last_step and torch.all(state["t"] == last_step)


def test_preemption_during_a_snapshot_write_still_ends_committed(tmp_path):
    directory = str(tmp_path / "ckpt")
    # 64 MB per snapshot: the writer is still writing when "returned N" is printed.
    code, last_step = run_until(directory, 64, 1, "returned", 2)
    assert code == PREEMPTED_EXIT_CODE
    manifest = read_manifest(LocalStorage(directory))
    assert manifest.snapshots[-1].step == last_step
    assert torch.all(load(directory)[1]["t"] == last_step)


def test_preempted_is_a_catchable_system_exit_and_handlers_come_back(ckpt_dir):
    before = signal.getsignal(signal.SIGUSR1)
    t = torch.zeros(4)
    with CheckpointEngine(ckpt_dir, {"t": t}, every=100, preemption=[signal.SIGUSR1]) as engine:
        assert not engine.snapshot(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        t.fill_(2)
        with pytest.raises(Preempted) as info:
            engine.snapshot(2)  # not due by `every`, taken because of the signal
        assert isinstance(info.value, SystemExit) and info.value.code == PREEMPTED_EXIT_CODE
        assert info.value.step == 2 and info.value.signal == signal.SIGUSR1
        assert engine.committed_steps() == [2]
    assert signal.getsignal(signal.SIGUSR1) == before


def test_preemption_handlers_need_the_main_thread(ckpt_dir):
    errors = []

    def create():
        try:
            CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, preemption=True)
        except ValueError as e:
            errors.append(e)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0])


def test_heartbeat_is_written_from_snapshot_calls_and_rate_limited(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, every=10, heartbeat_interval=0.0) as engine:
        before = time.time()
        for step in range(3):
            engine.snapshot(step)
        after = time.time()
        with open(heartbeat_path(ckpt_dir, 0)) as f:
            beat = json.load(f)
        assert beat["step"] == 2 and beat["pid"] == os.getpid() and beat["rank"] == 0
        assert before <= beat["time"] <= after and beat["host"]  # Unix time, of the last call
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, every=10, heartbeat_interval=3600) as engine:
        for step in range(5, 8):
            engine.snapshot(step)
        assert [b.step for b in read_heartbeats(ckpt_dir)] == [5]  # one beat per interval
    closed, = read_heartbeats(ckpt_dir)  # and close() writes its last one at once
    assert closed.step == 7 and closed.closed is True


def test_heartbeat_can_be_turned_off(ckpt_dir):
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, heartbeat_interval=None) as engine:
        engine.snapshot(0)
    assert read_heartbeats(ckpt_dir) == []


def test_a_writer_falling_behind_is_counted(ckpt_dir, monkeypatch):
    """A snapshot that waits longer than slow_writer_s for a free slot is counted, one that finds
    a slot free is not; the wait is measured on a clock that moves only while the engine waits
    for the writer."""
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1 << 10)}, slots=1,
                          slow_writer_s=5) as engine:
        engine._clock = clock = FakeClock()
        engine.snapshot(0)
        engine.wait()
        writer, real_next_event = engine._writer.pid, engine._writer.next_event
        os.kill(writer, signal.SIGSTOP)  # snapshot 1 keeps the only slot until the writer runs

        def slow_writer(timeout):
            if timeout != 0:  # the engine blocks on the writer: it takes 10 s, then goes on
                clock.advance(10)
                os.kill(writer, signal.SIGCONT)
            return real_next_event(timeout)

        monkeypatch.setattr(engine._writer, "next_event", slow_writer)
        engine.snapshot(1)
        engine.snapshot(2)  # waits for the stopped writer to free the only slot
        engine.wait()
        monkeypatch.undo()
        engine.snapshot(3)  # the slot is free: no wait
        engine.wait()
        stats = engine.stats()
    assert stats["writer_behind"] == 1
    assert stats["disk_free_bytes"] > 0 and stats["consecutive_failures"] == 0


def test_heartbeats_go_on_while_the_engine_waits_for_a_slow_commit(ckpt_dir, monkeypatch):
    """A supervisor must not take a job whose final commit is slow for a hung one."""
    with CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, heartbeat_interval=3600) as engine:
        engine.snapshot(4)
        os.unlink(heartbeat_path(ckpt_dir, 0))
        real_next_event, quiet = engine._writer.next_event, iter(range(3))

        def slow_writer(timeout):
            if timeout is not None and next(quiet, None) is not None:
                engine._heartbeat._last = float("-inf")  # the interval has passed
                return None  # nothing from the writer within the interval
            return real_next_event(timeout)

        monkeypatch.setattr(engine._writer, "next_event", slow_writer)
        engine.wait()
        assert [b.step for b in read_heartbeats(ckpt_dir)] == [4]
