"""`async-ckpt supervise` on real processes: a job that hangs (plain Python and under torchrun) is
killed, restarted and resumes from the newest snapshot with the losses of an uninterrupted run; a
job that crashes once is restarted; one that always crashes is given up on; preemption codes and
signals stop the supervisor without a restart and leave no process of the job behind.

The jobs are tests/programs/flaky_job.py (torch, CheckpointEngine) and signal_job.py (no torch).
The supervisor runs as ``python -m async_ckpt.tools.supervisor`` where signals or whole training runs are
involved, in-process (``supervise()``, ``main()``) for the quick cases.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import psutil
import pytest
import torch

from async_ckpt.storage.local import LocalStorage
from async_ckpt import CheckpointEngine, load
from async_ckpt.format.manifest import read_manifest
from async_ckpt.errors import PREEMPTED_EXIT_CODE
from async_ckpt.train.heartbeat import heartbeat_path
from async_ckpt.tools.supervisor import _Supervisor, main, supervise
from conftest import assert_same

pytestmark = pytest.mark.slow
PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
FLAKY = os.path.join(PROGRAMS, "flaky_job.py")
SIGNAL_JOB = os.path.join(PROGRAMS, "signal_job.py")
STEPS = 12


def flaky(tmp_path, *options):
    return [FLAKY, "--ckpt-dir", str(tmp_path / "ckpt"), "--loss-log", str(tmp_path / "loss.jsonl"),
            "--steps", str(STEPS), *options]


def run_supervisor(options, cmd, timeout=120):
    return subprocess.run([sys.executable, "-m", "async_ckpt.tools.supervisor", *options, "--", *cmd],
                          capture_output=True, text=True, timeout=timeout)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def group_members(pgid):
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return members


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its loss per step and its final snapshot."""
    root = tmp_path_factory.mktemp("reference")
    subprocess.run([sys.executable, *flaky(root)], check=True, timeout=120)
    records = read_log(root / "loss.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    return {r["step"]: r for r in records}, load(str(root / "ckpt"))


def assert_resumed_exactly(tmp_path, reference):
    losses, (ref_step, ref_state) = reference
    records = read_log(tmp_path / "loss.jsonl")
    last = {r["step"]: r for r in records}
    assert last == losses  # the last occurrence of every step, as compare-loss reads it
    for r in records:  # replayed steps included
        assert r == losses[r["step"]]
    step, state = load(str(tmp_path / "ckpt"))
    assert step == ref_step == STEPS - 1
    assert_same(state, ref_state)


def resumed_at(stderr):
    """The step logged as the resume point of the first restart, and the step the job restarted at."""
    logged = int(re.search(r"restart 1 of \d+ .*resuming from step (\d+)", stderr).group(1))
    starts = [int(s) for s in re.findall(r"flaky_job: pid \d+ starting at step (\d+)", stderr)]
    assert starts[0] == 0 and len(starts) == 2, stderr
    return logged, starts[1]


# --- hangs ---------------------------------------------------------------------------------------


def test_hung_job_is_killed_restarted_and_resumes_with_identical_losses(tmp_path, reference):
    result = run_supervisor(
        ["--ckpt-dir", str(tmp_path / "ckpt"), "--heartbeat-timeout", "3", "--grace", "2",
         "--backoff", "0.1", "--max-restarts", "2"],
        [sys.executable, *flaky(tmp_path, "--hang-at", "5")])
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert "flaky_job: hanging at step 5" in err
    assert re.search(r"restart 1 of 2 \(attempt 2\): heartbeat stale for \d+\.\d s .*; restarting in "
                     r"0\.1 s, resuming from step 4", err), err
    assert "restart 2 of" not in err
    logged, restarted_at = resumed_at(err)
    assert restarted_at == logged + 1  # the logged step is the snapshot the job restored
    assert "the job finished (exit code 0) (step 11 committed)" in err
    assert_resumed_exactly(tmp_path, reference)


def test_hung_torchrun_worker_is_killed_with_its_agent(tmp_path, reference):
    """torchrun starts its worker in a session of its own; the hung worker survives SIGTERM (its
    engine's preemption handler sets a flag the hung loop never reads, as in a job stuck in a
    collective), so the agent cannot stop it in the grace period and the supervisor must SIGKILL
    the agent and the orphaned worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           *flaky(tmp_path, "--hang-at", "5", "--preemption")]
    result = run_supervisor(["--ckpt-dir", str(tmp_path / "ckpt"), "--heartbeat-timeout", "3",
                             "--grace", "2", "--backoff", "0.1"], cmd)
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert re.search(r"restart 1 of 3 \(attempt 2\): heartbeat stale .*resuming from step 4", err), err
    assert "sending SIGKILL" in err
    hung_worker = int((tmp_path / "hang-at-5").read_text())
    assert gone(hung_worker)
    logged, restarted_at = resumed_at(err)
    assert restarted_at == logged + 1
    assert_resumed_exactly(tmp_path, reference)


def test_no_first_heartbeat_within_startup_timeout_counts_as_hung(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stale = {"rank": 0, "step": 3, "time": time.time() - 100, "pid": 1, "host": "h", "interval": 1.0}
    with open(heartbeat_path(str(ckpt), 0), "w") as f:  # left by an earlier run: must not count
        json.dump(stale, f)
    (ckpt / "heartbeat.rank00001.json").write_text("{not json")  # nor must what is no heartbeat
    (ckpt / "heartbeat.rank00002.json").write_text(json.dumps({**stale, "time": "now"}))
    (ckpt / "heartbeat.rank00003.json").write_text(json.dumps({**stale, "step": True}))
    code = supervise(["sleep", "30"], max_restarts=0, heartbeat_timeout=5, grace=1,
                     ckpt_dir=str(ckpt), startup_timeout=0.5, poll_interval=0.05)
    assert code == 1  # stopped as hung, not waited for: `sleep 30` would have exited 0
    err = capsys.readouterr().err
    assert ("giving up after 0 restarts; last failure: no heartbeat within 0.5 s of the start "
            "(--startup-timeout) (no step committed)") in err


def test_a_rank_whose_engine_closed_is_not_timed_any_more(tmp_path):
    """A job whose engine has closed (its writer stopping, its interpreter exiting: seconds on a
    loaded machine) was killed as hung once that outlasted --heartbeat-timeout, and restarted to
    redo nothing. The engine's last beat says it closed; only the ranks still open are timed."""
    watcher = _Supervisor(["true"], max_restarts=0, heartbeat_timeout=1, grace=1,
                          ckpt_dir=str(tmp_path), startup_timeout=1, backoff=0,
                          preemption_exit_code=75, poll_interval=0.05)
    job = types.SimpleNamespace(started_wall=time.time() - 60, started=time.monotonic() - 60)
    old = {"step": 11, "time": time.time() - 30, "pid": 1, "host": "h", "interval": 0.5}
    with CheckpointEngine(tmp_path, {"w": torch.zeros(2)}, heartbeat_interval=0.5) as engine:
        engine.snapshot(11)
    closed = json.loads(open(heartbeat_path(str(tmp_path), 0)).read())
    assert closed["closed"] is True and closed["step"] == 11
    (tmp_path / "heartbeat.rank00000.json").write_text(json.dumps({**closed, **old}))
    assert watcher._hang(job) is None  # rank 0 closed 30 s ago: not hung
    (tmp_path / "heartbeat.rank00001.json").write_text(json.dumps({**old, "rank": 1}))
    assert re.match(r"heartbeat stale for \d+\.\d s \(rank 1, ", watcher._hang(job))  # still open
    (tmp_path / "heartbeat.rank00001.json").write_text(json.dumps({**old, "rank": 1,
                                                                   "closed": True}))
    assert watcher._hang(job) is None


# --- crashes -------------------------------------------------------------------------------------


def test_job_that_crashes_once_is_restarted_and_finishes(tmp_path, reference):
    result = run_supervisor(["--ckpt-dir", str(tmp_path / "ckpt"), "--backoff", "0.1"],
                            [sys.executable, *flaky(tmp_path, "--crash-at", "4")])
    assert result.returncode == 0, result.stderr
    err = result.stderr
    # the trainer died with step 3 in flight: its writer finished the commit before the restart
    assert re.search(r"restart 1 of 3 \(attempt 2\): exit code 1; restarting in 0\.1 s, "
                     r"resuming from step 3\n", err), err
    logged, restarted_at = resumed_at(err)
    assert restarted_at == logged + 1
    assert_resumed_exactly(tmp_path, reference)


def test_job_that_always_crashes_is_given_up_after_n_restarts(tmp_path):
    result = run_supervisor(["--ckpt-dir", str(tmp_path / "ckpt"), "--max-restarts", "2",
                             "--backoff", "0.1"],
                            [sys.executable, *flaky(tmp_path, "--always-crash")])
    assert result.returncode == 3
    err = result.stderr
    assert err.count("flaky_job: crashing at start") == 3
    assert re.findall(r"restart \d of 2 \(attempt \d\): exit code 3; restarting in ([\d.]+) s, "
                      r"starting from scratch", err) == ["0.1", "0.2"]  # doubled: no progress
    assert err.rstrip().endswith("async-ckpt supervise: giving up after 2 restarts; last failure: "
                                 "exit code 3 (no step committed)")


COMMIT_AND_CRASH = """
import sys
from async_ckpt.format.manifest import Manifest, ShardRecord, SnapshotRecord, read_manifest, write_manifest
from async_ckpt.storage.local import LocalStorage
root = LocalStorage(sys.argv[1])
m = read_manifest(root)
step = len(m.snapshots)
shard = ShardRecord(0, "rank-00000.ackpt", 0, "0" * 16)
m, _ = m.commit(SnapshotRecord(step, 0, f"step-{step:020d}.00000000", 0.0, 1, (shard,), 0, 0),
                keep_last=9)
write_manifest(root, m)
sys.exit(5)
"""


def test_backoff_is_reset_by_progress_and_giving_up_names_the_committed_step(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    code = supervise([sys.executable, "-c", COMMIT_AND_CRASH, str(ckpt)], max_restarts=2,
                     ckpt_dir=str(ckpt), backoff=0.1, poll_interval=0.05)
    assert code == 5
    err = capsys.readouterr().err
    assert "running " in err and "; starting from scratch" in err
    assert re.findall(r"exit code 5; restarting in ([\d.]+) s, resuming from step (\d+)", err) == [
        ("0.1", "0"), ("0.1", "1")]  # every run committed a newer step: no doubling
    assert "giving up after 2 restarts; last failure: exit code 5 (step 2 committed)" in err
    assert read_manifest(LocalStorage(str(ckpt))).steps() == [0, 1, 2]


# --- stopping without a restart ------------------------------------------------------------------


@pytest.mark.parametrize("option, code", [([], PREEMPTED_EXIT_CODE),
                                          (["--preemption-exit-code", "42"], 42)])
def test_preemption_exit_code_stops_without_restart(option, code):
    result = run_supervisor(option, ["sh", "-c", f"exit {code}"], timeout=30)
    assert result.returncode == code
    assert f"the job was preempted (exit code {code}); not restarting" in result.stderr
    assert result.stderr.count("started: pid") == 1
    assert "restart" not in result.stderr.replace("not restarting", "")


def test_sigterm_preempts_a_real_job_which_commits_and_exits_75(tmp_path):
    """The scheduler's SIGTERM reaches the supervisor, which forwards it; the engine's preemption
    handler commits a snapshot at the next step and exits 75; the supervisor exits 75."""
    log = tmp_path / "loss.jsonl"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "async_ckpt.tools.supervisor", "--ckpt-dir", str(tmp_path / "ckpt"),
         "--grace", "30", "--", sys.executable,
         *flaky(tmp_path, "--preemption", "--steps", "100000")],
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert supervisor.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        supervisor.send_signal(signal.SIGTERM)
        _, err = supervisor.communicate(timeout=60)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == PREEMPTED_EXIT_CODE, err
    last_logged = read_log(log)[-1]["step"]
    assert read_manifest(LocalStorage(str(tmp_path / "ckpt"))).snapshots[-1].step == last_logged
    assert (f"received SIGTERM, forwarded it to the job; the job was preempted (exit code 75); "
            f"not restarting (step {last_logged} committed)") in err
    assert err.count("started: pid") == 1


@pytest.mark.parametrize("sig, job_exit, expected", [
    (signal.SIGTERM, PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE),  # the job committed and exited 75
    (signal.SIGINT, 1, 128 + signal.SIGINT)])
def test_signal_to_supervisor_is_forwarded_and_nothing_of_the_job_survives(tmp_path, sig, job_exit,
                                                                            expected):
    out = str(tmp_path / "job")
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "async_ckpt.tools.supervisor", "--grace", "1", "--backoff", "0", "--",
         sys.executable, SIGNAL_JOB, out, str(job_exit)],
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(out + ".json"):
            assert supervisor.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with open(out + ".json") as f:
            pids = json.load(f)
        supervisor.send_signal(sig)
        _, err = supervisor.communicate(timeout=30)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == expected, err
    with open(out + ".signal") as f:
        assert f.read() == sig.name  # forwarded to the job
    assert f"received {sig.name}, forwarded it to the job" in err
    assert err.count("started: pid") == 1 and "restart " not in err
    assert "sending SIGKILL" in err  # the helpers ignore SIGTERM
    for pid in [pids["pid"], *pids["helpers"]]:
        assert gone(pid), pid
    assert group_members(pids["pid"]) == []


# --- plain commands and usage ------------------------------------------------------------------


def test_plain_command_without_checkpoint_directory(capsys):
    assert supervise(["sh", "-c", "exit 0"]) == 0
    err = capsys.readouterr().err
    assert "async-ckpt supervise: the job finished (exit code 0)\n" in err
    assert "step" not in err and "scratch" not in err
    assert main(["--max-restarts", "1", "--backoff", "0", "--", "sh", "-c", "exit 4"]) == 4
    err = capsys.readouterr().err
    assert "restart 1 of 1 (attempt 2): exit code 4; restarting in 0.0 s\n" in err
    assert err.rstrip().endswith("giving up after 1 restart; last failure: exit code 4")
    assert main(["sh", "-c", "exit 0"]) == 0  # without `--` too


def test_job_killed_by_a_signal_gives_up_with_exit_code_1(capsys):
    assert main(["--max-restarts", "0", "--", "sh", "-c", "kill -KILL $$"]) == 1
    assert "last failure: killed by signal SIGKILL" in capsys.readouterr().err


@pytest.mark.parametrize("argv, code, message", [
    ([], 2, "no command given"),
    (["--"], 2, "no command given"),
    (["--heartbeat-timeout", "3", "--", "true"], 2, "pass --ckpt-dir"),
    (["--", "/nonexistent/command"], 127, "cannot run /nonexistent/command"),
])
def test_usage_errors(argv, code, message, capsys):
    assert main(argv) == code
    assert message in capsys.readouterr().err
