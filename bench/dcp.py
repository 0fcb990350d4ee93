"""PyTorch DCP as peers, ``dcp.save`` and ``dcp.async_save`` with each stager as its users run it;
variants: docs/performance.md, "What runs"."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import time
from concurrent.futures import Future
from typing import Optional

from .systems import System, Unavailable


def open_system(name: str, state: dict, directory: str, executor: Optional[str] = None,
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


def shutdown() -> None:
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
