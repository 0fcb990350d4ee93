"""The memory tier (docs/memory_tier.md): a keeper process holds the newest memory snapshot and
outlives its trainer.

Real processes: a trainer SIGKILLed resumes from its memory snapshot, its losses bit for bit an
uninterrupted run's; with the keeper SIGKILLed too, from the disk, exactly, said with a warning;
no keeper is left once the job's launcher exits or ``close()`` has committed what it held; what
it holds is counted and verified.
The keeper's own rules (idle timeout, the launcher's exit, another session, hostile frames) are
driven in this process, with an injected clock."""

import copy
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from async_ckpt import CheckpointEngine
from async_ckpt.errors import InsufficientMemoryError, MemoryTierError, StateMismatchError
from async_ckpt.format.shard import CHUNK_BYTES, checksum
from async_ckpt.keeper.client import _mapped
from async_ckpt.keeper.keeper import Keeper
from async_ckpt.format.records import HeldStorage
from async_ckpt.keeper.protocol import (MAGIC, Gone, check_same_user, held_message,
                                        keeper_address, layout_message, parse_held, receive, send)
from conftest import assert_same, make_training_state, train_step

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "programs"))
from memory_loop import build, train_step as loop_step  # noqa: E402

# These states have no data position to restore (the loops' own tests check that warning).
pytestmark = pytest.mark.filterwarnings("ignore:restored step .* no data position")
LOOP = os.path.join(os.path.dirname(__file__), "programs", "memory_loop.py")
STEPS = 64
# Runs its arguments as a child and exits with it: a job's launcher (torchrun's agent, a
# supervisor), whose exit tells the keeper that the job is over.
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines(keepends=True)
                if line.endswith("\n")]


def wait_for(process, log, done, what):
    """Poll ``log`` until ``done(lines)``; fails if the process ends first."""
    deadline = time.monotonic() + 120
    while not done(read_log(log)):
        assert process.poll() is None, f"the run ended (code {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after 120 s"
        time.sleep(0.005)
    return read_log(log)


def steps_of(lines):
    return [line for line in lines if "step" in line]


@pytest.mark.slow
def test_a_killed_trainer_resumes_from_its_memory_snapshot_bit_for_bit(tmp_path, seeded_random):
    directory = str(tmp_path / "ckpt")
    logs = [str(tmp_path / f"run{n}.jsonl") for n in range(2)]
    try:
        _killed_and_resumed(directory, logs, seeded_random)
    finally:  # a failure midway leaves no keeper behind either
        for log in logs:
            for line in read_log(log)[:1]:
                if line["keeper"] is not None and psutil.pid_exists(line["keeper"]):
                    os.kill(line["keeper"], signal.SIGKILL)


def _killed_and_resumed(directory, logs, seeded_random):
    # 1. Killed between disk snapshots (only step 0 is on disk), with its writer: its own
    # process group, which its keeper has left.
    first = subprocess.Popen([sys.executable, LOOP, directory, logs[0], str(STEPS)],
                             start_new_session=True)
    kill_at = seeded_random.randint(5, 40)
    wait_for(first, logs[0], lambda lines: any(  # once it knows a step past 0 is sealed
        line.get("step", -1) >= kill_at and (line["memory_step"] or 0) >= 1 for line in lines),
        f"step {kill_at}")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed = steps_of(read_log(logs[0]))
    keeper = psutil.Process(read_log(logs[0])[0]["keeper"])

    # 2. Under a launcher: resumes from the memory snapshot, not from step 0; killed again.
    second = subprocess.Popen([sys.executable, "-c", LAUNCHER, sys.executable, LOOP, directory,
                               logs[1], str(STEPS)], start_new_session=True)
    lines = wait_for(second, logs[1], lambda lines: len(steps_of(lines)) >= 3, "3 more steps")
    os.kill(lines[0]["pid"], signal.SIGKILL)  # the trainer only: the launcher then exits
    assert second.wait(timeout=60) != 0
    keeper.wait(timeout=60)  # the job's last process is gone: so is its keeper

    start, resumed_run = read_log(logs[1])[0], steps_of(read_log(logs[1]))
    resumed = start["restored"]
    assert start["tier"] == "memory" and start["keeper"] == keeper.pid
    sealed = max(line["memory_step"] for line in killed if line["memory_step"] is not None)
    # the newest step the killed trainer knew sealed, at least (not step 0, the disk's), and no
    # step it had not taken
    assert 1 <= sealed <= resumed <= killed[-1]["step"] + 1, (sealed, resumed, killed[-1]["step"])
    assert [line["step"] for line in resumed_run] == list(range(resumed + 1,
                                                                resumed + 1 + len(resumed_run)))
    with torch.random.fork_rng():  # the uninterrupted run (a model too small for threads)
        model, optimizer = build()
        expected = [loop_step(model, optimizer) for _ in range(STEPS)]
    for line in killed + resumed_run:
        assert line["loss"] == expected[line["step"]], f"step {line['step']} differs"


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_restarts_both_ranks_from_their_memory_snapshots(tmp_path):
    """2 ranks, every=50 and memory_every=1: rank 1 dies (SIGKILL) while it would stage step 6,
    which rank 0 snapshots; torchrun restarts both, and both resume from step 5 in memory (the
    disk holds only step 0; rank 0's keeper still holds 5 beside 6), bit for bit; the keepers
    outlive the restart and exit with the job."""
    directory, log, kill_at, steps = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl"), 6, 12
    # Workers restarted by torchrun need gloo's lazy init (see tests/test_distributed.py).
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "--max-restarts=1", LOOP, directory, log,
                          str(steps), str(kill_at)],
                         env={**os.environ, "TORCH_GLOO_LAZY_INIT": "1"}, capture_output=True,
                         text=True, timeout=240)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    keepers = set()
    for rank in range(2):
        lines = read_log(f"{log}.rank{rank}")
        starts = [line for line in lines if "pid" in line]
        assert [s["restored"] for s in starts] == [None, kill_at - 1], starts
        assert starts[1]["tier"] == "memory" and starts[1]["keeper"] == starts[0]["keeper"]
        keepers.add(starts[0]["keeper"])
        first = kill_at + 1 if rank == 0 else kill_at  # rank 1 died before logging step 6
        taken = [line["step"] for line in steps_of(lines)]
        assert taken == list(range(first)) + list(range(kill_at, steps)), taken
        with torch.random.fork_rng():  # the uninterrupted run of this rank
            model, optimizer = build(seed=rank)
            expected = [loop_step(model, optimizer) for _ in range(steps)]
        for line in steps_of(lines):  # rank 0's step 6 twice: before the kill and redone
            assert line["loss"] == expected[line["step"]], (rank, line["step"])
    assert len(keepers) == 2  # one per rank
    for pid in keepers:  # close(final_step) committed what they held: they exit
        try:
            psutil.Process(pid).wait(timeout=60)
        except psutil.NoSuchProcess:
            pass


def _second_rank(steps=None, verified=None):
    """A stand-in for the ranks' gather: a second rank answers the memory tier's questions (the
    steps its keeper holds; then whether it verified its snapshot, or its error) with ``steps``
    and ``verified`` where given, and agrees with this rank on everything else."""
    def gather(mine):
        if isinstance(mine, list) and steps is not None:
            return [mine, steps]
        if mine is True and verified is not None:
            return [mine, verified]
        return [mine, mine]
    return gather


def _sealed(engine, step):
    """Wait until ``engine`` knows that its keeper sealed ``step`` (a real process answers)."""
    for _ in range(3000):
        if engine.stats()["memory_step"] == step:
            return
        time.sleep(0.01)
    raise AssertionError(f"the keeper never sealed step {step}")


def _state_dicts(state):
    return copy.deepcopy({k: v.state_dict() for k, v in state.items()})


def test_memory_snapshots_restore_verified_counted_and_fall_back_to_disk(tmp_path, monkeypatch):
    model, optimizer, scheduler = make_training_state()
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    engine = CheckpointEngine(tmp_path / "ckpt", state, every=50, memory_every=1, slots=3,
                              heartbeat_interval=None)
    try:
        with monkeypatch.context() as short:  # a host without the memory: a typed error
            short.setattr("async_ckpt.read.memory.usable_memory", lambda: 0)
            with pytest.raises(InsufficientMemoryError, match="memory tier"):
                engine.snapshot(0)
        engine.snapshot(0)
        engine.wait()
        _sealed(engine, 0)
        on_disk = _state_dicts(state)
        for step in (1, 2, 3):
            train_step(model, optimizer, scheduler)
            engine.snapshot(step)
            _sealed(engine, step)
        in_memory = _state_dicts(state)
        stats = engine.stats()
        held = next(s for s in engine._pool.slots if s.buffer_id == engine._memory.sealed[-1])
        assert stats["memory_bytes"] == held.nbytes > 0  # one slot: no memory of its own
        assert stats["memory_snapshots"] == 4 and stats["committed"] == 1
        keeper = psutil.Process(stats["keeper_pid"])
        assert keeper.status() != psutil.STATUS_ZOMBIE

        train_step(model, optimizer, scheduler)
        assert engine.restore() == 3
        assert_same(in_memory, _state_dicts(state))
        assert (engine.stats()["restored_from"], engine.stats()["restores"]) == ("memory",
                                                                                 {"memory": 1})
        assert engine.committed_steps() == [0], "a memory snapshot is never committed"

        # With several ranks each asks its keeper, and all learn what the others found (a
        # second rank stands in here): keepers that hold different steps send every rank to the
        # disk; a rank whose state does not fit its snapshot makes every rank raise.
        with monkeypatch.context() as ranks:
            ranks.setattr(engine._coordinator, "gather", _second_rank(steps=[2]))
            with pytest.warns(RuntimeWarning, match=r"hold no step in common newer than the "
                              r"disk's \(steps \[\[3\], \[2\]\], by rank\)"):
                assert engine.restore() == 0
            assert_same(on_disk, _state_dicts(state))
            ranks.setattr(engine._coordinator, "gather", _second_rank(
                verified=False))  # its snapshot of step 3 failed its checksums
            with pytest.warns(RuntimeWarning, match="another rank's memory snapshot of step 3 "
                              "is unusable: restoring from disk"):
                assert engine.restore() == 0
            ranks.setattr(engine._coordinator, "gather", _second_rank(
                verified=StateMismatchError("it has no entry 'model'")))
            with pytest.raises(StateMismatchError, match="rank 1 cannot restore its memory "
                               "snapshot: it has no entry 'model'"):
                engine.restore()
            assert_same(on_disk, _state_dicts(state))  # nothing loaded

        # The held memory changed after the keeper sealed it: caught, and the disk read instead.
        held.tensor[:64] ^= 0xFF
        with pytest.warns(RuntimeWarning, match="step 3 is unusable.*fails its checksum"):
            assert engine.restore() == 0
        assert_same(on_disk, _state_dicts(state))

        keeper.kill()
        keeper.wait(timeout=30)
        train_step(model, optimizer, scheduler)
        with pytest.warns(RuntimeWarning, match="keeper .* is gone"):
            engine.snapshot(4)
        stats = engine.stats()
        assert (stats["keeper_pid"], stats["memory_bytes"], stats["memory_step"]) == (None, 0, None)
        assert not any(s.held for s in engine._pool.slots)
        with pytest.warns(RuntimeWarning, match="keeper is gone"):
            assert engine.restore() == 0
        assert_same(on_disk, _state_dicts(state))
        assert engine.stats()["restores"] == {"memory": 1, "disk": 4}
    finally:
        engine.close()


def test_close_ends_the_keeper_once_what_it_holds_is_on_disk_and_a_lost_one_is_said(tmp_path):
    options = dict(every=50, memory_every=1, staging="lazy", heartbeat_interval=None)

    def engine(seed):
        model, optimizer, _ = make_training_state(seed=seed)
        state = {"model": model, "optimizer": optimizer}
        return state, CheckpointEngine(tmp_path, state, **options)

    state, first = engine(0)
    for step in (0, 1, 2):
        train_step(*state.values())
        first.snapshot(step)
        first.wait()  # slots=2: one written, one held would leave none for the next
        _sealed(first, step)
    keeper = psutil.Process(first.stats()["keeper_pid"])
    expected = _state_dicts(state)
    first.close()  # step 2 is only in memory: the keeper keeps it for a restart
    assert keeper.status() != psutil.STATUS_ZOMBIE

    state, second = engine(1)
    assert second.stats()["keeper_pid"] == keeper.pid
    assert second.restore() == 2
    assert_same(expected, _state_dicts(state))
    keeper.kill()
    keeper.wait(timeout=30)
    with pytest.warns(RuntimeWarning, match="keeper .* is gone"):
        second.close(final_step=2)
    assert second.committed_steps() == [0, 2]

    state, third = engine(2)  # the session file says a keeper held something: it is gone
    with pytest.warns(RuntimeWarning, match="keeper of the previous run is gone"):
        assert third.restore() == 2
    assert_same(expected, _state_dicts(state))
    keeper = psutil.Process(third.stats()["keeper_pid"])
    third.close(final_step=2)  # what it holds is committed: it has nothing a restart would want
    keeper.wait(timeout=30)


# --- the keeper itself, in this process ------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def keeper(request):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(keeper_address(os.getuid(), 0, id(request), 0))
    listener.listen(4)
    keeper = Keeper(listener, (0, id(request), 0), idle_timeout=10.0, clock=Clock())
    yield keeper
    keeper.close()


def attach(keeper, session="a" * 32, launcher=0, keep=1):
    ours, theirs = socket.socketpair()
    keeper.add(theirs)
    send(ours, {"type": "hello", "session": session, "dev": 0, "ino": keeper.identity[1],
                "rank": 0, "launcher": launcher, "idle_timeout": 10.0, "keep": keep})
    keeper.poll(0)
    welcome, _ = receive(ours)
    assert welcome["type"] == "welcome"
    return ours, welcome


def memory(data: bytes):
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def hold(sock, fd, step, buffer=0, storages=((0, 100),), checksums=None):
    send(sock, {"type": "hold", "buffer": buffer, "step": step, "tree": {"kind": "dict",
                                                                         "entries": {}},
                "layout": layout_message(list(storages), []), "xxh3": checksums}, fd)


def test_the_keeper_exits_after_its_idle_timeout_with_no_trainer(keeper):
    sock, _ = attach(keeper)
    keeper.clock.now += 1000
    keeper.poll(0)
    assert not keeper.finished, "a trainer is attached"
    sock.close()
    keeper.poll(0)
    keeper.clock.now += 9
    keeper.poll(0)
    assert not keeper.finished
    keeper.clock.now += 2
    keeper.poll(0)
    assert keeper.finished


def test_the_keeper_exits_once_the_launcher_is_gone_and_no_trainer_is_attached(keeper):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sock, _ = attach(keeper, launcher=launcher.pid)
        sock.close()
        keeper.poll(0)
        assert not keeper.finished, "the launcher may start the next trainer"
    finally:
        launcher.kill()
        launcher.wait()
    keeper.poll(30)  # the launcher's pidfd wakes it
    assert keeper.finished


def test_the_keeper_seals_the_newest_hold_and_serves_only_its_session(keeper):
    sock, welcome = attach(keeper)
    assert (welcome["step"], welcome["bytes"]) == (None, 0)
    data = os.urandom(3 * CHUNK_BYTES // 2)
    fds = [memory(data), memory(data)]
    hold(sock, fds[0], step=7, buffer=1)
    hold(sock, fds[1], step=8, buffer=2, storages=((0, len(data)), (64, 10)))
    keeper.poll(0)
    assert receive(sock)[0] == {"type": "superseded", "buffer": 1}
    assert receive(sock)[0] == {"type": "sealed", "buffer": 2, "step": 8, "bytes": len(data)}
    send(sock, {"type": "query"})
    keeper.poll(0)
    answer, fd = receive(sock)
    assert answer["step"] == 8 and fd is not None
    assert answer["storages"][0]["xxh3"] == [checksum(data[:CHUNK_BYTES]),
                                             checksum(data[CHUNK_BYTES:])]
    received = _mapped(answer, fd)
    assert bytes(received.memory[:len(data)]) == data

    other, welcome = attach(keeper, session="b" * 32)  # the directory started a new session
    assert welcome["step"] is None
    assert _dropped(sock), "a trainer of the old session is not served any more"
    send(other, {"type": "query"})
    keeper.poll(0)
    assert receive(other) == ({"type": "held", "step": None}, None)
    for fd in fds:
        os.close(fd)


def test_a_keeper_told_to_keep_two_holds_the_two_newest_and_serves_either(keeper):
    sock, _ = attach(keeper, keep=2)
    data = os.urandom(100)
    fds = [memory(data) for _ in range(3)]
    for buffer, (fd, step) in enumerate(zip(fds, (4, 5, 6))):
        hold(sock, fd, step=step, buffer=buffer)
        keeper.poll(0)
        assert receive(sock)[0]["type"] == "sealed"
    assert keeper.held_bytes() == 2 * len(data)  # step 4's memory let go
    for asked, held in ((None, 6), (5, 5), (4, None)):
        send(sock, {"type": "query", "step": asked})
        keeper.poll(0)
        answer, fd = receive(sock)
        assert answer["step"] == held, asked
        if held is not None:
            assert answer["steps"] == [5, 6]
            os.close(fd)
    attach(keeper, keep=1)  # a trainer of one rank: the older one goes
    assert keeper.held_bytes() == len(data)
    with pytest.raises(Gone):
        attach(keeper, keep=3)  # more than KEEP_MAX: a malformed hello, dropped
    for fd in fds:
        os.close(fd)


def test_a_slot_handed_over_again_is_sealed_from_what_it_holds_now(keeper):
    """The keeper keeps a slot's mapping between seals while its trainer is attached: a slot
    rewritten in place, or another memory under the same buffer number, is checksummed as it
    is now, and the mappings go with the trainer."""
    sock, _ = attach(keeper, keep=1)
    first, second = os.urandom(100), os.urandom(100)
    slot, other = memory(first), memory(second)

    def sealed_checksum(fd, step):
        hold(sock, fd, step=step, buffer=0)
        keeper.poll(0)
        assert receive(sock)[0]["type"] == "sealed"
        send(sock, {"type": "query"})
        keeper.poll(0)
        answer, held = receive(sock)
        os.close(held)
        return answer["storages"][0]["xxh3"]

    assert sealed_checksum(slot, 1) == [checksum(first)]
    (trainer,) = keeper.trainers.values()
    mapping = trainer.mapped[0][1]
    os.pwrite(slot, second, 0)  # the trainer stages the next step into the same slot
    assert sealed_checksum(slot, 2) == [checksum(second)]
    assert trainer.mapped[0][1] is mapping, "the slot was mapped again"
    os.pwrite(other, first, 0)
    assert sealed_checksum(other, 3) == [checksum(first)], "another memory, the same buffer"
    assert mapping.closed and not trainer.mapped[0][1].closed
    sock.close()
    keeper.poll(0)
    assert not trainer.mapped and keeper.held_bytes() == 100  # the sealed one is still held
    for fd in (slot, other):
        os.close(fd)


@pytest.mark.parametrize("how", ["made by the copy", "one too few", "not a checksum"])
def test_a_hold_with_its_checksums_is_sealed_without_reading_it(keeper, monkeypatch, how):
    """The trainer's copy checksums what it copies (``StagingPool.start(checksums=True)``): the
    keeper takes those (the seal then reads nothing of the slot, which cost a memory snapshot
    most of its CPU), and makes its own where a hold's are not one per chunk."""
    sock, _ = attach(keeper)
    data = os.urandom(CHUNK_BYTES + 100)
    expected = [checksum(data[:CHUNK_BYTES]), checksum(data[CHUNK_BYTES:])]
    given = {"made by the copy": expected, "one too few": expected[:1],
             "not a checksum": [expected[0], "X" * 16]}[how]
    mapped = []
    real = type(keeper).mapping
    monkeypatch.setattr(type(keeper), "mapping",
                        lambda self, s: (mapped.append(s.step), real(self, s))[1])
    fd = memory(data)
    hold(sock, fd, step=3, storages=((0, len(data)),), checksums=[given])
    keeper.poll(0)
    assert receive(sock)[0]["type"] == "sealed"
    assert mapped == ([] if how == "made by the copy" else [3])
    send(sock, {"type": "query"})
    keeper.poll(0)
    answer, held = receive(sock)
    assert answer["storages"][0]["xxh3"] == expected
    os.close(held)
    os.close(fd)


def test_hostile_frames_drop_their_connection_and_nothing_else(keeper):
    good, _ = attach(keeper)
    for frame, fd in [(b"XXXX" + (8).to_bytes(4, "little") + b"{}      ", None),  # bad magic
                      (MAGIC + (1 << 30).to_bytes(4, "little"), None),  # too large to read
                      (None, _pipe()),  # a hold whose memory is a pipe
                      (None, _unsealed(100))]:  # or memory its sender could cut short
        bad, theirs = socket.socketpair()
        keeper.add(theirs)
        if frame is not None:
            bad.sendall(frame)
        else:
            send(bad, {"type": "hello", "session": "a" * 32, "dev": 0,
                       "ino": keeper.identity[1], "rank": 0, "launcher": 0,
                       "idle_timeout": 1.0})
            keeper.poll(0)
            receive(bad)
            hold(bad, fd, step=1)
            os.close(fd)
        keeper.poll(0)
        assert _dropped(bad)
    send(good, {"type": "query"})
    keeper.poll(0)
    assert receive(good)[0]["type"] == "held"


def _dropped(sock) -> bool:
    """Whether the keeper closed its end (unread bytes on it make that a reset)."""
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _pipe():
    read, write = os.pipe()
    os.close(write)
    return read


def _unsealed(size):
    fd = os.memfd_create("test")
    os.ftruncate(fd, size)
    return fd


def test_a_held_answer_is_untrusted(monkeypatch):
    message = held_message(3, {"kind": "dict", "entries": {}}, [],
                           [HeldStorage(0, 100, ("0" * 16,))], [2, 3])
    assert parse_held(message, 100, 64).steps == (2, 3)
    for steps in ([2], [1, 2, 3], [3, -1], "3"):  # without the step, past KEEP_MAX, not steps
        with pytest.raises(MemoryTierError, match="malformed"):
            parse_held({**message, "steps": steps}, 100, 64)
    with pytest.raises(MemoryTierError, match="outside"):
        parse_held(message, 99, 64)  # a storage past the memory's end
    with pytest.raises(MemoryTierError, match="outside"):
        parse_held({**message, "storages": [{"offset": 0, "nbytes": 100, "xxh3": []}]}, 100, 64)
    a, b = socket.socketpair()
    unsealed = _unsealed(100)
    send(a, message, unsealed)  # memory that could be cut short under the mapping: SIGBUS
    os.close(unsealed)
    with pytest.raises(MemoryTierError, match="sealed"):
        receive(b)
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)
    with pytest.raises(MemoryTierError, match="belongs to user"):
        check_same_user(a, "the keeper")
