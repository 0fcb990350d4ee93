"""The checkpointing systems under test, behind one small interface so that every benchmark drives
them the same way.

A system is opened on a training state (``{"model": module, "optimizer": optimizer}``) and a
directory of its own, then:

1. ``save(step)``: the call a training loop makes; its wall time is the blocking time. An
   asynchronous system may return before the snapshot is durable; one that allows a single save
   in flight (DCP, torchsnapshot) first waits for the previous one here, which is where a training
   loop would wait too.
2. ``fence()``: returns once the state may change again: where a save's copy of the state runs on
   after ``save`` returned (lazy staging, DCP's asynchronous staging), the GPU benchmark calls it
   right before the optimizer's step, as those systems' users must; a no-op for the others.
3. ``wait()``: returns once every save so far is durable; then ``to_commit_s()`` is the time from
   the newest ``save`` call to its durability and ``stored_bytes()`` its size on disk.
4. ``restore()``: loads the newest durable snapshot into the live objects, the way each system's
   users resume; returns the restored step when the system reports one.
5. ``close()``.

Peers keep the newest three snapshots, like the engine's default ``keep_last=3``, so that disk use
and page-cache pressure are alike. A peer that cannot run here raises ``Unavailable`` from its
constructor with the reason; the benchmarks report it as "n/a (reason)". Which systems exist, by
name, is ``registry.py``'s.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

from .measure import dir_bytes, fsync_dir, log, remove, timed
from .workloads import restore_quietly

KEEP_LAST = 3


class Unavailable(Exception):
    """This system cannot run on this machine or torch version; the message says why."""


class System:
    """Base class: the bookkeeping every peer shares (call and durability timestamps, retention).
    Subclasses implement ``_save(step, path)`` and ``restore()``; asynchronous ones override
    ``wait()`` and call ``_durable(step, path)`` when a snapshot becomes durable."""

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
        self._called_at[step] = time.perf_counter()
        self._newest_saved = step
        self._save(step, self._path(step))

    def fence(self) -> None:
        """A save that returned has copied the state already (see the module docstring)."""

    def wait(self) -> None:
        """Synchronous systems are durable when ``save`` returns."""

    def to_commit_s(self) -> float:
        step = self._newest_saved
        return self._durable_at[step] - self._called_at[step]

    def stored_bytes(self) -> int:
        return dir_bytes(self.newest_path())

    def restore(self) -> Optional[int]:
        raise NotImplementedError

    def newest_path(self) -> str:
        """The file or directory of the newest durable snapshot."""
        return self._kept[-1][1]

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
        """Record that ``step`` is durable at ``path`` and drop snapshots beyond ``KEEP_LAST``."""
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
    """``torch.save`` of the state dicts + fsync of the file and its directory, all blocking: the
    periodic blocking save most training scripts do. ``restore`` is ``torch.load`` (with
    ``weights_only=True``, so loading runs no code) + ``load_state_dict``."""

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
    """async_ckpt's ``CheckpointEngine``. Blocking time is measured around ``snapshot()`` by the
    caller like every other system's; time-to-commit is the engine's own ``to_commit_s`` (from
    the ``snapshot()`` call to the manifest commit, both clocks monotonic), and in sync mode the
    blocking time, which includes the commit. ``fewer_threads``: one torch intra-op thread fewer
    while it is open (a core left to lazy staging's copy thread)."""

    def __init__(self, state: dict, directory: str, name: str, mode: str,
                 compression: Optional[str], fewer_threads: bool = False, **options):
        from async_ckpt import CheckpointEngine

        super().__init__(state, directory)
        self.name, self.mode = name, mode
        self._threads = torch.get_num_threads()
        if fewer_threads:
            torch.set_num_threads(max(1, self._threads - 1))
        self.engine = CheckpointEngine(directory, state=state, mode=mode, compression=compression,
                                       **options)
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
                                             "pool_bytes", "skipped")}}

    def close(self) -> None:
        self._writer_pid = None
        try:
            self.engine.close()
        finally:
            torch.set_num_threads(self._threads)


def run_guarded(spec, state: dict, directory: str, body: Callable[[System], dict]) -> dict:
    """Open ``spec``'s system (a ``registry.SystemSpec``) on ``state`` in ``directory``, return
    ``body(system)``, then close it and remove the directory whatever happened. A system that
    cannot run here, or a peer that fails, is a result ({"available": False, "reason": ...}); a
    failure of async_ckpt (``spec.ours``) is a bug and is raised."""
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
