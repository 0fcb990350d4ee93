"""Keep a training command running until it finishes: ``async-ckpt supervise [OPTIONS] -- CMD ...``.

The supervisor runs CMD in a process group (and session) of its own and restarts it when it exits
non-zero or, with ``--ckpt-dir`` and ``--heartbeat-timeout``, when its heartbeat goes stale (a hung
collective, a deadlock, a stuck filesystem). It stops:

- when CMD exits 0: exit 0;
- when CMD exits with the preemption code (``errors.PREEMPTED_EXIT_CODE``, 75, what an engine
  with ``preemption=True`` exits with once the snapshot a SIGTERM/SIGUSR1 triggered is committed):
  exit with that code, without restarting, so the scheduler's requeue logic sees the preemption;
- after ``--max-restarts`` restarts: exit with the last failure's exit code (1 when it was killed by
  a signal or hung), after one line naming that failure and the newest committed step;
- when the supervisor itself gets SIGTERM, SIGINT or SIGHUP: the signal is forwarded to CMD's
  process group, CMD gets ``--grace`` seconds to act on it (commit a snapshot, exit), and the
  supervisor exits with CMD's code if that is the preemption code, else 128 + the signal number.

Killing a job means SIGTERM to its process group, ``--grace`` seconds to exit, then SIGKILL to the
group and to every other process the job started. The job's processes are followed as a tree, not
only as a group: ``torchrun`` starts each worker in a session of its own, and once the agent is
killed its workers are orphans; the supervisor therefore makes itself a child subreaper (Linux) so
that orphans of the job stay its descendants, and SIGKILLs whatever of the tree is left. The
engine's writer process ignores SIGTERM and finishes the snapshot in flight, so a SIGTERM with a
grace period loses no committed work.

Heartbeats are the engine's ``DIR/heartbeat.rankRRRRR.json`` files (``heartbeat.py``: one per
rank, replaced atomically, written from ``snapshot()`` calls at most once per their ``interval``,
10 s by default; ``--heartbeat-timeout`` must be well above it). Only heartbeats written after the
current attempt started count; the job is hung when no rank wrote one within ``--startup-timeout``
seconds of the start, or when the oldest rank's last heartbeat is older than
``--heartbeat-timeout`` seconds; a rank whose engine has closed (its last heartbeat says
``"closed": true``) is past its checkpointing and no longer timed. The heartbeat's ``time`` is
compared with this machine's clock.

Restarts are delayed by ``--backoff`` seconds, doubled after each failure that committed no newer
snapshot, capped at ``MAX_BACKOFF_S``; a run that committed a newer snapshot resets the delay. Every
start and every restart is one line on stderr, prefixed ``async-ckpt supervise:``, naming the
attempt, the reason, the delay and the step the job will resume from.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import psutil

from .argtypes import DURATION_FORMS, duration_arg, int_arg
from .common import (EXIT_CANNOT_RUN, EXIT_JOB_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_SIGNALLED,
                     EXIT_USAGE, SUPERVISE_EXIT_CODES_HELP)
from ..errors import PREEMPTED_EXIT_CODE, CheckpointError
from ..format.heartbeat import HeartbeatRecord
from ..format.manifest import SnapshotRecord, read_manifest
from ..storage.local import LocalStorage

__all__ = ["PREEMPTED_EXIT_CODE", "MAX_BACKOFF_S", "supervise", "add_arguments", "run_from_args",
           "main"]

MAX_BACKOFF_S = 300.0  # the longest delay before a restart
PROG = "async-ckpt supervise"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_KILL_WAIT_S = 10.0  # how long to wait for SIGKILLed processes to disappear before saying so
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


# --- heartbeats --------------------------------------------------------------------------------


def read_heartbeats(directory: str) -> list[HeartbeatRecord]:
    """Every rank's latest heartbeat under ``directory``, as the engine writes them
    (``train/heartbeat.py``); unreadable files and what is not a heartbeat (half replaced,
    another program's) are skipped: the next beat replaces them."""
    return [beat for beat in map(HeartbeatRecord.parse, LocalStorage(directory).heartbeats())
            if beat is not None]


def _fresh_beats(directory: str, since: float) -> dict[int, HeartbeatRecord]:
    """``{rank: heartbeat}`` of the heartbeats under ``directory`` written at or after ``since``
    (Unix time)."""
    return {beat.rank: beat for beat in read_heartbeats(directory) if beat.time >= since}


# --- the job's processes -----------------------------------------------------------------------


class _Job:
    """One attempt: CMD as the leader of a new session and process group, and every process it
    starts, followed as a tree (a torchrun worker lives in a session of its own)."""

    def __init__(self, cmd: Sequence[str], not_ours: set[int]):
        self.started_wall = time.time()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(list(cmd), start_new_session=True)
        self.pgid = self.proc.pid
        self._not_ours = not_ours  # children the caller had before: not part of the job
        self._tree: dict[int, psutil.Process] = {}
        self.refresh()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def refresh(self) -> None:
        """Add the job's new processes to the tree (orphans of the job are our children while we
        are a subreaper) and reap those of our children that died."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                if child.pid in self._not_ours:
                    continue
                self._tree.setdefault(child.pid, child)
                with contextlib.suppress(psutil.Error):
                    for p in child.children(recursive=True):
                        self._tree.setdefault(p.pid, p)
        self.alive()

    def alive(self) -> list[psutil.Process]:
        """The job's processes that still run (zombies excluded; ours are reaped)."""
        out = []
        for pid, p in list(self._tree.items()):
            try:
                if not p.is_running():
                    del self._tree[pid]
                elif p.status() == psutil.STATUS_ZOMBIE:
                    if pid != self.proc.pid:  # the leader is Popen's to reap
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(pid, os.WNOHANG)
                else:
                    out.append(p)
            except psutil.NoSuchProcess:
                del self._tree[pid]
            except psutil.Error:
                out.append(p)
        return out

    def _group(self) -> list[psutil.Process]:
        """Live members of the job's process group that the tree missed (not ours, not zombies)."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        members = []
        for p in psutil.process_iter():
            if p.pid in self._tree:
                continue
            try:
                if os.getpgid(p.pid) == self.pgid and p.status() != psutil.STATUS_ZOMBIE:
                    members.append(p)
            except (OSError, psutil.Error):
                continue
        return members

    def gone(self) -> bool:
        self.proc.poll()
        self.refresh()
        return not self.running and not self.alive() and not self._group()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def signal_all(self, sig: int) -> None:
        self.signal_group(sig)
        for p in self.alive() + self._group():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def stop(self, grace: float, poll: float, signalled: bool = False) -> None:
        """Make sure nothing of the job is left: SIGTERM (unless ``signalled``: a signal was sent
        already), up to ``grace`` seconds to exit, then SIGKILL to everything left."""
        if self.gone():
            return
        if not signalled:
            if self.running:
                self.signal_group(signal.SIGTERM)  # a torchrun agent passes it on to its workers
            else:  # stragglers of a leader that exited: they may live in other groups
                self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not self.gone():
            if time.monotonic() >= deadline:
                break
            time.sleep(min(poll, 0.05))
        else:
            return
        left = {p.pid for p in self.alive() + self._group()}
        left |= {self.pgid} if self.running else set()
        _log(f"{len(left)} process{'es' * (len(left) != 1)} of the job still running {grace:g} s "
             "after SIGTERM; sending SIGKILL")
        deadline = time.monotonic() + _KILL_WAIT_S
        while not self.gone() and time.monotonic() < deadline:
            self.signal_all(signal.SIGKILL)
            time.sleep(0.05)
        if not self.gone():
            pids = ", ".join(str(p.pid) for p in self.alive() + self._group())
            _log(f"warning: processes of the job survive SIGKILL (pids {pids or self.proc.pid}); "
                 "they may be stuck in the kernel (uninterruptible I/O)")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)

    @property
    def rc(self) -> int:
        """The leader's return code; -SIGKILL for a leader that would not die."""
        return -signal.SIGKILL if self.proc.returncode is None else self.proc.returncode


@contextlib.contextmanager
def _child_subreaper():
    """Become a child subreaper (Linux) for the duration: orphaned descendants of the job are then
    re-parented to us instead of init, so they can be found and killed."""
    prctl = None
    previous = ctypes.c_int(0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0) == 0 \
                    and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
                prctl = libc.prctl
    try:
        yield
    finally:
        if prctl is not None and not previous.value:
            prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


# --- the supervisor ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    """How an attempt ended: ``rc`` is the leader's return code (negative: killed by a signal);
    ``hung`` the reason the supervisor killed it, if it did."""

    rc: int
    hung: Optional[str] = None

    def reason(self) -> str:
        return self.hung if self.hung is not None else _describe_rc(self.rc)

    def exit_code(self) -> int:
        """What the supervisor exits with when it gives up after this failure."""
        return self.rc if self.hung is None and self.rc > 0 else EXIT_JOB_FAILED


def _describe_rc(rc: int) -> str:
    if rc >= 0:
        return f"exit code {rc}"
    try:
        return f"killed by signal {signal.Signals(-rc).name}"
    except ValueError:
        return f"killed by signal {-rc}"


def _log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class _Supervisor:
    def __init__(self, cmd, *, max_restarts, heartbeat_timeout, grace, ckpt_dir, startup_timeout,
                 backoff, preemption_exit_code, poll_interval):
        self.cmd = list(cmd)
        self.max_restarts = max_restarts
        self.heartbeat_timeout = heartbeat_timeout
        self.grace = grace
        self.ckpt_dir = None if ckpt_dir is None else os.fspath(ckpt_dir)
        self.startup_timeout = startup_timeout
        self.backoff = backoff
        self.preemption_exit_code = preemption_exit_code
        self.poll = poll_interval
        self.job: Optional[_Job] = None
        self._not_ours: set[int] = set()
        self.received: Optional[int] = None  # a signal the supervisor got: stop after this attempt
        self._warned_interval = False

    # signals ------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self.received = signum
        job = self.job
        if job is not None and job.proc.returncode is None:
            job.signal_group(signum)

    @contextlib.contextmanager
    def _forwarding(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread; the caller handles them
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _FORWARDED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    # the manifest -------------------------------------------------------------------------

    def _newest(self) -> tuple[Optional[SnapshotRecord], Optional[str]]:
        """The newest committed snapshot (commit order), and why not when the manifest cannot be
        read."""
        if self.ckpt_dir is None:
            return None, None
        try:
            manifest = read_manifest(LocalStorage(self.ckpt_dir))
        except (CheckpointError, OSError) as e:
            return None, str(e)
        return (manifest.snapshots[-1] if manifest.snapshots else None), None

    def _committed(self) -> str:
        """`` (step 17 committed)``, or nothing without a checkpoint directory."""
        if self.ckpt_dir is None:
            return ""
        record, error = self._newest()
        if error is not None:
            return " (committed step unknown: the manifest cannot be read)"
        return f" (step {record.step} committed)" if record else " (no step committed)"

    def _resume(self) -> str:
        record, error = self._newest()
        if error is not None:
            return f"resume step unknown ({' '.join(error.split())})"
        return f"resuming from step {record.step}" if record else "starting from scratch"

    # one attempt --------------------------------------------------------------------------

    def _hang(self, job: _Job) -> Optional[str]:
        """Why the job counts as hung now, or None."""
        beats = _fresh_beats(self.ckpt_dir, job.started_wall)
        live = {rank: beat for rank, beat in beats.items() if not beat.closed}
        if beats and not live:
            return None  # every rank's engine closed: the job is past checkpointing, exiting
        beats = live
        if not beats:
            waited = time.monotonic() - job.started
            if waited > self.startup_timeout:
                return (f"no heartbeat within {self.startup_timeout:g} s of the start "
                        "(--startup-timeout)")
            return None
        rank, beat = min(beats.items(), key=lambda item: item[1].time)
        interval = beat.interval
        if (not self._warned_interval and interval is not None
                and interval >= self.heartbeat_timeout):
            self._warned_interval = True
            _log(f"warning: the job writes a heartbeat only every {interval:g} s, so "
                 f"--heartbeat-timeout {self.heartbeat_timeout:g} s is too short: a healthy job "
                 "may be killed; use a timeout several times the interval")
        age = time.time() - beat.time
        if age > self.heartbeat_timeout:
            return (f"heartbeat stale for {age:.1f} s (rank {rank}, last heartbeat at step "
                    f"{beat.step})")
        return None

    def _attempt(self, attempt: int) -> _Outcome:
        total = self.max_restarts + 1
        job = self.job = _Job(self.cmd, self._not_ours)
        _log(f"attempt {attempt} of {total} started: pid {job.proc.pid} (process group {job.pgid})")
        if self.received is not None:  # arrived while starting: the handler saw no job yet
            job.signal_group(self.received)
        watch_heartbeat = self.heartbeat_timeout is not None
        while True:
            if self.received is not None:
                job.stop(self.grace, self.poll, signalled=True)
                return _Outcome(job.rc)
            if not job.running:
                job.stop(self.grace, self.poll)  # stragglers (a writer finishing its commit)
                return _Outcome(job.rc)
            hung = self._hang(job) if watch_heartbeat else None
            if hung is not None and job.running:
                _log(f"the job is hung: {hung}; stopping it (SIGTERM, then SIGKILL after "
                     f"{self.grace:g} s)")
                job.stop(self.grace, self.poll)
                return _Outcome(job.rc, hung=hung)
            time.sleep(self.poll)
            job.refresh()

    def _sleep(self, seconds: float) -> bool:
        """Sleep, or stop early when a signal arrives; True when it slept through."""
        deadline = time.monotonic() + seconds
        while self.received is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, self.poll))
        return False

    # the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        self._not_ours = {p.pid for p in psutil.Process().children()}
        with self._forwarding(), _child_subreaper():
            try:
                return self._loop()
            finally:
                if self.job is not None:
                    self.job.stop(self.grace, self.poll)

    def _loop(self) -> int:
        restarts = streak = 0
        _log(f"running {shlex.join(self.cmd)}"
             + (f"; {self._resume()}" if self.ckpt_dir is not None else ""))
        last_seq = getattr(self._newest()[0], "seq", None)
        while True:
            outcome = self._attempt(restarts + 1)
            if self.received is not None:  # also when it came while a hung job was being stopped
                return self._stopped_by_signal(outcome, self.received)
            if outcome.hung is None and outcome.rc == 0:
                _log(f"the job finished (exit code 0){self._committed()}")
                return EXIT_OK
            if outcome.hung is None and outcome.rc == self.preemption_exit_code:
                _log(f"the job was preempted (exit code {outcome.rc}); not restarting"
                     f"{self._committed()}")
                return outcome.rc
            seq = getattr(self._newest()[0], "seq", None)
            progressed, last_seq = seq is not None and seq != last_seq, seq
            if restarts >= self.max_restarts:
                _log(f"giving up after {restarts} restart{'s' * (restarts != 1)}; last failure: "
                     f"{outcome.reason()}{self._committed()}")
                return outcome.exit_code()
            if progressed:
                streak = 0
            delay = min(self.backoff * 2 ** streak, MAX_BACKOFF_S)
            streak += 1
            restarts += 1
            resume = f", {self._resume()}" if self.ckpt_dir is not None else ""
            _log(f"restart {restarts} of {self.max_restarts} (attempt {restarts + 1}): "
                 f"{outcome.reason()}; restarting in {delay:.1f} s{resume}")
            if not self._sleep(delay):
                name = signal.Signals(self.received).name
                _log(f"received {name} while waiting to restart; not restarting{self._committed()}")
                return EXIT_SIGNALLED + self.received

    def _stopped_by_signal(self, outcome: _Outcome, signum: int) -> int:
        name = signal.Signals(signum).name
        if outcome.hung is None and outcome.rc == self.preemption_exit_code:
            _log(f"received {name}, forwarded it to the job; the job was preempted (exit code "
                 f"{outcome.rc}); not restarting{self._committed()}")
            return outcome.rc
        _log(f"received {name}, forwarded it to the job; the job ended ({outcome.reason()}); "
             f"not restarting{self._committed()}")
        return EXIT_SIGNALLED + signum


def supervise(cmd: Sequence[str], *, max_restarts: int = 3,
              heartbeat_timeout: Optional[float] = None,
              grace: float = 30.0, ckpt_dir: Optional[str | os.PathLike] = None,
              startup_timeout: float = 300.0, backoff: float = 1.0,
              preemption_exit_code: int = PREEMPTED_EXIT_CODE, poll_interval: float = 0.2) -> int:
    """Run ``cmd`` until it exits 0, restarting it when it fails or hangs; returns the exit code
    for the supervisor (see the module docstring).

    Args:
        cmd: the command and its arguments (no shell).
        max_restarts: restarts after which the supervisor gives up (0: run once).
        heartbeat_timeout: seconds without a heartbeat after which the job counts as hung; None
            disables heartbeat checking. Needs ``ckpt_dir``.
        grace: seconds between SIGTERM and SIGKILL when the job is stopped, and how long a
            forwarded signal has to take effect.
        ckpt_dir: the engine's checkpoint directory: where heartbeats and the manifest are. Without
            it there is no heartbeat checking and the resume step is not logged.
        startup_timeout: seconds a (re)started job may take to write its first heartbeat.
        backoff: the delay before the first restart; doubled after each failure that committed no
            newer snapshot, capped at ``MAX_BACKOFF_S``.
        preemption_exit_code: the exit code with which the job says it was preempted: the
            supervisor stops and exits with it.
        poll_interval: seconds between checks of the job.

    Raises ValueError for invalid arguments and OSError when ``cmd`` cannot be started.
    Installs handlers for SIGTERM, SIGINT and SIGHUP (forwarded to the job) while it runs, when
    called from the main thread, and makes the process a child subreaper (Linux) meanwhile. Every
    child process the calling process gains while it runs counts as part of the job (and is
    stopped with it): do not start other processes from another thread meanwhile.
    """
    if not cmd:
        raise ValueError("no command to supervise; pass it after `--`")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, not {max_restarts!r}")
    if heartbeat_timeout is not None and not heartbeat_timeout > 0:
        raise ValueError(f"heartbeat_timeout must be > 0 seconds, not {heartbeat_timeout!r}")
    if heartbeat_timeout is not None and ckpt_dir is None:
        raise ValueError("heartbeat checking needs the checkpoint directory the heartbeats are "
                         "written to; pass --ckpt-dir")
    for name, value in (("grace", grace), ("backoff", backoff)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    for name, value in (("startup_timeout", startup_timeout), ("poll_interval", poll_interval)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, not {value!r}")
    if not isinstance(preemption_exit_code, int) or not 1 <= preemption_exit_code <= 255:
        raise ValueError(f"preemption_exit_code must be in 1..255, not {preemption_exit_code!r}")
    return _Supervisor(cmd, max_restarts=max_restarts, heartbeat_timeout=heartbeat_timeout,
                       grace=grace, ckpt_dir=ckpt_dir, startup_timeout=startup_timeout,
                       backoff=backoff, preemption_exit_code=preemption_exit_code,
                       poll_interval=poll_interval).run()


# --- command line ------------------------------------------------------------------------------

DESCRIPTION = (
    "Run CMD in a process group of its own and restart it when it exits non-zero or, with "
    "--ckpt-dir and --heartbeat-timeout, when its heartbeat goes stale (SIGTERM to the group, "
    "SIGKILL after --grace), waiting --backoff, doubled after each failure that "
    "committed no newer snapshot. Stops when CMD exits 0, when it exits with the preemption code, "
    "or after --max-restarts restarts. SIGTERM, SIGINT and SIGHUP are forwarded to CMD, which is "
    "then not restarted. Works around `torchrun ...` as well as `python train.py ...`: every "
    f"process CMD starts is stopped with it. A DURATION is {DURATION_FORMS}.")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the arguments of ``supervise`` on ``parser`` (a subcommand's parser)."""
    parser.add_argument("--max-restarts", type=int_arg(0), default=3, metavar="N",
                        help="give up after N restarts (default 3; 0: run once)")
    parser.add_argument("--heartbeat-timeout", type=duration_arg(positive=True), metavar="DURATION",
                        help="restart CMD when a rank's newest heartbeat is older than DURATION "
                        "(needs --ckpt-dir; default: no heartbeat checking)")
    parser.add_argument("--grace", type=duration_arg(), default=30.0, metavar="DURATION",
                        help="time between SIGTERM and SIGKILL when stopping CMD (default 30s)")
    parser.add_argument("--ckpt-dir", metavar="DIR",
                        help="the engine's checkpoint directory: heartbeats are read and the step "
                        "CMD resumes from is logged")
    parser.add_argument("--startup-timeout", type=duration_arg(positive=True), default=300.0,
                        metavar="DURATION", help="time a (re)started CMD may take to write its "
                        "first heartbeat (default 300s)")
    parser.add_argument("--backoff", type=duration_arg(), default=1.0, metavar="DURATION",
                        help="delay before the first restart, doubled after each failure that "
                        f"committed no newer snapshot, at most {MAX_BACKOFF_S:g} s (default 1s)")
    parser.add_argument("--preemption-exit-code", type=int_arg(1, 255), default=PREEMPTED_EXIT_CODE,
                        metavar="N", help="CMD exits with N when preempted: stop and exit N "
                        f"(default {PREEMPTED_EXIT_CODE})")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                        help="the command to run, after `--`")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``supervise`` with parsed arguments; returns the exit code."""
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        return _usage_error("no command given; usage: async-ckpt supervise [OPTIONS] -- CMD ...")
    try:
        return supervise(cmd, max_restarts=args.max_restarts,
                         heartbeat_timeout=args.heartbeat_timeout, grace=args.grace,
                         ckpt_dir=args.ckpt_dir, startup_timeout=args.startup_timeout,
                         backoff=args.backoff, preemption_exit_code=args.preemption_exit_code)
    except ValueError as e:
        return _usage_error(str(e))
    except (FileNotFoundError, PermissionError) as e:
        _log(f"error: cannot run {cmd[0]}: {e.strerror}; check the command")
        return EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_CANNOT_RUN


def _usage_error(message: str) -> int:
    _log(f"error: {message}")
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=textwrap.fill(DESCRIPTION, 79),
                                     epilog=SUPERVISE_EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m async_ckpt.tools.supervisor [OPTIONS] -- CMD ...``: the same as the subcommand."""
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
