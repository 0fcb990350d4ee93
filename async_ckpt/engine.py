"""The public engine: ``snapshot(step)`` in the training loop, ``restore()`` at start-up.

``snapshot`` captures the state, copies its tensors into a free staging slot and hands the slot to
the writer process (the steps are ``train/pipeline.py``'s; the engine sequences them and holds the
policy: when, what to keep, what an error means); that is all the training loop ever waits for
(plus, when every slot is still being written, for one to come free). Everything else (encoding,
writing, fsync, commit, retention) happens in the writer. Failures of the writer come back as
typed errors at the next call.

The engine is driven from one thread (the training loop); it is not thread-safe. Under
``torch.distributed`` every rank runs its own engine and writer on one shared directory; rank 0's
writer commits a step once every rank's shard of it is durable (see ``commit.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import signal
import time
import warnings
import weakref
from typing import Any, Callable, Collection, Iterable, Literal, MutableMapping, Optional, Union

import psutil
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import errors
from .data import ResumableLoader, ResumableSampler, after_restore, inexact_loader_warnings
from .checks import is_int, short_repr
from .distributed import Coordinator
from .errors import (CorruptSnapshotError, EngineClosedError, InvalidArgumentError, NoSnapshotError,
                     Preempted, RemoteConflictError, RemoteStorageError, SnapshotWriteError,
                     StagingRaceError, StateMismatchError, WorldSizeMismatchError,
                     WriterDiedError)
from .format.manifest import SnapshotRecord, committed_steps, read_manifest
from .format.tree import RNG_KEY, NodeKind
from .storage.names import check_step
from .rng import GlobalRNG
from .options import EngineOptions
from .read.restore import apply, check_generator_states, mismatch_error
from .read.memory import require_memory
from .read.snapshot import Entry, ReadOptions, hold_verify_threads, read_committed, read_held
from .stats import EngineCounts, SnapshotFigures
from .tensors import registered_objects
from .storage.base import Storage
from .storage.local import LocalStorage
from .storage.remote import ObjectStorage
from .read.tiered import TieredStorage
from .train.capture import check_registrable
from .train.heartbeat import Heartbeat
from .train.incremental import ChangeTracker
from .train.memory_tier import HeldMemory, MemoryTier, open_memory_tier, refuse_sharded
from .train.pipeline import SnapshotPipeline, Staged
from .train.session import Session, start_session
from .train.staging import Slot, StagingPool
from .write.client import WriterClient
from .write.protocol import (Abandoned, Committed, Dropped, Failed, Marker, Released,
                             RemoteStatus, WriterConfig, WriterEvent)

log = logging.getLogger(__name__)
_STATS_HISTORY = 1000
_CLOSE_TIMEOUT_S = 600.0
_REMOTE_CLOSE_TIMEOUT_S = 600.0
_WAIT_BEAT_MIN_S = 0.05  # while waiting for the writer, heartbeats at most this often


_O = EngineOptions  # its class attributes are the defaults in CheckpointEngine's signature


class CheckpointEngine:
    """Asynchronous snapshots of a training state into ``directory``.

    Args:
        directory: where snapshots and the manifest live; created if missing.
        state: name -> object with ``state_dict()``/``load_state_dict()``, a tensor, or a plain dict
            of those (a dict may also hold plain values such as counters).
        mode, every, keep_last, ... (keyword-only): the fields of
            ``async_ckpt.options.EngineOptions``, with its defaults, documented and validated
            there; ``self.options`` holds them.
    """

    # Monotonic seconds the wait for a free slot is measured with (``slow_writer_s``); a test sets
    # a clock of its own on an engine instead of waiting that long.
    _clock = staticmethod(time.monotonic)

    def __init__(self, directory: str | os.PathLike, state: MutableMapping[str, Any], *,
                 mode: Literal["async", "sync"] = _O.mode, every: int = _O.every,
                 preemption: Union[bool, None, Collection[int]] = _O.preemption,
                 staging: Literal["eager", "lazy"] = _O.staging, copy_nice: int = _O.copy_nice,
                 slots: int = _O.slots,
                 when_busy: Literal["wait", "skip"] = _O.when_busy,
                 slow_writer_s: float = _O.slow_writer_s, rng: bool = _O.rng,
                 allow_pickle: Union[bool, Collection[Any]] = _O.allow_pickle,
                 compression: Optional[Literal["zstd"]] = _O.compression, level: int = _O.level,
                 incremental: bool = _O.incremental, full_every: int = _O.full_every,
                 commit_timeout: float = _O.commit_timeout,
                 writer_nice: Optional[int] = _O.writer_nice,
                 writer_low_io: bool = _O.writer_low_io, reserve_bytes: int = _O.reserve_bytes,
                 direct_io: bool = _O.direct_io, keep_last: int = _O.keep_last,
                 keep_every: Optional[int] = _O.keep_every, rank: Optional[int] = _O.rank,
                 world_size: Optional[int] = _O.world_size,
                 replicated: Union[str, Collection[str]] = _O.replicated,
                 spread_replicated: bool = _O.spread_replicated,
                 remote: Optional[str] = _O.remote,
                 remote_options: Optional[dict] = _O.remote_options,
                 remote_keep_last: Optional[int] = _O.remote_keep_last,
                 memory_every: Optional[int] = _O.memory_every,
                 memory_idle_timeout: float = _O.memory_idle_timeout,
                 lock_timeout: float = _O.lock_timeout,
                 heartbeat_interval: Optional[float] = _O.heartbeat_interval):
        given = locals()  # the parameters: every option by name, checked by EngineOptions
        self.options = o = _O(**{f.name: given[f.name] for f in dataclasses.fields(_O)})
        r = o.resolved
        o.check_state(state)
        check_registrable(state, o.allow_pickle)
        if o.memory_every is not None:
            refuse_sharded(state)
        for message in inexact_loader_warnings(state):
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self.state = state
        self.rank, self.world_size = r.rank, r.world_size  # as resolved from torch.distributed
        self._rng = GlobalRNG() if o.rng else None
        self._closed = False
        self._broken: Optional[WriterDiedError] = None
        self._pending: dict[int, SnapshotFigures] = {}  # job number -> figures, in submission order
        self._drops_queued = 0  # drop(wait=False) calls the writer has not answered yet
        self._jobs = itertools.count()
        self._last_step_taken: Optional[int] = None
        self._failures: collections.deque[errors.CheckpointError] = collections.deque()
        self._history: collections.deque[SnapshotFigures] = collections.deque(maxlen=_STATS_HISTORY)
        self._counts = EngineCounts()
        self._tracker = ChangeTracker(o.full_every) if o.incremental else None
        self._heartbeat: Optional[Heartbeat] = None
        self._preempted_by: Optional[int] = None
        self._old_handlers: dict = {}
        self._coordinator = Coordinator(self.rank, self.world_size)
        self._remote = None if o.remote is None else ObjectStorage(o.remote, o.remote_options)
        self._remote_status = RemoteStatus()  # the writer's latest
        self._staging: Optional[Staged] = None  # the snapshot whose copy fence() waits for
        self._restored_from: Optional[str] = None  # the tier the last restore read: memory, disk
        self._restores: collections.Counter = collections.Counter()  # restores by tier
        self._restore_slot_bytes = 0  # of the last restore: viewed in a staging slot, not read
        session = self._pool = self._writer = self._memory = None
        try:
            session = start_session(directory, self._coordinator, o.shared_settings(),
                                    o.lock_timeout, own_roots=o.remote is not None)
            self._session = session
            self.directory = session.directory.root  # the directory given, made absolute
            self.root = session.root  # where this rank's snapshots go: DIR, or DIR/rank-RRRRR
            if o.heartbeat_interval is not None:
                self._heartbeat = Heartbeat(session.directory, self.rank, o.heartbeat_interval)
            self._pool = StagingPool(o.slots, o.copy_nice)
            self._writer = WriterClient(WriterConfig(
                root=self.root, own_root=session.own_root, lock=session.directory.lock_file(r.rank),
                log_level=logging.getLogger("async_ckpt").getEffectiveLevel(),
                **o.writer_settings()))
            if o.memory_every is not None:
                self._memory = open_memory_tier(session.directory, r.rank, r.world_size,
                                                self._pool, o.memory_idle_timeout, r.writer_nice)
            self._pipeline = SnapshotPipeline(
                self._pool, self._writer, self._memory, o.allow_pickle, self._rng, r.replicated,
                lambda nbytes: require_memory(nbytes, "a staging slot of the memory tier "
                                              "(memory_every)", "free host memory, lower slots, "
                                              "or turn the memory tier off"),
                raw=o.compression is None)
        except BaseException:
            if self._writer is not None:
                self._writer.close(_CLOSE_TIMEOUT_S)
            if self._pool is not None:
                self._pool.close()
            if session is not None:
                session.close()
            raise
        self._fences = _install_fences(self) if o.staging == "lazy" else []
        release_verify_threads = hold_verify_threads()  # its restores reuse them; close joins them
        # An engine dropped without close(): free its memory and lock, and let its writer finish
        # what was staged (it exits when the socket closes) instead of blocking the next engine.
        # The memory tier's keeper keeps what it holds: the process may be dying.
        self._release = weakref.finalize(self, _release_resources, self._pool, self._writer,
                                         session, self._fences, release_verify_threads,
                                         self._memory)
        self._old_handlers = self._install_preemption_handlers(r.preemption)

    # --- set-up -----------------------------------------------------------------------------

    def _install_preemption_handlers(self, signals: tuple[int, ...]) -> dict:
        def on_signal(signum, frame):  # a flag only: the training loop acts at its next snapshot()
            self._preempted_by = signum

        return {s: signal.signal(s, on_signal) for s in signals}

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._old_handlers = {}

    # --- the training loop ------------------------------------------------------------------

    def snapshot(self, step: int, *, force: bool = False,
                 state: Optional[MutableMapping[str, Any]] = None,
                 markers: Iterable[Marker] = ()) -> bool:
        """Take a snapshot tagged ``step``; True if one was taken.

        Async mode returns as soon as the state sits in CPU staging memory: changes to the state
        made after the call returns never reach this snapshot. Raises the error of an earlier
        snapshot that failed to write (typed, see ``async_ckpt.errors``), or ``Preempted`` after a
        preemption signal once this step's snapshot is committed.

        ``state``: snapshot this mapping (of the kinds the engine's ``state`` may hold) instead
        of the registered one, for code that builds what it saves anew each time (a framework's
        checkpoint dict); it is staged into the same reused slots. ``load()`` reads it back.
        ``markers``: ``Marker`` files or directories the writer writes once this snapshot is
        committed, never before (what a framework's own resume looks for).
        """
        self._check_usable()
        check_step(step)
        registered = state is None  # the memory tier holds only the registered state
        if registered:
            state = self.state
        else:
            self.options.check_state(state)
        if self._heartbeat is not None:
            self._heartbeat.beat(step)
        self._drain(block=False)
        if self._old_handlers and self.world_size > 1:  # every rank stops at the same step
            self._preempted_by = self._coordinator.max(self._preempted_by or 0) or None
        preempting = self._preempted_by is not None
        to_disk = force or preempting or step % self.options.every == 0
        to_memory = (registered and self._memory is not None and self._memory.active
                     and step % self.options.memory_every == 0)
        if not (to_disk or to_memory):
            return False
        called_at, t0 = time.monotonic(), time.perf_counter()
        self.fence()  # the previous snapshot's copy ends before this one is taken
        slot = self._acquire_slot(step, to_disk, may_skip=not preempting)
        if slot is None:
            return False
        t_slot = time.perf_counter()
        prepared = self._pipeline.prepare(state, slot, to_memory)
        t_captured = time.perf_counter()
        job = directory = None
        if to_disk:
            job, directory = next(self._jobs), self._session.snapshot_dir(step)
        lazy = (self.options.staging == "lazy" and self.options.mode == "async"
                and not preempting)
        staged = self._pipeline.start(prepared, slot, state, step, job, directory, to_memory,
                                      lazy, self._tracker, markers)
        self._staging = staged
        if not to_disk:
            if not lazy:
                self.fence()
                self._raise_failures()
            return True
        self._last_step_taken = step
        record = SnapshotFigures(step, called_at, blocking_s=0.0, wait_slot_s=t_slot - t0,
                                 capture_s=t_captured - t_slot, staging_s=0.0,
                                 staged_bytes=staged.staged_bytes)
        self._pending[job] = record
        if not lazy:
            self.fence()
            self._raise_failures()  # (a copy that failed: CUDA)
        record.blocking_s = time.perf_counter() - t0
        if self.options.mode == "sync" or self._preempted_by is not None:
            self.wait()
            record.blocking_s = time.perf_counter() - t0  # the caller waited for the commit
        if self._preempted_by is not None:  # also when the signal came during this call
            log.warning("preempted by signal %d: step %d is %s; exiting with code %d",
                        self._preempted_by, step, "committed" if record.committed else
                        "NOT committed (see the warning above)", Preempted(step, 0).code)
            raise Preempted(step, self._preempted_by)
        return True

    def fence(self) -> None:
        """Wait until the tensors of the last snapshot are copied (lazy staging; at once with
        eager staging), and hand the snapshot to the writer. Call it before changing the state
        in place by means the engine does not fence itself (it fences every optimizer's
        ``step()``, registered modules' and optimizers' ``load_state_dict``, ``snapshot()``,
        ``wait()``, ``restore()``, ``load()``, ``drop()`` and ``close()``). A staged tensor that
        changed before its copy ended fails that snapshot: ``StagingRaceError`` at the next
        call, naming it; the snapshot is not written, and the next one is unaffected."""
        staged, self._staging = self._staging, None
        if staged is None:
            return
        try:
            seconds = staged.copy.wait()
        except Exception as e:  # a CUDA error; a storage resized in place under the copy
            self._fail_staged(staged, SnapshotWriteError(
                f"step {staged.step} was not saved: copying its tensors into the staging slot "
                f"failed ({type(e).__name__}: {e}); the next snapshot is taken afresh"), e)
            return
        changed = staged.changed()
        if not changed:
            if staged.job is not None:
                self._pending[staged.job.job].staging_s = seconds
            self._pipeline.hand_over(staged)
            return
        self._fail_staged(staged, StagingRaceError(
            f"step {staged.step} was not saved: {', '.join(changed[:3])}"
            f"{f' and {len(changed) - 3} more' if len(changed) > 3 else ''} changed while being "
            "copied (lazy staging), by a write no fence saw. Call engine.fence() before changing "
            "the state in place outside an optimizer's step(), or use staging='eager'"))

    def _fail_staged(self, staged: Staged, error: errors.CheckpointError,
                     cause: Optional[BaseException] = None) -> None:
        """A snapshot that never reached the writer: its slot is free again, the next snapshot is
        whole, and ``error`` is raised at the next call (not from inside an optimizer's step)."""
        self._pipeline.abandon(staged)
        if staged.job is not None:
            self._pending.pop(staged.job.job)
            self._counts.record_failure()
            self._next_snapshot_full()
        error.__cause__ = cause
        log.error("%s", error)
        self._failures.append(error)

    def wait(self, remote: bool = False, timeout: Optional[float] = None) -> None:
        """Block until every snapshot in flight is committed (or has failed, which raises, or was
        given up because another rank never finished its part, which is counted and logged), and
        every ``drop(wait=False)`` is applied.

        ``remote``: then also until the bucket's manifest names the newest committed snapshot
        (snapshots committed while an upload ran may be skipped: ``stats()["upload_skipped"]``),
        raising RemoteStorageError after ``timeout`` seconds (None: no limit)."""
        self._check_usable()
        self.fence()
        while self._pending or self._drops_queued:
            self._handle(self._writer_event(None))
        self._raise_failures()
        if remote and self._remote is not None:
            self._wait_remote(timeout)

    def _wait_remote(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        newest = self._history[-1].step if self._history else None
        while newest is not None and self._remote_status.remote_step != newest:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RemoteStorageError(
                    f"step {newest} is committed locally but not yet in {self._remote.url} after "
                    f"{timeout:.0f} s (last error: {self._remote_status.last_error}); "
                    "it stays in the local directory, and a later engine uploads it")
            event = self._writer_event(left if left is not None else 1.0)
            if event is not None:
                self._handle(event)
            self._raise_failures()

    def restore(self, step: Optional[int] = None, *, strict: bool = True,
                reshard: bool = False, skip: Collection[str] = ()) -> Optional[int]:
        """Load the newest committed snapshot (or ``step``) into the registered objects.

        Returns the restored step, or None when nothing was ever committed. A damaged snapshot is
        logged and skipped in favour of the previous one; ``restore(step=N)`` never falls back.
        Raises StateMismatchError, loading nothing, when the snapshot does not fit the state.

        With ``memory_every`` (and no ``step``), the memory tier is asked first: when its keeper
        holds a snapshot newer than the newest committed one, that snapshot is verified against
        its checksums and copied into place, with no file read; when it holds nothing newer, is
        gone, or what it holds does not verify (said with a warning), the disk is read as above.
        ``stats()["restored_from"]`` says which.

        With several ranks, call it on every rank: they restore the same step, the newest that
        every rank can read, each its own per-rank state. Sharded tensors (``DTensor``) come back
        laid out as the registered ones are now, on any world size and mesh. A snapshot written
        by another number of ranks follows the rules of docs/distributed.md ("Another world
        size"): what every saved rank held alike loads as it was, rank ``r`` takes the global
        RNG of saved rank ``r % old_world_size`` (ranks past the old world size derive their
        own streams from it), and an entry the saved ranks held differently (a sampler position,
        plain per-rank tensors) raises WorldSizeMismatchError, loading nothing, unless
        ``reshard``: then those entries keep their current state.

        ``skip``: names of registered entries that keep their current state: the snapshot's
        entries of those names are neither checked nor loaded, nor count as per-rank state at
        another world size (what a framework excludes from loading, such as a data position
        that another world size cannot take).
        """
        self._check_usable()
        if isinstance(skip, str) or not all(isinstance(k, str) for k in skip):
            raise InvalidArgumentError(f"skip must be a collection of entry names, not "
                                       f"{short_repr(skip)}")
        self.wait()
        self._next_snapshot_full()  # what is restored came from a snapshot: compare afresh
        held = self._read_held() if step is None and self._memory is not None else None
        if held is not None:
            return self._restored(self._load(*held, strict, False, frozenset(skip)), "memory")
        mapped, scratch = self._pipeline.read_memory(self.state)
        record, loaded = self._read_committed(step, ReadOptions(
            self.options.allow_pickle, mapped, scratch=scratch, targets=self.state,
            slot_copies=self._pipeline.slot_copies(self.rank, self.world_size,
                                                   self.options.spread_replicated)))
        if loaded is None:
            return None
        from_slot = loaded.from_slot
        return self._restored(self._load(record.step, record.world_size, loaded, strict,
                                         reshard, frozenset(skip)), "disk", from_slot)

    def _read_held(self) -> Optional[tuple[int, int, Entry]]:
        """(step, world size, entry) of the memory tier's snapshot: the newest step that every
        rank's keeper holds, newer than the newest committed one, verified on every rank; None
        to read the disk instead (said with a warning when a keeper was expected to hold
        something and does not, what it holds is damaged, or the ranks' keepers hold no step in
        common). Every rank learns what every other found (from the training thread), so all
        read the same tier, and an error on one rank (a state that does not fit) is raised on
        all."""
        steps, newest = self._held_steps()
        everyone = self._coordinator.gather(steps)
        common = set(everyone[0]).intersection(*everyone[1:])
        if not common:
            if any(everyone):
                self._fall_back(f"the ranks' memory tiers hold no step in common newer than the "
                                f"disk's (steps {everyone}, by rank)", 4)
            return None
        step = max(common)
        held = problem = None
        try:
            held = self._verified_held(step, newest)
        except errors.CheckpointError as e:
            problem = e
        del newest  # its mapping lives as long as the tensors viewing it, no longer
        # each rank's outcome: its error itself (pickled with its class, as the writer's are), or
        # whether it holds the step verified
        answers = self._coordinator.gather(problem if problem is not None else held is not None)
        if problem is not None:
            raise problem
        failed = [(r, e) for r, e in enumerate(answers) if isinstance(e, errors.CheckpointError)]
        if failed:
            rank, error = failed[0]
            raise type(error)(f"rank {rank} cannot restore its memory snapshot: {error}")
        if not all(answers):
            if held is not None:
                self._fall_back(f"another rank's memory snapshot of step {step} is unusable", 4)
            return None
        return step, self.world_size, held

    def _held_steps(self) -> tuple[list[int], Optional[HeldMemory]]:
        """The steps this rank's keeper holds that are newer than the newest committed one, and
        its newest snapshot (what a single rank restores: asked for once)."""
        memory = self._memory
        if not memory.active:
            self._fall_back(f"the memory tier's keeper is gone ({memory.lost})", 5, log_it=False)
            return [], None
        received = memory.query()
        if received is None:
            if memory.lost_before:
                memory.lost_before = False  # said once
                self._fall_back("the memory tier's keeper of the previous run is gone (killed, "
                                "out of memory, or past memory_idle_timeout)", 5)
            return [], None
        manifest = read_manifest(self._committed_source())
        committed = manifest.snapshots[-1].step if manifest.snapshots else -1
        steps = [s for s in received.held.steps if s > committed]
        if not steps:
            log.info("the memory tier holds steps %s, none newer than committed step %d: "
                     "restoring from disk", list(received.held.steps), committed)
        return steps, received

    def _verified_held(self, step: int, newest: Optional[HeldMemory]) -> Optional[Entry]:
        """This rank's keeper's snapshot of ``step`` (``newest``, where that is the step, else
        asked for), verified; None when it is damaged or gone (said with a warning)."""
        received = newest if newest is not None and newest.held.step == step \
            else self._memory.query(step)
        del newest
        if received is None:
            self._fall_back(f"the memory tier's keeper no longer holds step {step}", 5)
            return None
        held = received.held
        try:
            loaded = read_held(held.tree, held.tensors, held.storages,
                               None if received.memory is None else memoryview(received.memory),
                               self.options.allow_pickle,
                               f"the memory tier's snapshot of step {held.step}")
            del received
            self._check_loaded(loaded)
        except errors.CheckpointError as e:
            if not e.is_damage:
                raise
            self._fall_back(f"the memory tier's snapshot of step {step} is unusable ({e})", 5)
            return None
        return loaded

    @staticmethod
    def _fall_back(why: str, stacklevel: int, log_it: bool = True) -> None:
        """Say why a restore reads the disk rather than the memory tier: a warning the user sees
        without logging set up, pointing at their restore() call ``stacklevel`` frames up."""
        message = f"{why}: restoring from disk"
        if log_it:
            log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

    def _restored(self, step: int, tier: str, from_slot: int = 0) -> int:
        """Count a restore of ``step`` from ``tier``, ``from_slot`` of whose bytes were taken
        from the staging slot the snapshot was written from."""
        self._restored_from, self._restore_slot_bytes = tier, from_slot
        self._restores[tier] += 1
        log.info("restored step %d from %s%s", step, tier,
                 f" ({from_slot / 1e6:.1f} MB of it from a staging slot)" if from_slot else "")
        return step

    def load(self, step: Optional[int] = None) -> tuple[int, dict]:
        """The newest committed snapshot that verifies (or ``step``), read as plain CPU tensors
        and values without loading it into the registered objects: each object's entry as its
        ``state_dict()`` was, each mapping given to ``snapshot(state=...)`` as it was given. For
        code that applies what it saved itself (a framework's checkpoint dict). Falls back past
        damage as ``restore()`` does and sets the global RNG states saved with it (``rng``).
        Returns (step, state); raises NoSnapshotError when nothing was ever committed, as
        ``async_ckpt.load`` does (``restore()`` returns None then: a job's first start)."""
        self._check_usable()
        self.wait()
        self._next_snapshot_full()
        record, loaded = self._read_committed(step, ReadOptions(self.options.allow_pickle))
        if loaded is None:
            raise NoSnapshotError(f"{self.directory} holds no committed snapshot to load "
                                  "(restore() returns None there: a job's first start)")
        self._load_rng(record.world_size, loaded.value.pop(RNG_KEY, None))
        return record.step, loaded.plain()

    def drop(self, steps: Iterable[int], *, wait: bool = True,
             files: Iterable[str] = ()) -> Optional[list[int]]:
        """Take committed ``steps`` out of the manifest and delete their snapshots (one that a
        kept snapshot refers to stays): retention decided outside the engine, such as a
        framework's ``save_top_k`` or ``save_total_limit``. Snapshots in flight are committed
        first, so a step still being written is dropped once whole, never raced. With several
        ranks on a shared directory, rank 0's call drops (the others' do nothing). The bucket
        of ``remote`` keeps its own retention (``remote_keep_last``). Returns the steps dropped.

        ``wait=False``: queue the drop behind the snapshots already taken and return None at
        once, so that retention applied right after a snapshot does not make training wait for
        its commit; the writer applies it once they are settled (with several ranks, rank 0's
        writer once every rank's shard of them is in and committed, or given up). A failure is
        raised by a later call, as a failed write's is.

        ``files``: files outside the engine's directory that stand for these snapshots in a
        framework's layout (what ``Marker``s wrote); the writer deletes them just before it drops
        the steps, in the same turn, so that a job killed with the drop still queued keeps both
        the files and the snapshots, never a snapshot that nothing names."""
        self._check_usable()
        steps = tuple(sorted(set(steps)))
        files = tuple(os.path.abspath(os.fspath(f)) for f in files)
        if not all(is_int(s) for s in steps):
            raise InvalidArgumentError(f"steps must be ints >= 0, not {short_repr(steps)}")
        if not wait:
            self.fence()  # a lazily staged snapshot reaches the writer first
            self._writer.drop(steps, files)
            self._drops_queued += 1
            return None
        self.wait()
        self._writer.drop(steps, files)
        while True:
            event = self._writer_event(None)
            if isinstance(event, Dropped):
                if event.error is not None:
                    raise event.error
                return list(event.steps)
            self._handle(event)

    def _committed_source(self) -> Storage:
        """Where committed snapshots are read: this rank's root, or it and the bucket."""
        local = LocalStorage(self.root)
        return local if self._remote is None else TieredStorage(local, self._remote)

    def _read_committed(self, step: Optional[int], how: ReadOptions
                        ) -> tuple[Optional[SnapshotRecord], Optional[Entry]]:
        """``read_committed`` as every rank of this job reads together: this rank's shard (or,
        from a snapshot of fewer ranks, rank ``rank % world_size``'s), checked against what is
        registered."""
        return read_committed(self._committed_source(), step, how,
                              shard_of=lambda record: self.rank % record.world_size,
                              coordinator=self._coordinator, check=self._check_loaded)

    def _check_loaded(self, loaded: Entry) -> None:
        """Damage that shows only against what is registered: the RNG states this engine would
        set, and the states of registered generators (checked before anything is loaded)."""
        rng = loaded.value.get(RNG_KEY)
        if self._rng is not None and rng is not None:
            if rng.kind != NodeKind.OBJECT:
                raise CorruptSnapshotError(f"the snapshot's {RNG_KEY} entry is not an RNG state")
            GlobalRNG.check_state(rng.value)
        check_generator_states(self.state, Entry(NodeKind.DICT, {
            k: v for k, v in loaded.value.items() if k != RNG_KEY}))

    def _per_rank_entries(self, step: int, world_size: int, loaded: Entry, reshard: bool,
                          skip: frozenset) -> frozenset:
        """At another world size: the entries that held per-rank state, which cannot be split or
        merged without knowing what they mean (but those ``skip`` leaves as they are). Raises
        WorldSizeMismatchError on every rank, unless ``reshard``, which leaves them as they
        are."""
        per_rank = sorted((loaded.differing & self.state.keys()) - self.options.resolved.replicated
                          - skip)
        problem = None
        if per_rank and not reshard:
            problem = (f"step {step} in {self.directory} was written by "
                       f"{world_size} rank(s), this job has {self.world_size}, and "
                       f"{', '.join(per_rank)} held different state on each saved rank (per-rank "
                       "state such as a data position): it cannot be split or merged safely. "
                       f"Restart with {world_size} rank(s), or pass reshard=True (or "
                       "skip=[their names]) to keep those entries as they are now (see "
                       "docs/distributed.md)")
        self._coordinator.raise_if_any(problem, WorldSizeMismatchError,
                                       f"step {step} cannot be restored on this world size")
        log.warning("restoring step %d, written by %d rank(s), on %d: sharded tensors re-split, "
                    "entries held alike by every saved rank loaded from saved rank %d; %s", step,
                    world_size, self.world_size, self.rank % world_size,
                    f"per-rank entries {per_rank} keep their current state" if per_rank
                    else "no per-rank entries")
        return frozenset(per_rank)

    def _load(self, step: int, world_size: int, loaded: Entry, strict: bool, reshard: bool,
              skip: frozenset) -> int:
        """Apply a snapshot of ``step`` written by ``world_size`` ranks, read on every rank,
        after every rank has checked that it fits."""
        rng = loaded.value.pop(RNG_KEY, None)
        kept = skip
        if world_size != self.world_size:
            kept = kept | self._per_rank_entries(step, world_size, loaded, reshard, skip)
        state = self.state
        if kept:
            state = {k: v for k, v in self.state.items() if k not in kept}
            loaded = Entry(NodeKind.DICT, {k: v for k, v in loaded.value.items() if k not in kept},
                           loaded.borrowed)
        error = mismatch_error(state, loaded, step, strict)
        self._coordinator.raise_if_any(None if error is None else str(error), StateMismatchError,
                                       f"step {step} does not fit the registered state")
        apply(state, loaded, step, strict, kept_by_state=(ResumableSampler, ResumableLoader))
        self._load_rng(world_size, rng)
        no_position = after_restore(self.state)
        if no_position is not None:
            warnings.warn(f"restored step {step}, but {no_position}", RuntimeWarning, stacklevel=3)
        return step

    def _load_rng(self, world_size: int, rng: Optional[Entry]) -> None:
        """Set the global RNG states saved by ``world_size`` ranks (a rank past that world size
        derives streams of its own from them)."""
        if self._rng is not None and rng is not None:
            self._rng.load_state_dict(rng.value)
            if self.rank >= world_size:  # no saved stream of its own: derive one
                self._rng.derive(rng.value, self.rank)

    def committed_steps(self) -> list[int]:
        """Steps committed in the local directory, in commit order, oldest first (read from the
        manifest). When the ranks share no directory, this rank's own commits: what restores the
        job is what the object store's manifest names (``stats()["remote_step"]``)."""
        return committed_steps(LocalStorage(self.root))

    def stats(self) -> dict:
        """Figures per committed snapshot (newest last) and of the engine as a whole.

        ``snapshots[i]`` (``stats.SnapshotFigures``): ``step``; ``blocking_s`` (what
        ``snapshot()`` cost training), ``wait_slot_s``, ``capture_s``, ``staging_s``; the writer's
        ``queue_s``, ``write_s``, ``fsync_s``, ``encode_cpu_s`` (CPU seconds of checksums and
        compression, summed over the writer's threads, spent during ``write_s``) and, for rank 0,
        ``wait_ranks_s`` and ``dropped_steps`` (retention); ``commit_s`` (durable to committed); ``to_commit_s``
        (``snapshot()`` called to committed); ``committed_at`` (Unix time, as in the manifest);
        ``committed``; ``staged_bytes``, ``shard_bytes``, ``referred_bytes`` (incremental: not
        written, referred to in an earlier snapshot), ``raw_bytes``, ``stored_bytes``,
        ``disk_free_bytes``; ``staging_gbps``, ``durable_gbps``; ``direct`` (the shard was
        written with direct I/O: with ``direct_io``, False where the file system refused it).
        Durations are seconds.

        The engine: ``in_flight`` (snapshots not yet committed); the counts ``committed``,
        ``failed``, ``skipped``, ``abandoned``, ``writer_behind``, ``consecutive_failures``
        (``stats.EngineCounts``); ``pool_slots``, ``pool_bytes`` (staging memory), ``pin_failures``
        (staging memories CUDA refused to page-lock: their device-to-host copies are synchronous);
        ``disk_free_bytes``; ``trainer_rss`` and, while open, the writer process's ``writer_pid``,
        ``writer_rss`` and ``writer_shared`` (for a monitor that samples its memory itself).

        With ``remote``: ``remote_step`` (newest step the bucket's manifest names, as far as this
        rank knows), ``upload_lag_steps`` (newest committed step minus ``remote_step``),
        ``upload_lag_s`` (seconds since the oldest snapshot not yet uploaded was committed; 0
        when caught up), ``upload_pending_bytes`` (this rank's), ``uploaded_bytes``,
        ``upload_retries`` (failed requests in a row), ``upload_skipped`` and
        ``upload_last_error`` (None, or the last failure, kept after a success).

        Restores: ``restored_from`` (the tier the last ``restore()`` read: "memory", "disk", or
        None before any restored a snapshot), ``restores`` (how many read each tier) and
        ``restore_slot_bytes`` (of the last restore from disk: the bytes taken from the staging
        slot the snapshot was written from, checked against the shard's checksums, not read:
        a restore of a snapshot the slot still holds reads no data from disk).

        With ``memory_every``: ``memory_step`` (the newest step the keeper holds, sealed, as far
        as this engine knows; None: none), ``memory_bytes`` (the memory it holds: the staging
        slot of that snapshot and of one being sealed, memory this process allocated and shares
        with it until it exits), ``memory_snapshots`` (sealed), ``memory_skipped`` (no free
        slot: each was being written to disk or held by the keeper), ``memory_superseded``
        (a newer one reached the keeper before it sealed them), ``memory_refused`` and
        ``keeper_pid`` (None once the keeper is lost)."""
        if not self._closed and self._broken is None:
            self._drain(block=False, raise_failures=False)
        return {
            "snapshots": [s.as_dict() for s in self._history],
            "in_flight": len(self._pending),
            **self._counts.as_dict(),
            "pool_slots": len(self._pool.slots),
            "pool_bytes": self._pool.nbytes,
            "pin_failures": self._pool.pin_failures,
            "disk_free_bytes": self._session.directory.free_bytes(),
            "trainer_rss": psutil.Process().memory_info().rss,
            **({} if self._closed else self._writer.rss()),
            **({} if self._remote is None else self._remote_figures()),
            "restored_from": self._restored_from,
            "restore_slot_bytes": self._restore_slot_bytes,
            "restores": dict(self._restores),
            **({} if self._memory is None else self._memory.figures()),
        }

    def _remote_figures(self) -> dict:
        status = self._remote_status
        newest = self._history[-1].step if self._history else None
        return {"remote_step": status.remote_step,
                "upload_lag_steps": None if status.remote_step is None or newest is None
                else max(0, newest - status.remote_step),
                "upload_lag_s": 0.0 if status.pending_since is None
                else time.monotonic() - status.pending_since,
                "upload_pending_bytes": status.pending_bytes,
                "uploaded_bytes": status.uploaded_bytes,
                "upload_retries": status.upload_retries,
                "upload_skipped": status.upload_skipped,
                "upload_last_error": status.last_error}

    def close(self, final_step: Optional[int] = None, *,
              timeout: Optional[float] = _REMOTE_CLOSE_TIMEOUT_S) -> None:
        """Wait for snapshots in flight, then stop the writer and free the staging memory.

        ``final_step``: the last step the loop trained; it is snapshotted (whatever ``every``
        says) and committed first unless it was the last step snapshotted, so that a finished job
        run again does not retrain its last steps. With ``remote``, also waits up to ``timeout``
        seconds (None: no limit) for the newest committed snapshot to be in the bucket; past it,
        logs what stays local (the next engine on this directory uploads it) and closes.

        With ``memory_every``, the keeper exits too when what it holds is committed (a finished
        job, ``final_step`` given); when it holds a newer step (closing after an error), it keeps
        it for the job's restart, until ``memory_idle_timeout`` or the launcher's exit."""
        if self._closed:
            return
        try:
            if self._broken is None:
                if final_step is not None and final_step != self._last_step_taken:
                    self.snapshot(final_step, force=True)
                self.wait()
                if self._remote is not None:
                    try:
                        self._wait_remote(timeout)
                    except RemoteConflictError:
                        raise
                    except RemoteStorageError as e:
                        log.error("closing without the upload: %s", e)
                if self._heartbeat is not None:
                    self._heartbeat.beat(closed=True)
        finally:
            self._closed = True
            if self._broken is None:
                self._writer.close(_CLOSE_TIMEOUT_S)
            if self._memory is not None:
                self._close_memory_tier()
            self._release()
            self._restore_signal_handlers()

    def _close_memory_tier(self) -> None:
        """Tell the keeper to exit when the newest step it holds, or was handed, is committed (or
        older than the newest committed one): it then holds nothing a restart would want. Else
        (or when that cannot be known) let go of it: it keeps the step for a restart. Logs what
        fails: closing goes on."""
        newest, quit = self._memory.newest, False
        try:
            committed = read_manifest(self._committed_source()).snapshots
            quit = self._broken is None and (newest is None or bool(committed)
                                              and newest <= committed[-1].step)
        except errors.CheckpointError as e:
            log.error("the keeper keeps step %s: the committed steps cannot be read (%s)",
                      newest, e)
        try:
            self._memory.close(quit)
        except errors.CheckpointError as e:
            log.error("closing the memory tier: %s", e)

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

    def _writer_event(self, timeout: Optional[float]) -> Optional[WriterEvent]:
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
            self._counts.failed += len(self._pending)
            self._pending.clear()
            self._drops_queued = 0
            raise

    def _acquire_slot(self, step: int, to_disk: bool, may_skip: bool) -> Optional[Slot]:
        """A free slot for the snapshot of ``step``, or None when it is skipped (counted). A
        disk snapshot waits for one unless skipping is allowed; a memory snapshot never waits
        (the keeper keeps the previous one meanwhile)."""
        if not to_disk:
            slot = self._pool.free_slot()
            if slot is None:
                self._memory.skipped += 1
            return slot
        started = self._clock()
        while True:
            slot = self._pool.free_slot()
            if slot is not None or (may_skip and self.options.when_busy == "skip"):
                break
            if self._memory is not None and self._memory.pending:
                self._memory.poll(None)  # a held slot comes free once the keeper answers
                continue
            self._handle(self._writer_event(None))
        waited = self._clock() - started
        if waited > self.options.slow_writer_s:
            self._counts.writer_behind += 1
            log.warning("the writer is falling behind: waited %.1f s for a free staging slot "
                        "(snapshot less often, add slots, or use a faster disk)", waited)
        if slot is None:
            self._counts.skipped += 1
            log.warning("skipped the snapshot of step %d: every staging slot is still being "
                        "written (%d skipped so far; add slots or snapshot less often)", step,
                        self._counts.skipped)
        return slot

    def _drain(self, block: bool, raise_failures: bool = True) -> None:
        if self._memory is not None:
            self._memory.poll()
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

    def _handle(self, event: WriterEvent) -> None:
        if isinstance(event, Released):
            self._pool.release_written(event.buffer_id)
        elif isinstance(event, Committed):
            record = self._pending.pop(event.job)
            figures = event.figures
            record.record_commit(figures)
            self._counts.record_commit()
            if self._tracker is not None:
                self._tracker.committed(event.job)
            self._history.append(record)
            log.info("committed step %d: blocked %.3f s, %.1f MB", record.step,
                     record.blocking_s, figures.stored_bytes / 1e6)
            if figures.disk_free_bytes < 2 * figures.stored_bytes:
                log.warning("the disk holding %s has %.0f MB free, less than two more snapshots "
                            "of %.0f MB", self.directory, figures.disk_free_bytes / 1e6,
                            figures.stored_bytes / 1e6)
        elif isinstance(event, Abandoned):  # another rank never wrote its part: not this rank's error
            self._pending.pop(event.job)
            self._counts.abandoned += 1
            log.warning("%s", event.message)
            self._next_snapshot_full()
        elif isinstance(event, RemoteStatus):
            before = self._remote_status
            if event.conflict is not None and before.conflict is None:
                self._failures.append(event.conflict)  # raised once, at the next call
            if event.rejections > before.rejections:
                self._failures.append(event.rejected)  # likewise, per snapshot refused
            self._remote_status = event
        elif isinstance(event, Dropped):  # the answer to a drop(wait=False)
            self._drops_queued -= 1
            if event.error is not None:
                self._failures.append(event.error)
        elif isinstance(event, Failed):
            self._pending.pop(event.job)
            self._counts.record_failure()
            self._failures.append(event.error)  # the writer's error object, of its own class
            self._next_snapshot_full()  # what it held is gone; it may have failed on a reference

    def _next_snapshot_full(self) -> None:
        """Incremental snapshots: forget which snapshot holds which bytes."""
        if self._tracker is not None:
            self._tracker.reset()



def _release_resources(pool: StagingPool, writer: WriterClient, session: Session,
                       fences: list, release_verify_threads: Callable[[], None],
                       memory: Optional[MemoryTier]) -> None:
    for handle in fences:
        handle.remove()
    if memory is not None:
        memory.close(quit=False)
    pool.close()
    writer.conn.close()
    session.close()
    release_verify_threads()


def _install_fences(engine: CheckpointEngine) -> list:
    """Hooks that call ``engine.fence()`` before anything the engine can see changes staged
    tensors: every optimizer's ``step()`` (torch's global pre-hook: also optimizers that were
    not registered), and ``load_state_dict`` of the registered modules and optimizers. They
    hold the engine weakly; the handles are removed when it closes."""
    ref = weakref.ref(engine)

    def fence(*_args, **_kwargs) -> None:
        live = ref()
        if live is not None and not live._closed and live._broken is None:
            live.fence()

    handles = [register_optimizer_step_pre_hook(fence)]
    for obj in registered_objects(engine.state, (torch.nn.Module, torch.optim.Optimizer)):
        handles.append(obj.register_load_state_dict_pre_hook(fence))
    return handles
