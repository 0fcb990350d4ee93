"""The public engine: ``snapshot(step)`` in the training loop, ``restore()`` at start-up.

``snapshot`` captures the state, copies its tensors into a free staging slot and hands the slot to
the writer process; that is all the training loop ever waits for (plus, when every slot is still
being written, for one to come free). Everything else (encoding, writing, fsync, commit, retention)
happens in the writer. Failures of the writer come back as typed errors at the next call.

The engine is driven from one thread (the training loop); it is not thread-safe. Under
``torch.distributed`` every rank runs its own engine and writer on one shared directory; rank 0's
writer commits a step once every rank's shard of it is durable (see ``commit.py``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import signal
import threading
import time
import warnings
import weakref
from typing import Any, Iterable, MutableMapping, Optional, Union

import psutil

from . import errors
from .data import inexact_loader_warnings
from .distributed import Coordinator, resolve_ranks
from .errors import (CheckpointError, CorruptSnapshotError, EngineClosedError, Preempted,
                     StateMismatchError, WorldSizeMismatchError, WriterDiedError)
from .format.manifest import SnapshotRecord, read_manifest
from .format.names import MAX_STEP, RNG_KEY, snapshot_dir_name
from .read.restore import apply, check_generator_states, mismatch_error
from .read.snapshot import Entry, read_committed
from .storage.local import ensure_writable_dir
from .storage.locks import lock_path
from .train.capture import capture, plan_layout
from .train.heartbeat import Heartbeat
from .train.rng import GlobalRNG
from .train.session import start_session
from .train.staging import StagingPool
from .write.writer import WriterClient

log = logging.getLogger(__name__)
_STATS_HISTORY = 1000
DEFAULT_PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_CLOSE_TIMEOUT_S = 600.0
_WAIT_BEAT_MIN_S = 0.05  # while waiting for the writer, heartbeats at most this often


class CheckpointEngine:
    """Asynchronous snapshots of a training state into ``directory``.

    Args:
        directory: where snapshots and the manifest live; created if missing.
        state: name -> object with ``state_dict()``/``load_state_dict()``, a tensor, or a plain dict
            of those (a dict may also hold plain values such as counters).
        mode: "async" (``snapshot`` returns once the state is staged in CPU memory) or "sync"
            (returns once the snapshot is committed: the periodic blocking baseline).
        every: ``snapshot(step)`` does nothing unless ``step % every == 0`` (or ``force=True``).
        keep_last: committed snapshots kept (newest by commit order); at least 1.
        keep_every: also keep every snapshot whose step is a multiple of this.
        slots: staging buffers, each the size of the state; more slots absorb slower disks.
        when_busy: "wait" for a slot when all are being written, or "skip" the step (counted and
            logged; one rank only).
        compression: None (store raw) or "zstd" (sign/exponent byte planes of floats, all of other
            data); ``level`` is the zstd level.
        allow_pickle: allow values with no safe encoding to be pickled when saving, and pickled
            values to be loaded. Off by default: loading then never runs code from the file.
        rng: save the global RNG states (Python, NumPy, torch CPU, CUDA) with every snapshot and
            restore them with it, so a resumed run draws the same random numbers.
        rank, world_size: this process's shard of a snapshot (one file per rank); by default those
            of the initialised ``torch.distributed`` process group (else 0 and 1). With several
            ranks, create the engine, and call ``restore()`` and ``snapshot()``, on every rank.
        replicated: names of top-level entries that every rank holds identically (a DDP model and
            its optimizer): written once instead of once per rank, and checked (by checksum) to
            really be identical before a snapshot is committed.
        spread_replicated: share the writing of replicated tensors among the ranks (balanced by
            bytes) instead of leaving it all to rank 0.
        commit_timeout: rank 0's writer gives a snapshot up (it is never committed) when no rank
            has written any of it for this many seconds while some rank's shard is missing.
        writer_nice: niceness added to the writer process (default: 10 in async mode, so training
            keeps the CPU; 0 in sync mode, where training waits for the writer anyway);
            ``writer_low_io`` lowers its I/O priority.
        reserve_bytes: refuse to start a snapshot that would leave less free disk than this.
        lock_timeout: seconds to wait for a previous writer on the same directory to finish.
        preemption: True (SIGTERM and SIGUSR1) or a list of signals to handle as a preemption
            notice: the handler only sets a flag; the next ``snapshot()`` call takes a snapshot
            whatever ``every`` says, waits for its commit and raises ``Preempted`` (a SystemExit
            with code 75). Installed from the main thread only; the old handlers come back at
            ``close()``.
        heartbeat_interval: seconds between heartbeat files written from ``snapshot()`` calls,
            and while the engine waits for its writer (``wait()``, ``close()``, a busy slot)
            (``DIR/heartbeat.rankNNNNN.json``); None turns them off.
        slow_writer_s: a snapshot that waits this long for a free slot is logged and counted as
            the writer falling behind (``stats()["writer_behind"]``).
    """

    def __init__(self, directory: str | os.PathLike, state: MutableMapping[str, Any], *,
                 mode: str = "async", every: int = 1, keep_last: int = 3,
                 keep_every: Optional[int] = None, slots: int = 2, when_busy: str = "wait",
                 compression: Optional[str] = None, level: int = 1, allow_pickle: bool = False,
                 rng: bool = True, rank: Optional[int] = None, world_size: Optional[int] = None,
                 replicated: Iterable[str] = (), spread_replicated: bool = False,
                 commit_timeout: float = 120.0, writer_nice: Optional[int] = None,
                 writer_low_io: bool = True, reserve_bytes: int = 0, lock_timeout: float = 60.0,
                 preemption: Union[bool, Iterable[int]] = False,
                 heartbeat_interval: Optional[float] = 10.0, slow_writer_s: float = 30.0):
        _require(mode in ("async", "sync"), f"mode must be 'async' or 'sync', not {mode!r}")
        _require(when_busy in ("wait", "skip"), f"when_busy must be 'wait' or 'skip', not {when_busy!r}")
        _require(compression in (None, "zstd"), f"compression must be None or 'zstd', not {compression!r}")
        _require(isinstance(every, int) and every >= 1, "every must be an int >= 1")
        _require(isinstance(keep_last, int) and keep_last >= 1, "keep_last must be an int >= 1")
        _require(keep_every is None or (isinstance(keep_every, int) and keep_every >= 1),
                 "keep_every must be None or an int >= 1")
        rank, world_size = resolve_ranks(rank, world_size)
        _require(0 <= rank < world_size, "rank must be in [0, world_size)")
        _require(commit_timeout > 0, "commit_timeout must be positive")
        _require(world_size == 1 or when_busy == "wait", "when_busy='skip' needs one rank: ranks "
                 "would skip different steps, which then never commit; use when_busy='wait'")
        if not isinstance(state, MutableMapping):
            raise TypeError("state must be a dict of name -> stateful object, tensor or dict")
        _require(RNG_KEY not in state, f"{RNG_KEY!r} is reserved for the engine's RNG entry")
        replicated = frozenset([replicated] if isinstance(replicated, str) else replicated)
        _require(replicated <= state.keys(), "replicated names entries that are not in state: "
                 f"{sorted(replicated - state.keys())}")
        for message in inexact_loader_warnings(state):
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self.directory = ensure_writable_dir(directory)
        self.state = state
        self.mode, self.every, self.when_busy = mode, every, when_busy
        self.allow_pickle, self.rank, self.world_size = allow_pickle, rank, world_size
        self.replicated = replicated
        self._rng = GlobalRNG() if rng else None
        self._closed = False
        self._broken: Optional[WriterDiedError] = None
        self._pending: dict[int, dict] = {}  # job number -> its figures so far, in submission order
        self._jobs = itertools.count()
        self._attempts: collections.Counter = collections.Counter()  # snapshots taken per step
        self._last_step_taken: Optional[int] = None
        self._failures: collections.deque[errors.CheckpointError] = collections.deque()
        self._history: collections.deque[dict] = collections.deque(maxlen=_STATS_HISTORY)
        self._counts = collections.Counter()
        self._writer_plan = None
        self._slow_writer_s = slow_writer_s
        self._heartbeat = (Heartbeat(self.directory, rank, heartbeat_interval)
                           if heartbeat_interval is not None else None)
        self._preempted_by: Optional[int] = None
        self._old_handlers: dict = {}
        if preemption and threading.current_thread() is not threading.main_thread():
            raise ValueError("preemption handlers can only be installed from the main thread; "
                             "create the engine there or pass preemption=False")
        self._coordinator = Coordinator(rank, world_size)
        session = self._pool = None
        try:
            session = start_session(self.directory, self._coordinator, {
                "every": every, "keep_last": keep_last, "keep_every": keep_every,
                "replicated": sorted(replicated), "spread_replicated": spread_replicated,
                "rng": rng, "mode": mode}, lock_timeout)
            self._session = session.token
            self._pool = StagingPool(slots)
            self._writer = WriterClient({
                "root": self.directory, "rank": rank, "world_size": world_size,
                "spread_replicated": spread_replicated, "commit_timeout": commit_timeout,
                "keep_last": keep_last, "keep_every": keep_every, "compression": compression,
                "level": level, "reserve_bytes": reserve_bytes,
                "nice": writer_nice if writer_nice is not None else (10 if mode == "async" else 0),
                "low_io_priority": writer_low_io, "lock": lock_path(self.directory, rank),
                "log_level": logging.getLogger("async_ckpt").getEffectiveLevel()})
        except BaseException:
            if self._pool is not None:
                self._pool.close()
            if session is not None:
                os.close(session.lock_fd)
            raise
        # An engine dropped without close(): free its memory and lock, and let its writer finish
        # what was staged (it exits when the socket closes) instead of blocking the next engine.
        self._release = weakref.finalize(self, _release_resources, self._pool, self._writer,
                                         session.lock_fd)
        self._old_handlers = self._install_preemption_handlers(preemption)

    # --- set-up -----------------------------------------------------------------------------

    def _install_preemption_handlers(self, preemption) -> dict:
        if preemption is False or preemption is None:
            return {}
        signals = DEFAULT_PREEMPTION_SIGNALS if preemption is True else tuple(preemption)

        def on_signal(signum, frame):  # a flag only: the training loop acts at its next snapshot()
            self._preempted_by = signum

        return {s: signal.signal(s, on_signal) for s in signals}

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._old_handlers = {}

    # --- the training loop ------------------------------------------------------------------

    def snapshot(self, step: int, *, force: bool = False) -> bool:
        """Take a snapshot tagged ``step``; True if one was taken.

        Async mode returns as soon as the state sits in CPU staging memory: changes to the state
        made after the call returns never reach this snapshot. Raises the error of an earlier
        snapshot that failed to write (typed, see ``async_ckpt.errors``), or ``Preempted`` after a
        preemption signal once this step's snapshot is committed.
        """
        self._check_usable()
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
            raise ValueError(f"step must be an int in [0, 10**20), not {step!r}")
        if self._heartbeat is not None:
            self._heartbeat.beat(step)
        self._drain(block=False)
        if self._old_handlers and self.world_size > 1:  # every rank stops at the same step
            self._preempted_by = self._coordinator.max(self._preempted_by or 0) or None
        preempting = self._preempted_by is not None
        if not (force or preempting) and step % self.every:
            return False
        called_at, t0 = time.monotonic(), time.perf_counter()
        slot = self._acquire_slot(may_skip=not preempting)
        if slot is None:
            self._counts["skipped"] += 1
            log.warning("skipped the snapshot of step %d: every staging slot is still being written "
                        "(%d skipped so far; add slots or snapshot less often)", step,
                        self._counts["skipped"])
            return False
        t_slot = time.perf_counter()
        captured = capture(self.state if self._rng is None else {**self.state, RNG_KEY: self._rng},
                           self.allow_pickle)
        plan, sources = plan_layout(captured.tensors, [
            key if key in self.replicated else None for key in captured.entry_of])
        old_buffer = slot.buffer_id
        if self._pool.fit(slot, plan, pin=any(s.is_cuda for s in sources)):
            if old_buffer >= 0:
                self._writer.detach(old_buffer)
            self._writer.attach(slot.buffer_id, slot.fd, slot.nbytes)
        t_captured = time.perf_counter()
        self._pool.stage(plan, sources, slot)
        del sources, captured.tensors
        t_staged = time.perf_counter()
        slot.busy = True
        job = next(self._jobs)
        self._writer.submit({"job": job, "step": step, "buffer_id": slot.buffer_id,
                             "dir": snapshot_dir_name(step, self._session, self._attempts[step]),
                             "tree": captured.tree,
                             "plan": plan if plan != self._writer_plan else None,
                             "submitted": time.monotonic()})
        self._attempts[step] += 1
        self._last_step_taken = step
        self._writer_plan = plan
        record = {"step": step, "called_at": called_at, "blocking_s": time.perf_counter() - t0,
                  "wait_slot_s": t_slot - t0, "capture_s": t_captured - t_slot,
                  "staging_s": t_staged - t_captured, "staged_bytes": plan.raw_bytes}
        self._pending[job] = record
        if self.mode == "sync" or self._preempted_by is not None:
            self.wait()
            record["blocking_s"] = time.perf_counter() - t0  # the caller waited for the commit
        if self._preempted_by is not None:  # also when the signal came during this call
            log.warning("preempted by signal %d: step %d is %s; exiting with code %d",
                        self._preempted_by, step, "committed" if record.get("committed") else
                        "NOT committed (see the warning above)", Preempted(step, 0).code)
            raise Preempted(step, self._preempted_by)
        return True

    def wait(self) -> None:
        """Block until every snapshot in flight is committed (or has failed, which raises, or was
        given up because another rank never finished its part, which is counted and logged)."""
        self._check_usable()
        while self._pending:
            self._handle(self._writer_event(None))
        self._raise_failures()

    def restore(self, step: Optional[int] = None, *, strict: bool = True,
                reshard: bool = False) -> Optional[int]:
        """Load the newest committed snapshot (or ``step``) into the registered objects.

        Returns the restored step, or None when nothing was ever committed. A damaged snapshot is
        logged and skipped in favour of the previous one; ``restore(step=N)`` never falls back.
        Raises StateMismatchError, loading nothing, when the snapshot does not fit the state.

        With several ranks, call it on every rank: they restore the same step, the newest that
        every rank can read, each its own per-rank state. A snapshot written by a different number
        of ranks raises WorldSizeMismatchError, unless ``reshard``: then only the ``replicated``
        entries are loaded (they are the same on every rank) and per-rank state stays as it is.
        """
        self._check_usable()
        self.wait()
        record, loaded = read_committed(self.directory, step, self.rank, self.allow_pickle,
                                        self._coordinator, lambda r: self._shard_to_read(r, reshard),
                                        self._check_loaded)
        if loaded is None:
            return None
        resharding = record.world_size != self.world_size
        return self._load(record.step, set(self.replicated) if resharding else None, loaded, strict)

    def _check_loaded(self, loaded: Entry) -> None:
        """Damage that shows only against what is registered: the RNG states this engine would
        set, and the states of registered generators (checked before anything is loaded)."""
        rng = loaded.value.get(RNG_KEY)
        if self._rng is not None and rng is not None:
            if rng.kind != "object":
                raise CorruptSnapshotError(f"the snapshot's {RNG_KEY} entry is not an RNG state")
            GlobalRNG.check_state(rng.value)
        check_generator_states(self.state, Entry("dict", {k: v for k, v in loaded.value.items()
                                                          if k != RNG_KEY}))

    def _shard_to_read(self, record: SnapshotRecord, reshard: bool) -> int:
        """The rank whose shard of ``record`` this rank reads; refuses another world size unless
        re-sharding the replicated entries."""
        if record.world_size == self.world_size:
            return self.rank
        if not reshard:
            raise WorldSizeMismatchError(
                f"step {record.step} in {self.directory} was written by {record.world_size} "
                f"rank(s); this job has {self.world_size}. Per-rank state (RNG, data position, "
                "optimizer shards) cannot be split or merged safely: restart with "
                f"{record.world_size} rank(s), or pass reshard=True to load only the replicated "
                "entries (see docs/distributed.md)")
        if not self.replicated:
            raise WorldSizeMismatchError(
                f"step {record.step} was written by {record.world_size} rank(s), this job has "
                f"{self.world_size}, and no entry is declared replicated, so nothing can be "
                "re-sharded; pass replicated= to the engine")
        skipped = sorted(set(self.state) - self.replicated)
        log.warning("re-sharding step %d from %d to %d ranks: loading only the replicated entries "
                    "%s; per-rank entries %s and the RNG keep their current state", record.step,
                    record.world_size, self.world_size, sorted(self.replicated), skipped)
        return min(self.rank, record.world_size - 1)

    def _load(self, step: int, keys: Optional[set], loaded: Entry, strict: bool) -> int:
        """Apply a snapshot read on every rank, after every rank has checked that it fits."""
        rng = loaded.value.pop(RNG_KEY, None)
        state = self.state if keys is None else {k: self.state[k] for k in keys}
        if keys is not None:
            loaded, rng = Entry("dict", {k: v for k, v in loaded.value.items() if k in keys}), None
        error = mismatch_error(state, loaded, step, strict)
        self._coordinator.raise_if_any(None if error is None else str(error), StateMismatchError,
                                       f"step {step} does not fit the registered state")
        apply(state, loaded, step, strict)
        if self._rng is not None and rng is not None:
            self._rng.load_state_dict(rng.value)
        log.info("restored step %d from %s", step, self.directory)
        return step

    def committed_steps(self) -> list[int]:
        """Restorable steps in commit order, oldest first (read from the manifest)."""
        return read_manifest(self.directory).steps()

    def stats(self) -> dict:
        """Figures per committed snapshot (newest last) and of the engine as a whole.

        ``snapshots[i]``: ``step``; ``blocking_s`` (what ``snapshot()`` cost training),
        ``wait_slot_s``, ``capture_s``, ``staging_s``; the writer's ``queue_s``, ``write_s``,
        ``fsync_s`` and, for rank 0, ``wait_ranks_s``; ``commit_s`` (durable to committed);
        ``to_commit_s`` (``snapshot()`` called to committed); ``committed_at`` (Unix time, as
        in the manifest); ``staged_bytes``, ``shard_bytes``, ``raw_bytes``, ``stored_bytes``;
        ``staging_gbps``, ``durable_gbps``. Durations are seconds."""
        if not self._closed and self._broken is None:
            self._drain(block=False, raise_failures=False)
        return {
            "snapshots": [dict(s) for s in self._history],
            "in_flight": len(self._pending),
            "committed": self._counts["committed"],
            "failed": self._counts["failed"],
            "skipped": self._counts["skipped"],
            "abandoned": self._counts["abandoned"],
            "writer_behind": self._counts["writer_behind"],
            "consecutive_failures": self._counts["consecutive_failures"],
            "pool_slots": len(self._pool.slots),
            "pool_bytes": self._pool.nbytes,
            "disk_free_bytes": shutil.disk_usage(self.directory).free,
            "trainer_rss": psutil.Process().memory_info().rss,
            **({} if self._closed else self._writer.rss()),
        }

    def close(self, final_step: Optional[int] = None) -> None:
        """Wait for snapshots in flight, then stop the writer and free the staging memory.

        ``final_step``: the last step the loop trained; it is snapshotted (whatever ``every``
        says) and committed first unless it was the last step snapshotted, so that a finished job
        run again does not retrain its last steps."""
        if self._closed:
            return
        try:
            if self._broken is None:
                if final_step is not None and final_step != self._last_step_taken:
                    self.snapshot(final_step, force=True)
                self.wait()
        finally:
            self._closed = True
            if self._broken is None:
                self._writer.close(_CLOSE_TIMEOUT_S)
            self._release()
            self._restore_signal_handlers()

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except errors.CheckpointError as e:
            log.error("while closing after %s: %s", exc_type.__name__, e)

    # --- events from the writer --------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineClosedError("this CheckpointEngine is closed; create a new one")
        if self._broken is not None:
            raise self._broken

    def _writer_event(self, timeout: Optional[float]) -> Optional[tuple]:
        """The next message from the writer, or None after ``timeout`` (None: wait for one). While
        waiting without a timeout (a slow commit in ``wait()``/``close()``, a slot coming free),
        heartbeats go on: a job waiting for its checkpoint is not hung."""
        try:
            if timeout is not None or self._heartbeat is None:
                return self._writer.next_event(timeout)
            while True:
                event = self._writer.next_event(max(self._heartbeat.interval, _WAIT_BEAT_MIN_S))
                if event is not None:
                    return event
                self._heartbeat.beat()
        except WriterDiedError as e:
            self._broken = e
            self._counts["failed"] += len(self._pending)
            self._pending.clear()
            raise

    def _acquire_slot(self, may_skip: bool):
        """A free slot; waits for one unless skipping is allowed (then None when all are busy)."""
        started = time.monotonic()
        while True:
            slot = self._pool.free_slot()
            if slot is not None or (may_skip and self.when_busy == "skip"):
                break
            self._handle(self._writer_event(None))
        waited = time.monotonic() - started
        if waited > self._slow_writer_s:
            self._counts["writer_behind"] += 1
            log.warning("the writer is falling behind: waited %.1f s for a free staging slot "
                        "(snapshot less often, add slots, or use a faster disk)", waited)
        return slot

    def _drain(self, block: bool, raise_failures: bool = True) -> None:
        while True:
            event = self._writer_event(None if block else 0)
            if event is None:
                break
            self._handle(event)
        if raise_failures:
            self._raise_failures()

    def _raise_failures(self) -> None:
        if self._failures:
            raise self._failures.popleft()

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "released":
            for slot in self._pool.slots:
                if slot.buffer_id == event[1]:
                    slot.busy = False
        elif kind == "committed":
            record = self._pending.pop(event[1])
            figures = event[2]
            record.update(figures, committed=True)
            record["to_commit_s"] = figures["committed_at"] - record.pop("called_at")
            # the writer reports a monotonic time; stats() gives Unix time, as the manifest does
            record["committed_at"] = time.time() - (time.monotonic() - figures["committed_at"])
            record["staging_gbps"] = record["staged_bytes"] / max(record["staging_s"], 1e-9) / 1e9
            record["durable_gbps"] = figures["shard_bytes"] / max(
                figures["write_s"] + figures["fsync_s"], 1e-9) / 1e9
            self._counts["committed"] += 1
            self._counts["consecutive_failures"] = 0
            self._history.append(record)
            log.info("committed step %d: blocked %.3f s, %.1f MB", record["step"],
                     record["blocking_s"], figures["stored_bytes"] / 1e6)
            if figures["disk_free_bytes"] < 2 * figures["stored_bytes"]:
                log.warning("the disk holding %s has %.0f MB free, less than two more snapshots "
                            "of %.0f MB", self.directory, figures["disk_free_bytes"] / 1e6,
                            figures["stored_bytes"] / 1e6)
        elif kind == "abandoned":  # another rank never wrote its part: not an error of this rank
            self._pending.pop(event[1])
            self._counts["abandoned"] += 1
            log.warning("%s", event[2])
        elif kind == "failed":
            self._pending.pop(event[1])
            self._counts["failed"] += 1
            self._counts["consecutive_failures"] += 1
            error_type = getattr(errors, event[2], errors.SnapshotWriteError)
            if not (isinstance(error_type, type) and issubclass(error_type, CheckpointError)):
                error_type = errors.SnapshotWriteError
            self._failures.append(error_type(event[3]))


def _release_resources(pool: StagingPool, writer: WriterClient, lock_fd: int) -> None:
    pool.close()
    writer.conn.close()
    os.close(lock_fd)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
