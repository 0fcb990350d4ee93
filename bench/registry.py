"""Every checkpointing system the benchmarks run, by name: the one registry.

A ``SystemSpec`` names a system and opens it (``systems.System``'s interface; the
implementations are ``systems.py`` for async_ckpt and torch.save, ``dcp.py`` and ``tsnap.py``
for the peers). Each part of ``python -m bench`` runs a selection of these specs: ``SYSTEMS``
(the sweep and the training loop), ``BIG_SYSTEMS`` (the sweep's biggest states),
``STALL_SYSTEMS`` (the ``--stall`` preset), ``RANK_SYSTEMS`` (two ranks, replicated state),
``SHARDED_SYSTEMS`` (FSDP2 state),
``LAZY_SYSTEMS`` (``bench/lazy.py``) and ``GPU_SYSTEMS`` (``python -m bench --device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import dcp, tsnap
from .systems import Engine, NoCheckpoint, System, TorchSave


@dataclass(frozen=True)
class SystemSpec:
    """A system by name: ``open(state, directory)`` builds it (or raises ``Unavailable``; the
    engine's take more engine options by keyword, such as a run's ``remote`` URL); ``ours``
    marks async_ckpt (the others are the peers its figures are compared with)."""

    name: str
    open: Callable[..., System]
    ours: bool


def _engine(name: str, mode: str = "async", compression: Optional[str] = None,
           **options) -> SystemSpec:
    """async_ckpt under ``name``, with these engine options."""
    return SystemSpec(name, lambda state, d, **more: Engine(state, d, name, mode, compression,
                                                            **options, **more), ours=True)


def _dcp(name: str, **options) -> SystemSpec:
    return SystemSpec(name, lambda state, d: dcp.open_system(name, state, d, **options),
                      ours=False)


REPLICATED = ("model", "optimizer")
"""The entries of the two-rank state every rank holds alike, as DDP keeps them."""

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

SYSTEMS: tuple[SystemSpec, ...] = (TORCH_SAVE, OURS_SYNC, OURS_ASYNC, OURS_ASYNC_ZSTD, DCP_SAVE,
                                   DCP_DEFAULT, DCP_CACHED, DCP_PROCESS, TORCHSNAPSHOT)
"""Every checkpointing system of the sweep and the training loop, in report order."""

SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)
BIG_SYSTEMS = tuple(s.name for s in (TORCH_SAVE, OURS_SYNC, OURS_ASYNC, OURS_ASYNC_ZSTD, DCP_SAVE,
                                      DCP_CACHED))
"""The systems the sweep runs at its biggest states: the periodic save, ours, DCP's blocking save
and its best asynchronous variant (``bench/sweep.py``)."""
STALL_SYSTEMS = (OURS_ASYNC, OURS_ASYNC_ZSTD, OURS_SYNC, TORCH_SAVE)
"""The ``--stall`` preset: how long the engine's modes stop training, against torch.save."""
RANK_SYSTEMS = (OURS_REPLICATED, OURS_REPLICATED_SPREAD, DCP_DEFAULT, DCP_CACHED)
"""Two ranks under torchrun, replicated state (``bench/ranks.py``)."""
SHARDED_SYSTEMS = (OURS_ASYNC, DCP_DEFAULT, DCP_CACHED)
"""Sharded (FSDP2) state under torchrun (``bench/sharded.py``)."""
LAZY_SYSTEMS = (OURS_ASYNC, OURS_LAZY, OURS_LAZY_NICED, OURS_LAZY_FEWER, DCP_CACHED)
"""Lazy staging in the training loop (``bench/lazy.py``): its variants against eager staging."""
GPU_SYSTEMS = (OURS_ASYNC, OURS_LAZY, DCP_DEFAULT, DCP_PINNED, TORCH_SAVE)
"""The GPU benchmark's systems (``bench/gpu.py``): eager and lazy staging against DCP's default
and pinned-memory stagers and the periodic blocking save."""


def by_name(name: str) -> SystemSpec:
    return next(s for s in SYSTEMS + (NONE,) if s.name == name)
