"""The training process's handle on its writer process: start it, talk to it, notice its death.

Kept apart from ``writer.py`` so that the training process imports only the messages
(``protocol.py``), not the writer's encoding and commit stages.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Optional

import psutil

from ..errors import WriterDiedError
from .protocol import (Attach, Close, Detach, Drop, Ready, SnapshotJob, TrainerMessage,
                       WriterConfig, WriterEvent)

log = logging.getLogger(__name__)
_READY_TIMEOUT_S = 120.0


def start_module(module: str, **popen: Any) -> tuple[socket.socket, subprocess.Popen]:
    """Start ``python -m module --fd N`` (a fresh interpreter, never a fork of the trainer), with
    this copy of the package importable, and the socket to it: the other end of a socketpair
    whose fd N it inherits. ``popen``: more arguments for ``subprocess.Popen``."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    try:
        process = subprocess.Popen([sys.executable, "-m", module, "--fd", str(theirs.fileno())],
                                   pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                   **popen)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours, process


class WriterClient:
    """The training process's handle on its writer process."""

    def __init__(self, config: WriterConfig):
        ours, self.process = start_module("async_ckpt.write.writer")
        self.conn = Connection(ours.detach())
        # One poll object for the connection's life: multiprocessing's wait() makes a selector
        # per call, and the engine polls at every snapshot (~50 us against ~10 us, measured).
        self._poller = select.poll()
        self._poller.register(self.conn.fileno(), select.POLLIN)
        self._send(config)
        event = self.next_event(_READY_TIMEOUT_S)
        if not isinstance(event, Ready):
            self.kill()
            raise WriterDiedError(f"the writer process did not start (got {event!r}); see its stderr")
        self.pid = self.process.pid

    def attach(self, buffer_id: int, fd: int, nbytes: int) -> None:
        self._send(Attach(buffer_id, nbytes))
        try:
            send_handle(self.conn, fd, self.process.pid)
        except OSError as e:
            raise self.died() from e

    def detach(self, buffer_id: int) -> None:
        self._send(Detach(buffer_id))

    def submit(self, job: SnapshotJob) -> None:
        self._send(job)

    def drop(self, steps: tuple[int, ...], files: tuple[str, ...] = ()) -> None:
        self._send(Drop(steps, files))

    def _send(self, message: TrainerMessage) -> None:
        try:
            self.conn.send(message)
        except OSError as e:
            raise self.died() from e

    def next_event(self, timeout: Optional[float]) -> Optional[WriterEvent]:
        """The next message from the writer, or None after ``timeout`` seconds (None: no limit).

        Raises WriterDiedError as soon as the writer is gone, instead of hanging."""
        if not self._poller.poll(None if timeout is None else math.ceil(timeout * 1000)):
            return None
        try:
            return self.conn.recv()
        except (EOFError, OSError) as e:
            raise self.died() from e

    def died(self) -> WriterDiedError:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None else "stopped answering")
        return WriterDiedError(
            f"the checkpoint writer process (pid {self.process.pid}) {how}. Snapshots in flight are "
            "lost; committed ones are intact. Check memory and disk, then create a new engine "
            "(or restart the job) to resume from the newest committed snapshot")

    def rss(self) -> dict:
        """The writer process's pid and memory, as ``stats()`` reports them; {} once it is gone."""
        try:
            info = psutil.Process(self.process.pid).memory_info()
        except psutil.Error:
            return {}
        return {"writer_pid": self.process.pid, "writer_rss": info.rss,
                "writer_shared": info.shared}

    def close(self, timeout: float) -> None:
        try:
            self.conn.send(Close())
        except OSError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.error("writer process %d did not exit in %.0f s; killing it", self.process.pid, timeout)
            self.kill()
        self.conn.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
