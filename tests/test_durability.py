"""Durability order checked on real system calls, and the writer's exit when the trainer dies.

The order test runs a real engine under ``strace -f`` (the writer is a child process) and reads the
trace: a snapshot directory's entry must be durable (its parent fsynced) before any shard in it gets
its final name, and so before the manifest names it; a checkpoint root the engine creates must be
durable the same way.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.reduction import send_handle
from typing import Optional

import pytest

from async_ckpt.storage import local as fsutil
from async_ckpt.errors import (CheckpointDirError, CorruptSnapshotError, DiskFullError,
                               InternalError, SnapshotWriteError)
from async_ckpt.format.layout import Plan
from async_ckpt.format.manifest import ShardRecord
from async_ckpt.storage.names import shard_file_name, snapshot_dir_name
from async_ckpt.write import commit
from async_ckpt.write.commit import Attempt
from async_ckpt.write.protocol import (Attach, Drop, Dropped, Failed, Released, ShardFigures,
                                       SnapshotJob)
from async_ckpt.write.writer import GONE
from conftest import connected_writer

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs",
                       "durable_snapshot.py")
TRACED = "mkdir,mkdirat,fsync,rename,renameat,renameat2"

# strace -f -y lines: `PID name(args) = result`, or when two traced calls overlap
# `PID name(args <unfinished ...>` ... `PID <... name resumed>args) = result`.
_CALL = re.compile(r"^(\d+)\s+(\w+)\((.*)$")
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. (\w+) resumed>(.*)$")
_RESULT = re.compile(r"^(.*)\)\s+=\s+(-?\d+|\?)(.*)$")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"^\d+<(.*)>")
_MANIFEST_TMP = re.compile(r"manifest\.json\.tmp-\d+")


@dataclass
class Call:
    pid: int
    name: str
    args: str
    ok: bool
    start: int  # index of the line where the call began
    end: int  # index of the line where it returned
    line: str

    @property
    def paths(self) -> list:
        """The path arguments (mkdir*, rename*), or the fd's path for fsync (from -y)."""
        if self.name == "fsync":
            m = _FD_PATH.match(self.args)
            return [m.group(1)] if m else []
        return _STRING.findall(self.args)


def parse_trace(text: str) -> list:
    calls, unfinished = [], {}
    for i, line in enumerate(text.splitlines()):
        resumed = _RESUMED.match(line)
        if resumed:
            pid, name, rest = int(resumed.group(1)), resumed.group(2), resumed.group(3)
            begun_name, begun_args, start = unfinished.pop(pid)
            assert begun_name == name, line
            args = begun_args + rest
        else:
            call = _CALL.match(line)
            if not call:
                continue  # signals, exits
            pid, name, args, start = int(call.group(1)), call.group(2), call.group(3), i
            if args.endswith("<unfinished ...>"):
                unfinished[pid] = (name, args[:-len("<unfinished ...>")].rstrip(), i)
                continue
        result = _RESULT.match(args)
        assert result, f"cannot parse strace line {line!r}"
        calls.append(Call(pid, name, result.group(1), result.group(2) == "0", start, i, line))
    return calls


def run_traced(tmp_path, root) -> list:
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("strace is not installed, and this test needs it to check the order of mkdir, "
                    "fsync and rename: install it (apt-get install -y strace; .ci/run does)")
    trace = tmp_path / "trace.txt"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # no __pycache__ mkdirs in the trace
    # -f: the writer is a child process; -y: fds print with their paths; --seccomp-bpf: only the
    # traced calls stop the process (the run takes about as long as without strace).
    done = subprocess.run(
        [strace, "-f", "--seccomp-bpf", "-y", "-e", f"trace={TRACED}", "-o", str(trace),
         sys.executable, PROGRAM, str(root)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, f"the traced snapshot failed:\n{done.stdout}\n{done.stderr}"
    assert "committed [1]" in done.stdout, done.stdout
    return parse_trace(trace.read_text())


def only(calls: list, what: str, predicate) -> Call:
    found = [c for c in calls if c.ok and predicate(c)]
    assert len(found) == 1, f"expected one {what} in the trace, found {[c.line for c in found]}"
    return found[0]


def first_fsync_of(calls: list, directory: str, after: Call) -> Optional[Call]:
    """The first successful fsync of ``directory`` that began after ``after`` returned."""
    return next((c for c in calls if c.name == "fsync" and c.ok and c.paths == [directory]
                 and c.start > after.end), None)


def show(calls: list) -> str:
    return "\n".join(c.line for c in calls)


def test_snapshot_directory_and_new_root_are_durable_before_use(tmp_path):
    base = str(tmp_path.resolve())  # strace -y prints resolved paths
    root = os.path.join(base, "new", "nested", "ckpt")
    calls = run_traced(tmp_path, root)
    mine = [c for c in calls if any(p == base or p.startswith(base + os.sep) for p in c.paths)]
    mkdirs = [c for c in mine if c.name in ("mkdir", "mkdirat")]

    # The root and its missing parents: each creation is followed by an fsync of the parent, before
    # anything else happens inside the new directory.
    for directory in (os.path.join(base, "new"), os.path.dirname(root), root):
        made = only(mkdirs, f"mkdir of {directory}", lambda c: c.paths[0] == directory)
        synced = first_fsync_of(mine, os.path.dirname(directory), made)
        assert synced is not None, (f"{directory} was created but its parent was never fsynced "
                                    f"afterwards:\n{show(mine)}")
        inside = [c for c in mine if c.start > made.end
                  and any(p.startswith(directory + os.sep) for p in c.paths)]
        assert inside and synced.end < inside[0].start, (
            f"the parent of {directory} was not fsynced before the first use of it:\n{show(mine)}")

    # The snapshot directory: mkdir, then fsync of the root, then the renames (shard, manifest).
    step_mkdir = only(mkdirs, "mkdir of a snapshot directory",
                      lambda c: os.path.dirname(c.paths[0]) == root
                      and os.path.basename(c.paths[0]).startswith("step-"))
    step_dir = step_mkdir.paths[0]
    renames = [c for c in mine if c.name.startswith("rename")]
    shard = only(renames, "rename of the shard to its final name",
                 lambda c: c.paths == [os.path.join(step_dir, "rank-00000.ackpt.partial"),
                                       os.path.join(step_dir, "rank-00000.ackpt")])
    manifest = only(renames, "rename of the manifest",
                    lambda c: len(c.paths) == 2 and os.path.dirname(c.paths[0]) == root
                    and _MANIFEST_TMP.fullmatch(os.path.basename(c.paths[0]))
                    and c.paths[1] == os.path.join(root, "manifest.json"))
    assert step_mkdir.pid != next(c for c in mkdirs if c.paths[0] == root).pid, \
        "the snapshot directory should be made by the writer process (strace -f follows it)"
    synced = first_fsync_of(mine, root, step_mkdir)
    assert synced is not None and synced.end < shard.start, (
        f"the root was not fsynced between the mkdir of {step_dir} and the rename of its shard to "
        f"the final name:\n{show(mine)}")
    assert synced.end < manifest.start, show(mine)


def test_make_dirs_fsyncs_the_parent_of_each_directory_it_creates(tmp_path, fsynced):
    base = str(tmp_path)
    target = os.path.join(base, "a", "b", "c")
    assert fsutil.make_dirs(target) is True
    assert os.path.isdir(target)
    assert fsynced == [base, os.path.join(base, "a"), os.path.join(base, "a", "b")]
    fsynced.clear()
    assert fsutil.make_dirs(target) is False  # already there: nothing to make durable
    assert fsynced == []


def test_make_dirs_fsyncs_the_parent_when_another_process_wins_the_race(tmp_path, fsynced,
                                                                        monkeypatch):
    target = os.path.join(str(tmp_path), "step-x")
    real_mkdir = os.mkdir

    def another_rank_first(path, *args, **kwargs):
        real_mkdir(path)  # another rank's writer creates it between our check and our mkdir
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", another_rank_first)
    assert fsutil.make_dirs(target) is True
    assert fsynced == [str(tmp_path)]


def test_make_dirs_refuses_a_file_in_the_way(tmp_path, fsynced):
    (tmp_path / "f").write_text("")
    with pytest.raises(FileExistsError):
        fsutil.make_dirs(str(tmp_path / "f"))
    with pytest.raises(FileExistsError):
        fsutil.make_dirs(str(tmp_path / "f" / "sub"))
    with pytest.raises(CheckpointDirError):
        fsutil.ensure_writable_dir(str(tmp_path / "f"))
    assert fsynced == []


def test_writer_attaches_a_buffer_sent_with_its_fd(tmp_path):
    trainer, writer = connected_writer(tmp_path)
    fd = os.memfd_create("staging")
    try:
        os.write(fd, b"staged bytes".ljust(4096, b"\0"))
        trainer.send(Attach(7, 4096))
        send_handle(trainer, fd, os.getpid())
        assert writer.receive() is None
        assert writer.buffers[7][:12] == b"staged bytes"
        trainer.close()
        assert writer.receive() == GONE  # the writer finishes and exits
    finally:
        os.close(fd)
        for buf in writer.buffers.values():
            buf.close()
        writer.conn.close()


@pytest.mark.parametrize("drive", ["receive", "serve"])
def test_writer_treats_trainer_dying_before_the_fd_as_closed(tmp_path, drive):
    trainer, writer = connected_writer(tmp_path)
    trainer.send(Attach(7, 4096))
    trainer.close()  # the training process died between the message and its fd
    try:
        if drive == "receive":
            assert writer.receive() == GONE
        else:
            writer.serve()  # returns (nothing was staged) instead of dying with a traceback
        assert writer.buffers == {}
    finally:
        writer.conn.close()



def pending_attempt(tmp_path, rank):
    name = snapshot_dir_name(1, "session", 0)
    os.makedirs(tmp_path / name, exist_ok=True)
    return Attempt(job=0, step=1, dir=name, shard=ShardRecord(rank, shard_file_name(rank), 0, ""),
                   replicas=[], raw_bytes=0, figures=ShardFigures())


def test_once_the_trainer_is_gone_rank_0_s_writer_settles_what_is_pending(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "ORPHAN_QUIET_S", 0.05)
    trainer, writer = connected_writer(tmp_path, rank=0, world_size=2)
    writer.commit.pending.append(pending_attempt(tmp_path, 0))  # rank 1 never writes its shard
    trainer.close()
    try:
        writer.serve()  # gives the step up after the short quiet instead of commit_timeout
        assert writer.commit.pending == [] and os.listdir(tmp_path) == []
    finally:
        writer.conn.close()


def test_once_the_trainer_is_gone_another_rank_s_writer_returns_at_once(tmp_path):
    trainer, writer = connected_writer(tmp_path, rank=1, world_size=2)
    writer.commit.pending.append(pending_attempt(tmp_path, 1))  # durable, not yet committed
    trainer.close()
    try:
        writer.serve()  # nobody is left to tell; rank 0 commits the shard without this writer
        assert writer.commit.pending == []
    finally:
        writer.conn.close()


def test_rank_0_s_writer_drops_only_once_the_snapshots_sent_before_are_settled(tmp_path):
    """A drop queued right after a save (drop(wait=False): the snapshot a framework's file named
    before the save replaced it) waits while that save waits for the other ranks' shards; then
    the framework's directory goes, with what it holds, and the answer comes."""
    trainer, writer = connected_writer(tmp_path / "ckpt", rank=0, world_size=2)
    marker = tmp_path / "last.ckpt"
    marker.mkdir()
    (marker / "meta.pt").write_bytes(b"meta")
    writer.commit.pending.append(pending_attempt(tmp_path / "ckpt", 0))  # rank 1's shard missing
    try:
        trainer.send(Drop((5,), (str(marker),)))
        assert writer.receive() is None
        assert marker.exists() and not trainer.poll(0.1)  # deferred: nothing done, no answer
        writer.commit.pending.clear()  # settled (committed or given up)
        writer.apply_drops()
        assert trainer.recv() == Dropped(())  # step 5 was not in the manifest: nothing to drop
        assert not marker.exists()
    finally:
        writer.conn.close()


def job_of(buffer_id):
    return SnapshotJob(job=3, step=1, buffer_id=buffer_id, dir=snapshot_dir_name(1, "session", 0),
                       tree={"kind": "dict", "entries": {}}, plan=Plan((), (), 0), submitted=0.0)


def test_a_bug_in_the_writer_reaches_the_trainer_as_an_internal_error(tmp_path, caplog):
    """A job naming a buffer that was never attached: a KeyError in the writer, which is a bug,
    not an I/O error; the writer logs its traceback and goes on serving."""
    trainer, writer = connected_writer(tmp_path)
    try:
        writer.handle(job_of(buffer_id=9))
        assert trainer.recv() == Released(9, 1)
        failed = trainer.recv()
        assert isinstance(failed, Failed) and failed.job == 3
        assert type(failed.error) is InternalError and "KeyError" in str(failed.error)
        (record,) = [r for r in caplog.records if r.exc_info]
        assert record.exc_info[0] is KeyError  # the traceback is in the writer's log
        assert os.listdir(tmp_path) == []
    finally:
        trainer.close()
        writer.conn.close()


@pytest.mark.parametrize("raised, expected", [
    (OSError(5, "Input/output error"), SnapshotWriteError),
    (OSError(28, "No space left on device"), DiskFullError),
    (CorruptSnapshotError("a referred shard is damaged"), CorruptSnapshotError),
    (TypeError("unsupported operand"), InternalError),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__)
def test_only_i_o_errors_become_write_errors(tmp_path, monkeypatch, raised, expected):
    trainer, writer = connected_writer(tmp_path)

    def write(job, buf, release):
        raise raised

    monkeypatch.setattr(writer, "write", write)
    writer.buffers[0] = b""
    try:
        writer.handle(job_of(buffer_id=0))
        assert isinstance(trainer.recv(), Released)
        assert type(trainer.recv().error) is expected
    finally:
        trainer.close()
        writer.conn.close()
