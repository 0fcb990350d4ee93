"""torchsnapshot ``Snapshot.async_take`` as a peer, optional; it never fsyncs, so ``wait()`` does
(docs/performance.md, "Reading the numbers")."""

from __future__ import annotations

import time
from typing import Optional

from .harness import fsync_tree
from .systems import System, Unavailable


class TorchSnapshotAsync(System):
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
