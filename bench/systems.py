"""The systems under test behind one interface (``System``), so every benchmark drives them alike:
async_ckpt's engine, ``torch.save``, PyTorch DCP's ``dcp.save`` and ``dcp.async_save`` with each
stager as its users run them, torchsnapshot; and the registry of them by name, with each part's
selection (variants: docs/performance.md, "What runs")."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .harness import dir_bytes, evict, fsync_dir, fsync_tree, log, remove, timed
from .workloads import restore_quietly

KEEP_LAST = 3  # as the engine's default keep_last: alike disk use and page-cache pressure


class Unavailable(Exception):
    """Raised by a constructor: the system cannot run here; reported as "n/a (message)"."""


class System:
    """Opened on ``{"model", "optimizer"}`` and a directory of its own; keeps the peers' timestamps
    and retention. Asynchronous subclasses override ``wait()`` and call ``_durable``."""

    name = "?"

    def __init__(self, state: dict, directory: str):
        self.state, self.directory = state, directory
        os.makedirs(directory, exist_ok=True)
        self._called_at: dict[int, float] = {}
        self._durable_at: dict[int, float] = {}
        self._kept: list[tuple[int, str]] = []  # durable snapshots, oldest first
        self._newest_saved: Optional[int] = None

    # --- the interface -------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Its wall time is the blocking time: a save that must wait for an earlier one waits here,
        as a training loop would."""
        self._called_at[step] = time.perf_counter()
        self._newest_saved = step
        self._save(step, self._path(step))

    def fence(self) -> None:
        """Returns once the state may change again: called before the optimizer's step."""

    def wait(self) -> None:
        """Returns once every save is durable (a no-op here: durable when ``save`` returns)."""

    def to_commit_s(self) -> float:
        step = self._newest_saved
        return self._durable_at[step] - self._called_at[step]

    def stored_bytes(self) -> int:
        return dir_bytes(self.newest_path())

    def restore(self) -> Optional[int]:
        """The newest durable snapshot into the live objects, as the system's users resume."""
        raise NotImplementedError

    def restart(self) -> None:
        """Forget what this process holds of its snapshots beyond their files, as a restarted
        process has nothing else: the next restore reads the files (a no-op for a system whose
        restore always reads them)."""

    def newest_path(self) -> str:
        """The file or directory of the newest durable snapshot."""
        return self._kept[-1][1]

    def saved(self, step: int) -> float:
        """``save`` and ``wait``, so that no other write overlaps: the time to commit."""
        self.save(step)
        self.wait()
        return self.to_commit_s()

    def cold_restore_s(self, evicted: str) -> float:
        """Seconds of a restore as a restarted process does it: ``evicted``'s pages dropped from
        the page cache, the system opened again."""
        evict(evicted)
        self.restart()
        return timed(self.restore)

    def writer_pids(self) -> list[int]:
        """Processes other than the trainer that hold this system's memory."""
        return []

    def details(self) -> dict:
        """System-specific figures of the newest snapshot, kept in results.json."""
        return {}

    def close(self) -> None:
        self.wait()

    # --- for subclasses --------------------------------------------------------------------------

    def _save(self, step: int, path: str) -> None:
        raise NotImplementedError

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:08d}")

    def _durable(self, step: int, path: str) -> None:
        """Record ``step`` durable; drop snapshots beyond ``KEEP_LAST``."""
        self._durable_at.setdefault(step, time.perf_counter())
        self._kept.append((step, path))
        while len(self._kept) > KEEP_LAST:
            _, old = self._kept.pop(0)
            remove(old)


class NoCheckpoint(System):
    """The baseline of the training loop: ``save`` does nothing."""

    name = "no checkpointing"

    def save(self, step: int) -> None:
        pass

    def restore(self) -> Optional[int]:
        return None


class TorchSave(System):
    """The periodic blocking save most training scripts do, fsynced."""

    name = "torch.save + fsync"

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:08d}.pt")

    def _save(self, step: int, path: str) -> None:
        with open(path, "wb") as f:
            torch.save({k: v.state_dict() for k, v in self.state.items()}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.directory)
        self._durable(step, path)

    def restore(self) -> Optional[int]:
        step, path = self._kept[-1]
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        for key, obj in self.state.items():
            obj.load_state_dict(loaded[key])
        return step


class Engine(System):
    """async_ckpt; time to commit is the engine's own figure (the blocking time in sync mode).
    ``fewer_threads``: one torch thread fewer while open, a core for lazy staging's copy."""

    def __init__(self, state: dict, directory: str, name: str, mode: str,
                 compression: Optional[str], fewer_threads: bool = False, **options):
        from async_ckpt import CheckpointEngine

        super().__init__(state, directory)
        self.name, self.mode = name, mode
        self._threads = torch.get_num_threads()
        if fewer_threads:
            torch.set_num_threads(max(1, self._threads - 1))
        self._open = lambda: CheckpointEngine(directory, state=state, mode=mode,
                                              compression=compression, **options)
        self.engine = self._open()
        self._blocking: Optional[float] = None
        self._writer_pid: Optional[int] = self.engine.stats().get("writer_pid")

    def save(self, step: int) -> None:
        self._newest_saved = step
        self._blocking = timed(lambda: self.engine.snapshot(step, force=True))

    def fence(self) -> None:
        self.engine.fence()

    def wait(self) -> None:
        self.engine.wait()

    def newest_figures(self) -> dict:
        figures = self.engine.stats()["snapshots"][-1]
        if figures["step"] != self._newest_saved:
            raise RuntimeError(f"{self.name}: newest stats are of step {figures['step']}, "
                               f"not {self._newest_saved}")
        return figures

    def to_commit_s(self) -> float:
        return self._blocking if self.mode == "sync" else self.newest_figures()["to_commit_s"]

    def stored_bytes(self) -> int:
        return self.newest_figures()["stored_bytes"]

    def restore(self) -> Optional[int]:
        return restore_quietly(self.engine)

    def restart(self) -> None:
        """The engine closed and opened again: a restore right after a snapshot reads the
        staging slot it was written from, not the files."""
        self.engine.close()
        self.engine = self._open()
        self._writer_pid = self.engine.stats().get("writer_pid")

    def newest_path(self) -> str:
        from async_ckpt.format.manifest import read_manifest
        from async_ckpt.storage.local import LocalStorage

        newest = read_manifest(LocalStorage(self.directory)).snapshots[-1]
        return os.path.join(self.directory, newest.dir)

    def writer_pids(self) -> list[int]:
        return [] if self._writer_pid is None else [self._writer_pid]

    def details(self) -> dict:
        stats = self.engine.stats()
        return {"snapshot": self.newest_figures() if stats["snapshots"] else None,
                **{k: stats.get(k) for k in ("trainer_rss", "writer_rss", "writer_shared",
                                             "pool_bytes", "skipped", "pin_failures")}}

    def close(self) -> None:
        self._writer_pid = None
        try:
            self.engine.close()
        finally:
            torch.set_num_threads(self._threads)


# --- PyTorch DCP ----------------------------------------------------------------------------------


def open_dcp(name: str, state: dict, directory: str, executor: Optional[str] = None,
                stager: Optional[str] = None) -> System:
    ensure_process_group()
    if executor is None:
        return DcpSave(name, state, directory)
    return DcpAsync(name, state, directory, executor, stager)


def ensure_process_group() -> None:
    """A single-process gloo group on 127.0.0.1, created once; ``Unavailable`` if DCP cannot run."""
    try:
        import torch.distributed as dist
        importlib.import_module("torch.distributed.checkpoint")
    except ImportError as e:
        raise Unavailable(f"torch.distributed.checkpoint does not import: {e}") from e
    if not dist.is_available():
        raise Unavailable("this torch build has no torch.distributed")
    if dist.is_initialized():
        return
    # the process executor starts its own store, which would otherwise bind to the host name
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    try:
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    except Exception as e:  # noqa: BLE001 - any failure means this peer cannot run here
        raise Unavailable(f"cannot create a single-process gloo group: {e}") from e


def shutdown_dcp() -> None:
    """Stop DCP's process-executor daemon and destroy the process group, if they exist."""
    stop_process_daemon()
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except ImportError:
        pass


def stop_process_daemon() -> None:
    """DCP keeps this daemon in a module global for the trainer's life, as its users get it."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return
    daemon = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if daemon is not None:
        executor._CHECKPOINT_PROCESS = None
        daemon.__del__()  # sends TERMINATE, joins, terminates if needed; later calls are no-ops


class DcpSave(System):
    """``dcp.save``, durable on return; on a directory with checkpoints (another world size's), it
    restores the newest."""

    def __init__(self, name: str, state: dict, directory: str):
        super().__init__(state, directory)
        self.name = name
        self._kept = sorted((int(n.removeprefix("step-")), os.path.join(directory, n))
                            for n in os.listdir(directory) if n.startswith("step-"))

    def _save(self, step: int, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        dcp.save(self.state, checkpoint_id=path)
        self._durable(step, path)

    def restore(self) -> Optional[int]:
        import torch.distributed.checkpoint as dcp
        step, path = self._kept[-1]
        dcp.load(self.state, checkpoint_id=path)
        return step


@contextlib.contextmanager
def _stderr_to_devnull(active: bool):
    """The process executor's child logs every request on the stderr it inherits at its start;
    its failures still reach the future."""
    if not active:
        yield
        return
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class DcpAsync(DcpSave):
    """``dcp.async_save``; ``stager``: "default", "cached" (shared memory) or "pinned"."""

    def __init__(self, name: str, state: dict, directory: str, executor: str, stager: str):
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        super().__init__(name, state, directory)
        self._type = {"thread": AsyncCheckpointerType.THREAD,
                      "process": AsyncCheckpointerType.PROCESS}[executor]
        self._stager = self.staging_options = None
        if stager in ("cached", "pinned"):
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError as e:
                raise Unavailable(f"this torch has no DefaultStager/StagingOptions: {e}") from e
            cuda = stager == "pinned" and _on_cuda(state)
            self.staging_options = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=stager == "cached",
                use_async_staging=stager == "pinned", use_non_blocking_copy=cuda)
            self._stager = DefaultStager(self.staging_options)
        self._staging: Optional[Future] = None  # the copy an asynchronous stager still runs
        self._future: Optional[Future] = None
        self._pending: Optional[tuple[int, str]] = None
        self._done_at: dict[int, float] = {}
        self._saved_once = False

    def _save(self, step: int, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        self.wait()  # one in flight: staging into the cached buffers would corrupt the previous
        first_of_process = self._type.name == "PROCESS" and not self._saved_once
        self._saved_once = True
        with _stderr_to_devnull(first_of_process):
            response = dcp.async_save(self.state, checkpoint_id=path, async_stager=self._stager,
                                      async_checkpointer_type=self._type)
            future = getattr(response, "upload_completion", response)  # AsyncSaveResponse/Future
            self._staging = getattr(response, "staging_completion", None)
            if first_of_process:  # the child is started by a thread of DCP's during this save:
                future.result()  # wait for it here (the first save is always a warm-up)
        future.add_done_callback(lambda _, s=step: self._done_at.setdefault(s, time.perf_counter()))
        self._future, self._pending = future, (step, path)

    def fence(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def wait(self) -> None:
        self.fence()
        if self._future is None:
            return
        future, (step, path) = self._future, self._pending
        self._future = self._pending = None
        future.result()  # raises the save's error
        self._durable_at[step] = self._done_at.pop(step, time.perf_counter())
        self._durable(step, path)

    def details(self) -> dict:
        return ({} if self.staging_options is None
                else {"staging_options": dataclasses.asdict(self.staging_options)})

    def writer_pids(self) -> list[int]:
        if self._type.name != "PROCESS":
            return []
        try:
            from torch.distributed.checkpoint import _async_process_executor as executor
            return [executor._CHECKPOINT_PROCESS._save_process.pid]
        except (ImportError, AttributeError):
            return []

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()


def _on_cuda(state: dict) -> bool:
    """Whether a registered module of ``state`` has parameters on a CUDA device."""
    return any(p.is_cuda for obj in state.values() if hasattr(obj, "parameters")
               for p in obj.parameters())


class TorchSnapshotAsync(System):
    """torchsnapshot ``Snapshot.async_take``, optional; it never fsyncs, so ``wait()`` does
    (docs/performance.md, "Reading the numbers")."""

    name = "torchsnapshot async_take"

    def __init__(self, state: dict, directory: str):
        try:
            import torchsnapshot
        except Exception as e:  # noqa: BLE001 - not installed, or its imports fail on this torch
            raise Unavailable(f"torchsnapshot is not installed or does not import on this torch: "
                              f"{type(e).__name__}: {e}") from e
        super().__init__(state, directory)
        self._torchsnapshot = torchsnapshot
        self._pending = None
        self._pending_step: Optional[tuple[int, str]] = None

    def _save(self, step: int, path: str) -> None:
        self._finish(fsync=False)
        self._pending = self._torchsnapshot.Snapshot.async_take(path=path, app_state=self.state)
        self._pending_step = (step, path)

    def wait(self) -> None:
        self._finish(fsync=True)

    def _finish(self, fsync: bool) -> None:
        if self._pending is None:
            return
        pending, (step, path) = self._pending, self._pending_step
        self._pending = self._pending_step = None
        pending.wait()
        if fsync:
            fsync_tree(path)
        self._durable_at[step] = time.perf_counter()
        self._durable(step, path)

    def restore(self) -> Optional[int]:
        step, path = self._kept[-1]
        self._torchsnapshot.Snapshot(path=path).restore(app_state=self.state)
        return step


def run_guarded(spec, state: dict, directory: str, body: Callable[[System], dict]) -> dict:
    """``body(system)``, then close and remove whatever happened; a peer that cannot run or fails
    is an n/a result, a failure of async_ckpt is a bug and raised."""
    try:
        system = spec.open(state, directory)
    except Unavailable as e:
        log(f"  {spec.name}: n/a ({e})")
        return {"available": False, "reason": str(e)}
    try:
        return body(system)
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result, ours is a bug
        if spec.ours:
            raise
        log(f"  {spec.name}: failed: {type(e).__name__}: {e}")
        return {"available": False, "reason": f"failed here: {type(e).__name__}: {e}"}
    finally:
        try:
            system.close()
        finally:
            remove(directory, settle=True)


# --- the registry: every system the benchmarks run, by name, and each part's selection of them ----


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
    return SystemSpec(name, lambda state, d: open_dcp(name, state, d, **options),
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
OURS_BUFFERED = _engine("async_ckpt async, page cache writes", direct_io=False)
"""The writer through the page cache: ``OURS_ASYNC`` writes direct (``direct_io``'s default)."""
OURS_REMOTE = _engine("async_ckpt async, remote tier", rng=False)
"""Opened with ``remote=URL`` (``features.REMOTE``)."""
OURS_LAZY_NICED = _engine("async_ckpt async, lazy, niced copy thread", staging="lazy", copy_nice=10)
OURS_LAZY_FEWER = _engine("async_ckpt async, lazy, one torch thread fewer", staging="lazy",
                          fewer_threads=True)
NEVER = 10 ** 9  # an ``every`` no loop reaches: the disk gets the first snapshot only
OURS_MEMORY = {staging: _engine(f"async_ckpt memory tier, {staging} staging", staging=staging,
                                every=NEVER, memory_every=1, slots=3, heartbeat_interval=None)
               for staging in ("eager", "lazy")}
"""The memory tier (``features.MEMORY_TIER``): a memory snapshot at every step."""
OURS_REPLICATED = _engine("async_ckpt async, replicated written by rank 0", replicated=REPLICATED)
OURS_REPLICATED_SPREAD = _engine("async_ckpt async, replicated spread over ranks",
                                replicated=REPLICATED, spread_replicated=True)
DCP_SAVE = _dcp("DCP save")
DCP_DEFAULT = _dcp("DCP async_save (default stager)", executor="thread", stager="default")
DCP_CACHED = _dcp("DCP async_save (cached shm stager)", executor="thread", stager="cached")
DCP_PROCESS = _dcp("DCP async_save (cached shm stager, process executor)", executor="process",
                   stager="cached")
DCP_PINNED = _dcp("DCP async_save (cached pinned stager)", executor="thread", stager="pinned")
DCP_LOAD = _dcp("DCP load")
"""``dcp.load`` of a ``dcp.save`` checkpoint, restoring it on another world size (sharded)."""
TORCHSNAPSHOT = SystemSpec(TorchSnapshotAsync.name, TorchSnapshotAsync, ours=False)

SYSTEMS: tuple[SystemSpec, ...] = (TORCH_SAVE, OURS_SYNC, OURS_ASYNC, OURS_BUFFERED,
                                   OURS_ASYNC_ZSTD, DCP_SAVE, DCP_DEFAULT, DCP_CACHED, DCP_PROCESS,
                                   TORCHSNAPSHOT)
"""The sweep's and the training loop's, in report order."""

SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)
BIG_SYSTEMS = tuple(s.name for s in (TORCH_SAVE, OURS_SYNC, OURS_ASYNC, OURS_BUFFERED,
                                      OURS_ASYNC_ZSTD, DCP_SAVE, DCP_CACHED))
STALL_SYSTEMS = (OURS_ASYNC, OURS_BUFFERED, OURS_ASYNC_ZSTD, OURS_SYNC, TORCH_SAVE)
RANK_SYSTEMS = (OURS_REPLICATED, OURS_REPLICATED_SPREAD, DCP_DEFAULT, DCP_CACHED)
SHARDED_SYSTEMS = (OURS_ASYNC, DCP_DEFAULT, DCP_CACHED)
LAZY_SYSTEMS = (OURS_ASYNC, OURS_LAZY, OURS_LAZY_NICED, OURS_LAZY_FEWER, DCP_CACHED)
GPU_SYSTEMS = (OURS_ASYNC, OURS_LAZY, DCP_DEFAULT, DCP_PINNED, TORCH_SAVE)


def by_name(name: str) -> SystemSpec:
    return next(s for s in SYSTEMS + (NONE,) if s.name == name)
