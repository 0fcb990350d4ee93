"""Heartbeat files: proof that a training loop is still making progress.

The engine replaces ``DIR/heartbeat.rankNNNNN.json`` from the training loop's ``snapshot()`` calls,
at most once per interval, so a loop that hangs stops beating even while other threads (the
writer's, a data loader's) still run. A supervisor reads the files to tell a hung job from a slow
one (``tools.supervisor.read_heartbeats``). Written through the directory's
``LocalStorage`` (``write_heartbeat``), replaced atomically but not fsynced: a heartbeat is about
liveness now, not durability.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Optional

from ..format.heartbeat import HeartbeatRecord
from ..storage.local import LocalStorage
from ..storage.names import heartbeat_file_name

log = logging.getLogger(__name__)


def heartbeat_path(directory: str, rank: int) -> str:
    """Where rank ``rank``'s heartbeat file is in ``directory``: what a supervisor watches."""
    return os.path.join(directory, heartbeat_file_name(rank))


class Heartbeat:
    """Rate-limited writer of one rank's heartbeat file."""

    def __init__(self, directory: LocalStorage, rank: int, interval: float):
        self.directory = directory
        self.path = heartbeat_path(directory.root, rank)
        self.rank, self.interval = rank, interval
        self._last = float("-inf")
        self.step: Optional[int] = None
        self._host = socket.gethostname()
        self._warned = False

    def beat(self, step: Optional[int] = None, *, closed: bool = False) -> None:
        """Write the heartbeat, at most once per interval; ``step`` defaults to the last one given
        (a beat while the engine waits for its writer). ``closed``: the last one, written at
        once, when the engine has closed: what the process does from then on (its writer
        stopping, the interpreter's exit) is no checkpointing a supervisor should time."""
        if step is not None:
            self.step = step
        if self.step is None:
            return  # no snapshot() yet: a heartbeat names a step
        now = time.monotonic()
        if now - self._last < self.interval and not closed:
            return
        self._last = now
        record = HeartbeatRecord(self.rank, self.step, time.time(), os.getpid(), self._host,
                                 self.interval, closed)
        try:
            self.directory.write_heartbeat(self.rank, record.to_bytes())
        except OSError as e:  # a directory planted at the name, a full disk: liveness only
            if not self._warned:
                self._warned = True
                log.warning("cannot write the heartbeat %s (%s); snapshots go on without it, "
                            "but a supervisor watching it will think this rank hung: remove "
                            "what is in its way", self.path, e.strerror or e)

