"""Every system the benchmarks run, by name, and each part's selection of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import dcp, tsnap
from .systems import Engine, NoCheckpoint, System, TorchSave


@dataclass(frozen=True)
class SystemSpec:
    """``open(state, directory)`` builds it (ours take more engine options by keyword); ``ours``:
    async_ckpt, not a peer."""

    name: str
    open: Callable[..., System]
    ours: bool


def _engine(name: str, mode: str = "async", compression: Optional[str] = None,
           **options) -> SystemSpec:
    return SystemSpec(name, lambda state, d, **more: Engine(state, d, name, mode, compression,
                                                            **options, **more), ours=True)


def _dcp(name: str, **options) -> SystemSpec:
    return SystemSpec(name, lambda state, d: dcp.open_system(name, state, d, **options),
                      ours=False)


REPLICATED = ("model", "optimizer")
"""What every rank holds alike in the two-rank state, as DDP keeps it."""

NONE = SystemSpec(NoCheckpoint.name, NoCheckpoint, ours=False)
TORCH_SAVE = SystemSpec(TorchSave.name, TorchSave, ours=False)
OURS_SYNC = _engine("async_ckpt sync", "sync")
OURS_ASYNC = _engine("async_ckpt async")
OURS_ASYNC_ZSTD = _engine("async_ckpt async zstd", compression="zstd")
OURS_LAZY = _engine("async_ckpt async, lazy staging", staging="lazy")
OURS_INCREMENTAL = _engine("async_ckpt async, incremental", incremental=True)
OURS_DIRECT = _engine("async_ckpt async, direct writes", direct_io=True)
OURS_REMOTE = _engine("async_ckpt async, remote tier", rng=False)
"""Opened with ``remote=URL`` (``bench/remote.py``)."""
OURS_LAZY_NICED = _engine("async_ckpt async, lazy, niced copy thread", staging="lazy", copy_nice=10)
OURS_LAZY_FEWER = _engine("async_ckpt async, lazy, one torch thread fewer", staging="lazy",
                          fewer_threads=True)
NEVER = 10 ** 9  # an ``every`` no loop reaches: the disk gets the first snapshot only
OURS_MEMORY = {staging: _engine(f"async_ckpt memory tier, {staging} staging", staging=staging,
                                every=NEVER, memory_every=1, slots=3, heartbeat_interval=None)
               for staging in ("eager", "lazy")}
"""The memory tier (``bench/memory_tier.py``): a memory snapshot at every step."""
OURS_REPLICATED = _engine("async_ckpt async, replicated written by rank 0", replicated=REPLICATED)
OURS_REPLICATED_SPREAD = _engine("async_ckpt async, replicated spread over ranks",
                                replicated=REPLICATED, spread_replicated=True)
DCP_SAVE = _dcp("DCP save")
DCP_DEFAULT = _dcp("DCP async_save (default stager)", executor="thread", stager="default")
DCP_CACHED = _dcp("DCP async_save (cached shm stager)", executor="thread", stager="cached")
DCP_PROCESS = _dcp("DCP async_save (cached shm stager, process executor)", executor="process",
                   stager="cached")
DCP_PINNED = _dcp("DCP async_save (cached pinned stager)", executor="thread", stager="pinned")
TORCHSNAPSHOT = SystemSpec(tsnap.TorchSnapshotAsync.name, tsnap.TorchSnapshotAsync, ours=False)

SYSTEMS: tuple[SystemSpec, ...] = (TORCH_SAVE, OURS_SYNC, OURS_ASYNC, OURS_DIRECT,
                                   OURS_ASYNC_ZSTD, DCP_SAVE, DCP_DEFAULT, DCP_CACHED, DCP_PROCESS,
                                   TORCHSNAPSHOT)
"""The sweep's and the training loop's, in report order."""

SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)
BIG_SYSTEMS = tuple(s.name for s in (TORCH_SAVE, OURS_SYNC, OURS_ASYNC, OURS_DIRECT,
                                      OURS_ASYNC_ZSTD, DCP_SAVE, DCP_CACHED))
STALL_SYSTEMS = (OURS_ASYNC, OURS_DIRECT, OURS_ASYNC_ZSTD, OURS_SYNC, TORCH_SAVE)
RANK_SYSTEMS = (OURS_REPLICATED, OURS_REPLICATED_SPREAD, DCP_DEFAULT, DCP_CACHED)
SHARDED_SYSTEMS = (OURS_ASYNC, DCP_DEFAULT, DCP_CACHED)
LAZY_SYSTEMS = (OURS_ASYNC, OURS_LAZY, OURS_LAZY_NICED, OURS_LAZY_FEWER, DCP_CACHED)
GPU_SYSTEMS = (OURS_ASYNC, OURS_LAZY, DCP_DEFAULT, DCP_PINNED, TORCH_SAVE)


def by_name(name: str) -> SystemSpec:
    return next(s for s in SYSTEMS + (NONE,) if s.name == name)
