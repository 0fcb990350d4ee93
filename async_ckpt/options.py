"""The engine's settings: every ``CheckpointEngine`` keyword argument, its default, what it means,
and its validation, in one place.

``CheckpointEngine(directory, state, **options)`` builds ``EngineOptions(**options)``, so an
invalid or unknown setting is refused before the engine touches the directory.
"""

from __future__ import annotations

import dataclasses
import inspect
import signal
import threading
from typing import Any, Callable, Iterable, MutableMapping, Optional, Union

from .distributed import resolve_ranks
from .errors import DistributedSetupError
from .format.names import RNG_KEY
from .storage.remote import check_remote_url

DEFAULT_PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The settings of a ``CheckpointEngine`` (all keyword arguments of the engine).

    Settings given as None or True that stand for a choice made at construction hold that choice
    afterwards: ``rank`` and ``world_size`` are ints, ``writer_nice`` an int, ``replicated`` a
    frozenset, ``preemption`` the tuple of signals handled (empty: none).

    Attributes:
        mode: "async" (``snapshot`` returns once the state is staged in CPU memory) or "sync"
            (returns once the snapshot is committed: the periodic blocking baseline).
        staging: "eager" (``snapshot`` returns once the tensors are copied into the staging
            slot) or "lazy" (it returns once the copy has started; the copy runs while training
            goes on, and the engine waits for it before anything may change the staged tensors:
            every optimizer's ``step()``, a registered module's or optimizer's
            ``load_state_dict``, the next ``snapshot()``, ``wait()``, ``restore()``, ``close()``,
            and ``fence()``, which code changing the state in place by other means calls first).
            A change the fences missed fails that snapshot (``StagingRaceError``), never commits
            a torn one. Async mode only; in sync mode staging is eager.
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
        incremental: storages unchanged since a committed snapshot stored them (frozen weights,
            a base model under adapters) are neither staged nor written again: the new
            snapshot refers to the stored bytes (see ``train/incremental.py`` for what counts as
            a change, and what cannot be seen). One rank only (``DistributedSetupError``
            otherwise). Retention keeps a referenced snapshot until nothing kept refers to it.
        full_every: with ``incremental``, every ``full_every``-th snapshot is written whole (1:
            all of them), which bounds how many snapshots a change invisible to torch's version
            counters (a write through a NumPy view) can miss, and how long old snapshots stay
            referenced.
    """

    mode: str = "async"
    staging: str = "eager"
    every: int = 1
    keep_last: int = 3
    keep_every: Optional[int] = None
    slots: int = 2
    when_busy: str = "wait"
    compression: Optional[str] = None
    level: int = 1
    allow_pickle: bool = False
    rng: bool = True
    rank: Optional[int] = None
    world_size: Optional[int] = None
    replicated: Union[str, Iterable[str]] = frozenset()
    spread_replicated: bool = False
    commit_timeout: float = 120.0
    writer_nice: Optional[int] = None
    writer_low_io: bool = True
    reserve_bytes: int = 0
    lock_timeout: float = 60.0
    preemption: Union[bool, Iterable[int]] = False
    heartbeat_interval: Optional[float] = 10.0
    slow_writer_s: float = 30.0
    incremental: bool = False
    full_every: int = 10
    remote: Optional[str] = None
    remote_options: Optional[dict] = None
    remote_keep_last: Optional[int] = None

    def __post_init__(self) -> None:
        _require(self.mode in ("async", "sync"),
                 f"mode must be 'async' or 'sync', not {self.mode!r}")
        _require(self.staging in ("eager", "lazy"),
                 f"staging must be 'eager' or 'lazy', not {self.staging!r}")
        _require(self.when_busy in ("wait", "skip"),
                 f"when_busy must be 'wait' or 'skip', not {self.when_busy!r}")
        _require(self.compression in (None, "zstd"),
                 f"compression must be None or 'zstd', not {self.compression!r}")
        _require(isinstance(self.every, int) and self.every >= 1, "every must be an int >= 1")
        _require(isinstance(self.keep_last, int) and self.keep_last >= 1,
                 "keep_last must be an int >= 1")
        _require(self.keep_every is None
                 or (isinstance(self.keep_every, int) and self.keep_every >= 1),
                 "keep_every must be None or an int >= 1")
        rank, world_size = resolve_ranks(self.rank, self.world_size)
        _require(0 <= rank < world_size, "rank must be in [0, world_size)")
        _require(self.commit_timeout > 0, "commit_timeout must be positive")
        _require(world_size == 1 or self.when_busy == "wait", "when_busy='skip' needs one rank: "
                 "ranks would skip different steps, which then never commit; use when_busy='wait'")
        _require(isinstance(self.incremental, bool), "incremental must be True or False")
        _require(isinstance(self.full_every, int) and self.full_every >= 1,
                 "full_every must be an int >= 1")
        if self.incremental and world_size > 1:
            raise DistributedSetupError(
                f"incremental=True works with one rank; this job has {world_size}. Per-rank "
                "references would need every rank to agree on the checksums of replicated state "
                "it did not stage; create the engine with incremental=False")
        _require(self.remote_keep_last is None
                 or (isinstance(self.remote_keep_last, int) and self.remote_keep_last >= 1),
                 "remote_keep_last must be None or an int >= 1")
        _require(self.remote_options is None or isinstance(self.remote_options, dict),
                 "remote_options must be a dict of the object store's settings")
        if self.remote is not None:
            check_remote_url(self.remote)
        preemption = self.preemption
        signals = (() if preemption is False or preemption is None else
                   DEFAULT_PREEMPTION_SIGNALS if preemption is True else tuple(preemption))
        if signals and threading.current_thread() is not threading.main_thread():
            raise ValueError("preemption handlers can only be installed from the main thread; "
                             "create the engine there or pass preemption=False")
        replicated = self.replicated
        resolved = {
            "rank": rank, "world_size": world_size, "preemption": signals,
            "replicated": frozenset([replicated] if isinstance(replicated, str) else replicated),
            "remote_keep_last": self.remote_keep_last or self.keep_last,
            "writer_nice": self.writer_nice if self.writer_nice is not None else
            (10 if self.mode == "async" else 0)}
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def check_state(self, state: Any) -> None:
        """Refuse a ``state`` these options cannot snapshot: not a dict, holding the engine's own
        RNG entry, or missing an entry declared ``replicated``."""
        if not isinstance(state, MutableMapping):
            raise TypeError("state must be a dict of name -> stateful object, tensor or dict")
        _require(RNG_KEY not in state, f"{RNG_KEY!r} is reserved for the engine's RNG entry")
        _require(self.replicated <= state.keys(), "replicated names entries that are not in "
                 f"state: {sorted(self.replicated - state.keys())}")

    def shared_settings(self) -> dict:
        """The settings every rank's engine must be created with alike (checked at start-up): the
        ranks of one job write and commit the same snapshots."""
        return {"every": self.every, "keep_last": self.keep_last, "keep_every": self.keep_every,
                "replicated": sorted(self.replicated), "spread_replicated": self.spread_replicated,
                "rng": self.rng, "mode": self.mode, "remote": self.remote,
                "remote_keep_last": self.remote_keep_last}



def options_signature(function: Callable) -> inspect.Signature:
    """``function``'s signature with its ``**options`` replaced by every EngineOptions field as a
    keyword-only parameter with its default."""
    signature = inspect.signature(function)
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                annotation=f.type) for f in dataclasses.fields(EngineOptions)]
    kept = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    return signature.replace(parameters=kept + fields)

def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
