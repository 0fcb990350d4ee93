"""The engine's settings: every ``CheckpointEngine`` keyword argument, its default, what it means,
and its validation, in one place.

Each setting is declared once, as a field of ``EngineOptions`` (``_setting``), grouped by concern
as Orbax groups its options (schedule, staging, writing, retention, distributed, remote, memory
tier, session): its default, its rule, whether every rank must be given the same value, and
whether (and under which name) it crosses to the writer process. ``CheckpointEngine``'s
keyword-only parameters are these fields, with these defaults, written out so that ``help()``,
IDEs and type checkers show them (tests/test_options.py keeps the two one for one). The engine
builds an ``EngineOptions`` from them first, which checks every setting before the engine touches
the directory: a bad value is an ``InvalidArgumentError`` (a ValueError).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import signal
import threading
from typing import Any, Callable, Collection, Literal, MutableMapping, Optional, Union

from .checks import is_int, is_number, short_repr
from .distributed import resolve_ranks
from .errors import DistributedSetupError, InvalidArgumentError
from .storage.names import MAX_WORLD_SIZE
from .format.shard import COMPRESSIONS, ZSTD_LEVELS
from .format.tree import RNG_KEY
from .format.values import Picklable
from .storage.remote import check_remote_url

DEFAULT_PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_CATCHABLE = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


def _one_of(*allowed) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in allowed), " or ".join(map(repr, allowed))


def _int(lo: int, hi: Optional[int] = None,
         optional: bool = False) -> tuple[Callable[[Any], bool], str]:
    bounds = f">= {lo}" if hi is None else f"from {lo} to {hi}"
    return ((lambda v: (optional and v is None) or is_int(v, lo, hi)),
            f"{'None or ' * optional}an int {bounds}")


def _seconds(zero: bool = False, optional: bool = False) -> tuple[Callable[[Any], bool], str]:
    return ((lambda v: (optional and v is None) or (is_number(v) and (v >= 0 if zero else v > 0))),
            f"{'None or ' * optional}a number of seconds {'>= 0' if zero else '> 0'}")


def _names(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, _COLLECTIONS) and all(type(n) is str for n in v))


def _picklable(v: Any) -> bool:
    if type(v) is bool:
        return True
    try:
        return isinstance(v, _COLLECTIONS) and Picklable.of(v) is not None
    except InvalidArgumentError:
        return False


def _signals(v: Any) -> bool:
    return v is None or type(v) is bool or (isinstance(v, _COLLECTIONS) and all(
        not isinstance(s, bool) and s in _CATCHABLE for s in v))


_COLLECTIONS = (list, tuple, set, frozenset)
_BOOL = (lambda v: type(v) is bool, "True or False")


def _setting(default: Any, rule: tuple[Callable[[Any], bool], str], *, shared: bool = False,
             writer: Union[bool, str] = False) -> Any:
    """The declaration of one setting: its default; ``rule``, (what every value must pass, what
    the error says it must be); ``shared``: every rank must be given the same value
    (``EngineOptions.shared_settings``); ``writer``: it crosses to the writer process, under its
    own name or the one given (``EngineOptions.writer_settings``). Settings given as None or
    True cross as ``Resolved`` resolves them."""
    return dataclasses.field(default=default, metadata={
        "rule": rule, "shared": shared, "writer": writer})


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What the settings given as None or True stand for, fixed when the options are built."""

    rank: int
    world_size: int
    replicated: frozenset[str]
    preemption: tuple[int, ...]  # the signals handled; empty: none
    writer_nice: int
    remote_keep_last: int


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The settings of a ``CheckpointEngine`` (all keyword arguments of the engine), as given;
    ``resolved`` holds what those given as None or True stand for (``rank`` and ``world_size``
    from ``torch.distributed``, the signals of ``preemption=True``, ...).

    Schedule (when a snapshot is taken; what ``snapshot`` waits for):
        mode: "async" (``snapshot`` returns once the state is staged in CPU memory) or "sync"
            (returns once the snapshot is committed: the periodic blocking baseline).
        every: ``snapshot(step)`` does nothing unless ``step % every == 0`` (or ``force=True``)
            or the memory tier takes it (``memory_every``).
        preemption: True (SIGTERM and SIGUSR1) or a list of signals to handle as a preemption
            notice: the handler only sets a flag; the next ``snapshot()`` call takes a snapshot
            whatever ``every`` says, waits for its commit and raises ``Preempted`` (a SystemExit
            with code 75). Installed from the main thread only; the old handlers come back at
            ``close()``.
    Staging (the copy into CPU memory):
        staging: "eager" (``snapshot`` returns once the tensors are copied into the staging
            slot) or "lazy" (it returns once the copy has started; the copy runs while training
            goes on, and the engine waits for it before anything may change the staged tensors:
            every optimizer's ``step()``, a registered module's or optimizer's
            ``load_state_dict``, the next ``snapshot()``, ``wait()``, ``restore()``, ``close()``,
            and ``fence()``, which code changing the state in place by other means calls first).
            A change the fences missed fails that snapshot (``StagingRaceError``), never commits
            a torn one. Async mode only; in sync mode staging is eager.
        copy_nice: niceness added to the thread that copies CPU tensors into a staging slot
            while training goes on (lazy staging); 0 unless measurements show training runs
            faster with the copy yielding the CPU (bench/lazy.py measures 10).
        slots: staging buffers, each the size of the state; more slots absorb slower disks.
        when_busy: "wait" for a slot when all are being written, or "skip" the step (counted and
            logged; one rank only).
        slow_writer_s: a snapshot that waits this long for a free slot is logged and counted as
            the writer falling behind (``stats()["writer_behind"]``).
        rng: save the global RNG states (Python, NumPy, torch CPU, CUDA) with every snapshot and
            restore them with it, so a resumed run draws the same random numbers.
        allow_pickle: allow values with no safe encoding to be pickled when saving, and pickled
            values to be loaded. Off by default: loading then never runs code from the file.
            True pickles any such value; a collection of classes (and torch dtypes) pickles only
            their instances, refusing at the save a value whose pickle names anything else, and
            loads a pickle only when every name in it is one of them (docs/FORMAT.md 6).
    Writing (the writer process and what it writes):
        compression: None (store raw) or "zstd" (sign/exponent byte planes of floats, all of other
            data); ``level`` is the zstd level.
        incremental: storages unchanged since a committed snapshot stored them (frozen weights,
            a base model under adapters) are neither staged nor written again: the new
            snapshot refers to the stored bytes (see ``train/incremental.py`` for what counts as
            a change, and what cannot be seen). One rank only (``DistributedSetupError``
            otherwise). Retention keeps a referenced snapshot until nothing kept refers to it.
        full_every: with ``incremental``, every ``full_every``-th snapshot is written whole (1:
            all of them), which bounds how many snapshots a change invisible to torch's version
            counters (a write through a NumPy view) can miss, and how long old snapshots stay
            referenced.
        commit_timeout: rank 0's writer gives a snapshot up (it is never committed) when no rank
            has written any of it for this many seconds while some rank's shard is missing.
        writer_nice: niceness added to the writer process (default: 10 in async mode, so training
            keeps the CPU; 0 in sync mode, where training waits for the writer anyway);
            ``writer_low_io`` lowers its I/O priority.
        reserve_bytes: refuse to start a snapshot that would leave less free disk than this.
        direct_io: the writer writes shards with direct I/O (``O_DIRECT``) where the file
            system allows it: from the staging slot's memory straight to the disk, several writes
            in flight, with almost no CPU and nothing left in the page cache; where the file
            system refuses it (logged once), through the page cache. On by default: through the
            page cache the writer needs the CPU that training keeps busy and falls far behind the
            disk (docs/performance.md). A restore in the same process reads what the staging slot
            still holds of an uncompressed snapshot either way; a restarted process's restore
            reads the disk, where ``direct_io=False`` would leave the newest shards in the page
            cache while memory allows.
    Retention:
        keep_last: committed snapshots kept (newest by commit order); at least 1.
        keep_every: also keep every snapshot whose step is a multiple of this.
    Distributed:
        rank, world_size: this process's shard of a snapshot (one file per rank); by default those
            of the initialised ``torch.distributed`` process group (else 0 and 1); at most
            ``MAX_WORLD_SIZE`` (100,000) ranks, checked here rather than at commit. With several
            ranks, create the engine, and call ``restore()`` and ``snapshot()``, on every rank.
        replicated: names of top-level entries that every rank holds identically (a DDP model and
            its optimizer): written once instead of once per rank, and checked (by checksum) to
            really be identical before a snapshot is committed.
        spread_replicated: share the writing of replicated tensors among the ranks (balanced by
            bytes) instead of leaving it all to rank 0.
    Remote:
        remote, remote_options, remote_keep_last: upload committed snapshots in the background
            to ``s3://bucket/prefix`` (README "Remote storage"), with the store's settings
            (None: the AWS environment), keeping ``remote_keep_last`` there (None: ``keep_last``).
    Memory tier:
        memory_every: the memory tier (docs/memory_tier.md): also take a snapshot every
            ``memory_every`` steps that is only kept in memory, by a keeper process that outlives
            this one, so that a trainer killed at step N resumes from N (``restore()`` takes it
            when it is newer than the newest committed snapshot, and verified). It is staged as a
            disk snapshot is, into a staging slot that the keeper then holds until it holds a
            newer one: with ``slots=2`` memory snapshots are skipped while a disk snapshot is
            being written (``stats()["memory_skipped"]``), with 3 they are not. Only the
            registered state (not ``snapshot(state=...)``), one rank, and not ``incremental``.
            None: off. It protects against a process dying, not against the machine losing its
            memory: that is what the disk is for.
        memory_idle_timeout: seconds the keeper keeps a snapshot with no trainer attached before
            it exits (it exits at once when the job's launcher, the trainer's parent, has exited,
            and when ``close()`` has committed what it held).
    Session (this engine's hold on the directory):
        lock_timeout: seconds to wait for a previous writer on the same directory to finish.
        heartbeat_interval: seconds between heartbeat files written from ``snapshot()`` calls,
            and while the engine waits for its writer (``wait()``, ``close()``, a busy slot)
            (``DIR/heartbeat.rankNNNNN.json``); None turns them off.
    """

    # --- schedule: when a snapshot is taken, and what snapshot() waits for ---------------------
    mode: Literal["async", "sync"] = _setting("async", _one_of("async", "sync"), shared=True)
    every: int = _setting(1, _int(1), shared=True)
    preemption: Union[bool, None, Collection[int]] = _setting(False, (
        _signals, "True, False or a list of signals that can be caught (not SIGKILL or SIGSTOP)"))
    # --- staging: the copy into CPU memory that snapshot() waits for --------------------------
    staging: Literal["eager", "lazy"] = _setting("eager", _one_of("eager", "lazy"))
    copy_nice: int = _setting(0, _int(0, 19))
    slots: int = _setting(2, _int(1))
    when_busy: Literal["wait", "skip"] = _setting("wait", _one_of("wait", "skip"))
    slow_writer_s: float = _setting(30.0, _seconds(zero=True))
    rng: bool = _setting(True, _BOOL, shared=True)
    allow_pickle: Union[bool, Collection[Any]] = _setting(False, (
        _picklable, "True, False or a collection of classes (and torch dtypes)"))
    # --- writing: the writer process and what it writes ---------------------------------------
    compression: Optional[Literal["zstd"]] = _setting(None, _one_of(*COMPRESSIONS), writer=True)
    level: int = _setting(1, _int(ZSTD_LEVELS[0], ZSTD_LEVELS[-1]), writer=True)
    incremental: bool = _setting(False, _BOOL)
    full_every: int = _setting(10, _int(1))
    commit_timeout: float = _setting(120.0, _seconds(), writer=True)
    writer_nice: Optional[int] = _setting(None, _int(0, 19, optional=True), writer="nice")
    writer_low_io: bool = _setting(True, _BOOL, writer="low_io_priority")
    reserve_bytes: int = _setting(0, _int(0), writer=True)
    direct_io: bool = _setting(True, _BOOL, writer=True)
    # --- retention: which committed snapshots are kept ----------------------------------------
    keep_last: int = _setting(3, _int(1), shared=True, writer=True)
    keep_every: Optional[int] = _setting(None, _int(1, optional=True), shared=True, writer=True)
    # --- distributed: the ranks of one job ----------------------------------------------------
    rank: Optional[int] = _setting(None, _int(0, optional=True), writer=True)
    world_size: Optional[int] = _setting(None, _int(1, optional=True), writer=True)
    replicated: Union[str, Collection[str]] = _setting(
        frozenset(), (_names, "an entry name or a list of them"), shared=True)
    spread_replicated: bool = _setting(False, _BOOL, shared=True, writer=True)
    # --- remote: the object store snapshots are uploaded to -----------------------------------
    remote: Optional[str] = _setting(None, (lambda v: v is None or isinstance(v, str),
                                            "None or an s3://bucket/prefix URL"),
                                     shared=True, writer=True)
    remote_options: Optional[dict] = _setting(
        None, (lambda v: v is None or isinstance(v, dict),
               "None or a dict of the object store's settings"), writer=True)
    remote_keep_last: Optional[int] = _setting(None, _int(1, optional=True), shared=True,
                                               writer=True)
    # --- memory tier: snapshots kept only in memory, by a keeper process ----------------------
    memory_every: Optional[int] = _setting(None, _int(1, optional=True), shared=True)
    memory_idle_timeout: float = _setting(600.0, (lambda v: is_number(v) and 0 < v < math.inf,
                                                  "a finite number of seconds > 0"))
    # --- session: this engine's hold on the directory -----------------------------------------
    lock_timeout: float = _setting(60.0, _seconds(zero=True))
    heartbeat_interval: Optional[float] = _setting(10.0, _seconds(zero=True, optional=True))

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            (ok, expected), value = field.metadata["rule"], getattr(self, field.name)
            name = field.name
            _require(ok(value), f"{name} must be {expected}, not {short_repr(value)}")
        resolved = self.resolved  # computed once, here, and kept
        _require(resolved.rank < resolved.world_size, "rank must be in [0, world_size)")
        _require(resolved.world_size <= MAX_WORLD_SIZE,
                 f"world_size is {resolved.world_size}; async_ckpt checkpoints at most "
                 f"MAX_WORLD_SIZE = {MAX_WORLD_SIZE} ranks (file names carry the rank in 5 "
                 "digits, docs/FORMAT.md section 1)")
        _require(resolved.world_size == 1 or self.when_busy == "wait",
                 "when_busy='skip' needs one rank: ranks would skip different steps, which then "
                 "never commit; use when_busy='wait'")
        if self.memory_every is not None:
            _require(not self.incremental, "memory_every and incremental=True do not go together "
                     "yet: a memory snapshot must hold every byte of the state")
            _require(self.slots >= 2, "memory_every needs slots >= 2: the keeper holds one slot "
                     "while the next snapshot is staged into another")
            _require(resolved.world_size == 1 or self.slots >= 3,
                     "memory_every with several ranks needs slots >= 3 (4 for no memory snapshot "
                     "to be skipped while a disk snapshot is written): each rank's keeper holds "
                     "two slots, so that the ranks can agree on the older step when one died "
                     "while staging the newer")
        if self.incremental and resolved.world_size > 1:
            raise DistributedSetupError(
                f"incremental=True works with one rank; this job has {resolved.world_size}. "
                "Per-rank references would need every rank to agree on the checksums of "
                "replicated state it did not stage; create the engine with incremental=False")
        if resolved.preemption and threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError(
                "preemption handlers can only be installed from the main thread; create the "
                "engine there or pass preemption=False")
        if self.remote is not None:
            check_remote_url(self.remote)

    @functools.cached_property  # computed once, by __post_init__; not a field
    def resolved(self) -> Resolved:
        """What the settings given as None or True stand for."""
        rank, world_size = resolve_ranks(self.rank, self.world_size)
        signals = (() if self.preemption is False or self.preemption is None else
                   DEFAULT_PREEMPTION_SIGNALS if self.preemption is True
                   else tuple(self.preemption))
        return Resolved(
            rank, world_size,
            frozenset([self.replicated] if isinstance(self.replicated, str) else self.replicated),
            signals,
            writer_nice=(self.writer_nice if self.writer_nice is not None
                         else 10 if self.mode == "async" else 0),
            remote_keep_last=self.remote_keep_last or self.keep_last)

    def check_state(self, state: Any) -> None:
        """Refuse a ``state`` these options cannot snapshot: not a dict, holding the engine's own
        RNG entry, or missing an entry declared ``replicated``."""
        if not isinstance(state, MutableMapping):
            raise TypeError("state must be a dict of name -> stateful object, tensor or dict")
        _require(RNG_KEY not in state, f"{RNG_KEY!r} is reserved for the engine's RNG entry")
        replicated = self.resolved.replicated
        _require(replicated <= state.keys(), "replicated names entries that are not in "
                 f"state: {sorted(replicated - state.keys())}")

    def shared_settings(self) -> dict:
        """The settings every rank's engine must be created with alike (checked at start-up): the
        ranks of one job write and commit the same snapshots."""
        return {f.name: self._crossing(f.name) for f in dataclasses.fields(self)
                if f.metadata["shared"]}

    def writer_settings(self) -> dict:
        """The ``WriterConfig`` fields these options set (the session sets the others): the
        writer's names for the settings declared ``writer``, as resolved."""
        return {(f.name if f.metadata["writer"] is True else f.metadata["writer"]):
                self._crossing(f.name) for f in dataclasses.fields(self) if f.metadata["writer"]}

    def _crossing(self, name: str) -> Any:
        """The value of setting ``name`` as it crosses to another process: as resolved, a set of
        names sorted."""
        value = getattr(self.resolved if hasattr(self.resolved, name) else self, name)
        return sorted(value) if isinstance(value, frozenset) else value


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgumentError(message)
