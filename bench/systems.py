"""The systems under test behind one interface (``System``), so every benchmark drives them alike;
which exist, by name, is ``registry.py``'s."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

from .harness import dir_bytes, fsync_dir, log, remove, timed
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
