"""The keeper process: holds the newest in-memory snapshot of one rank of one checkpoint
directory, so that a trainer killed at step N resumes from N, not from its last disk snapshot.

The first engine with ``memory_every`` on a directory starts it (``client.py``) as ``python -m
async_ckpt.keeper.keeper``, in a session of its own, so that a signal to the trainer's process
group (a kill of the job's processes, a terminal's Ctrl-C) does not reach it; it never imports
torch. It listens on an abstract Unix address named by the user, the directory's identity
(device, inode) and the rank (``protocol.keeper_address``), and talks only to processes of its
own user. A trainer greets it with the directory's memory session (``hello``: a token kept in
the directory, so that a directory emptied and reused never gets an earlier job's state); a
keeper greeted with another session drops what it holds.

The trainer stages a snapshot into a staging slot as for the disk, then hands the slot's memfd
over (``hold``); the keeper checksums it (off the training process) and answers ``sealed``: from
then on it holds that slot's memory, and lets go of the oldest it held beyond the ``keep`` the
trainer asked for (one, or two where several ranks must agree on a step), which the trainer may
stage into again. Holds that arrive faster than it seals are answered ``superseded``, all but
the newest. So it holds at most ``keep`` sealed snapshots and one being sealed, memory the
trainer allocated; once the trainer dies, only the sealed ones. A restarted trainer asks for one
(``query``: the newest, or a step), verifies it and copies it into place.

It exits when told (``quit``: the job ended with its newest state on disk), when no trainer has
been attached for ``idle_timeout`` seconds, or as soon as none is attached once the process that
launched the last trainer (its parent: torchrun's agent, a supervisor, a shell) has exited: the
job is over, and its memory goes with it.
"""

from __future__ import annotations

import argparse
import errno
import logging
import mmap
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..checks import is_int, is_number
from ..errors import MemoryTierError
from ..format.records import HeldStorage
from ..format.shard import CHUNK_BYTES, checksum
from .protocol import (FRAME_TIMEOUT_S, KEEP_MAX, Gone, check_same_user, held_message,
                       keeper_address, parse_layout, receive, send, with_checksums)

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 16
"""Connections a keeper serves at once (one trainer, and a restarted one while the first is
being noticed dead, in practice): more are refused, so that no process can make it hold more."""
_SESSION_CHARS = 64
MAPPED_PER_TRAINER = 16
"""Staging slots of one trainer whose mappings the keeper keeps between seals (``mapping``)."""


@dataclass(eq=False)
class _Trainer:
    """A connection: its socket, the peer's pid and a pidfd on it (None where pidfds are not
    available), whether it has greeted, and when it connected; ``mapped``: its staging slots as
    the keeper has mapped them to seal them, by buffer (``Keeper.mapping``)."""

    sock: socket.socket
    pid: int
    pidfd: Optional[int]
    since: float
    greeted: bool = False
    mapped: dict[int, tuple[tuple[int, int, int], mmap.mmap]] = field(default_factory=dict,
                                                                      repr=False)


@dataclass
class _Snapshot:
    """A hold: the memfd, its size, the step, the state tree, the tensor records, the storages
    (with checksums once sealed: ``checksummed``, from the hold or made by the seal), and who
    handed it over (for the answer)."""

    fd: int
    size: int
    buffer: int
    step: int
    tree: dict
    tensors: list
    storages: list[HeldStorage]
    checksummed: bool
    trainer: Optional[_Trainer] = field(default=None, repr=False)


class Keeper:
    """The keeper's state and its loop (``serve``; ``poll`` does one turn, for tests that drive
    it with their own ``clock``)."""

    def __init__(self, listener: socket.socket, identity: tuple[int, int, int],
                 idle_timeout: float, clock: Callable[[], float] = time.monotonic):
        self.listener = listener
        self.identity = identity  # (st_dev, st_ino, rank)
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.session: Optional[str] = None
        self.trainers: dict[int, _Trainer] = {}  # by socket fd
        self.sealed: list[_Snapshot] = []  # oldest first, at most ``keep``
        self.keep = 1
        self.pending: Optional[_Snapshot] = None
        self.layout: Optional[dict] = None  # the last hold's layout, for holds that name none
        self.launcher: Optional[int] = None  # a pidfd on the last trainer's parent
        self.launcher_gone = False
        self.idle_since = clock()
        self.finished = False
        self._poller = select.poll()
        self._poller.register(listener.fileno(), select.POLLIN)
        self._by_pidfd: dict[int, _Trainer] = {}

    # --- the loop ---------------------------------------------------------------------------

    def serve(self) -> None:
        while not self.finished:
            self.poll(self._wait_s())
        self.close()

    def _wait_s(self) -> Optional[float]:
        if any(not t.greeted for t in self.trainers.values()):
            return FRAME_TIMEOUT_S
        if self.attached():
            return None
        return max(0.0, self.idle_since + self.idle_timeout - self.clock())

    def attached(self) -> bool:
        return any(t.greeted for t in self.trainers.values())

    def poll(self, timeout: Optional[float]) -> None:
        """One turn: wait up to ``timeout`` seconds (None: until something happens), handle what
        came, seal the newest hold, and decide whether the job is over."""
        events = self._poller.poll(None if timeout is None else int(timeout * 1000))
        dead = [self._by_pidfd[fd] for fd, _ in events if fd in self._by_pidfd]
        for trainer in dead:  # what a dead trainer sent still counts: read it first
            self._drain(trainer)
            self.drop(trainer)
        for fd, _ in events:
            if fd == self.listener.fileno():
                self._accept()
            elif fd == self.launcher:
                self._poller.unregister(fd)
                os.close(fd)
                self.launcher, self.launcher_gone = None, True
            elif fd in self.trainers:
                self._drain(self.trainers[fd])
        self.seal()
        now = self.clock()
        for trainer in [t for t in self.trainers.values()
                        if not t.greeted and now - t.since > FRAME_TIMEOUT_S]:
            self.drop(trainer)  # connected and said nothing
        if not self.attached() and (self.launcher_gone
                                    or now - self.idle_since >= self.idle_timeout):
            log.info("no trainer attached and %s: exiting", "the job's launcher exited"
                     if self.launcher_gone else f"idle for {self.idle_timeout:.0f} s")
            self.finished = True

    def add(self, sock: socket.socket) -> Optional[_Trainer]:
        """Serve ``sock`` if its peer is of this user (else it is closed)."""
        try:
            pid = check_same_user(sock, "a process connecting to the keeper")
        except (MemoryTierError, OSError) as e:
            log.warning("refused a connection: %s", e)
            sock.close()
            return None
        if len(self.trainers) >= MAX_CONNECTIONS:
            log.warning("refused a connection from pid %d: %d are open already", pid,
                        MAX_CONNECTIONS)
            sock.close()
            return None
        sock.settimeout(FRAME_TIMEOUT_S)
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # Linux before 5.3, or gone already: EOF tells
            pidfd = None
        trainer = _Trainer(sock, pid, pidfd, self.clock())
        self.trainers[sock.fileno()] = trainer
        self._poller.register(sock.fileno(), select.POLLIN)
        if pidfd is not None:
            self._by_pidfd[pidfd] = trainer
            self._poller.register(pidfd, select.POLLIN)
        return trainer

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        self.add(sock)

    def drop(self, trainer: _Trainer) -> None:
        """Forget a connection (its hold, if one is pending, is still sealed: it was whole)."""
        fd = trainer.sock.fileno()
        if self.trainers.pop(fd, None) is None:
            return
        self._poller.unregister(fd)
        trainer.sock.close()
        for _, memory in trainer.mapped.values():
            memory.close()
        trainer.mapped.clear()
        if trainer.pidfd is not None:
            self._poller.unregister(trainer.pidfd)
            del self._by_pidfd[trainer.pidfd]
            os.close(trainer.pidfd)
        if not self.attached():
            self.idle_since = self.clock()

    def _drain(self, trainer: _Trainer) -> None:
        """Handle every frame ``trainer`` has sent so far (at least one if it is readable)."""
        while trainer.sock.fileno() in self.trainers and _readable(trainer.sock):
            try:
                message, fd = receive(trainer.sock)
            except (Gone, MemoryTierError) as e:
                if not isinstance(e, Gone):
                    log.warning("dropped the connection of pid %d: %s", trainer.pid, e)
                self.drop(trainer)
                return
            try:
                self.handle(trainer, message, fd)
            except MemoryTierError as e:
                log.warning("dropped the connection of pid %d: %s", trainer.pid, e)
                self.drop(trainer)
                return

    # --- the messages -------------------------------------------------------------------------

    def handle(self, trainer: _Trainer, message: dict, fd: Optional[int]) -> None:
        kind = message["type"]
        if kind != "hold" and fd is not None:
            os.close(fd)
            raise MemoryTierError(f"a {kind} message carried a descriptor")
        if kind == "hello":
            self._hello(trainer, message)
        elif not trainer.greeted:
            if fd is not None:
                os.close(fd)
            raise MemoryTierError(f"a {kind} message before hello")
        elif kind == "hold":
            self._hold(trainer, message, fd)
        elif kind == "query":
            self._query(trainer, message.get("step"))
        elif kind == "quit":
            log.info("told to quit by pid %d", trainer.pid)
            self.finished = True
        else:
            raise MemoryTierError(f"unknown message {kind[:40]!r}")

    def _hello(self, trainer: _Trainer, message: dict) -> None:
        session, launcher = message.get("session"), message.get("launcher")
        identity = (message.get("dev"), message.get("ino"), message.get("rank"))
        if identity != self.identity or not all(is_int(v) for v in identity):
            raise MemoryTierError("a hello for another directory or rank")
        keep = message.get("keep", 1)
        if not (type(session) is str and 0 < len(session) <= _SESSION_CHARS
                and is_int(launcher) and is_number(message.get("idle_timeout"))
                and message["idle_timeout"] > 0 and is_int(keep, 1, KEEP_MAX)):
            raise MemoryTierError("a malformed hello")
        if session != self.session:  # the directory started anew: nothing of the old one stays
            if self.sealed:
                log.warning("a trainer of another memory session of the directory attached: "
                            "dropping step(s) %s of the earlier one",
                            [s.step for s in self.sealed])
                self._keep_newest(0)
            if self.pending is not None:
                self._release(self.pending)
                self.pending = None
            for other in [t for t in self.trainers.values() if t.greeted]:
                self.drop(other)
            self.session = session
        trainer.greeted = True
        self.idle_timeout = float(message["idle_timeout"])
        self.keep = keep
        self._keep_newest(keep)
        self._watch_launcher(launcher)
        self._answer(trainer, {"type": "welcome", "pid": os.getpid(),
                               "step": self.sealed[-1].step if self.sealed else None,
                               "bytes": self.held_bytes()})

    def _watch_launcher(self, pid: int) -> None:
        """Exit once the process that launched the newest trainer is gone (and none is
        attached): the job is over. Not watched where it is init (1) or unknown (0)."""
        if self.launcher is not None:
            self._poller.unregister(self.launcher)
            os.close(self.launcher)
            self.launcher = None
        self.launcher_gone = False
        if pid <= 1:
            return
        try:
            self.launcher = os.pidfd_open(pid)
        except (AttributeError, OSError) as e:
            if getattr(e, "errno", None) == errno.ESRCH:
                self.launcher_gone = True
            return
        self._poller.register(self.launcher, select.POLLIN)

    def _hold(self, trainer: _Trainer, message: dict, fd: Optional[int]) -> None:
        buffer, step = message.get("buffer"), message.get("step")
        if fd is None or not (is_int(buffer) and is_int(step)
                              and isinstance(message.get("tree"), dict)):
            if fd is not None:
                os.close(fd)
            raise MemoryTierError("a malformed hold")
        if message.get("layout") is not None:
            self.layout = message["layout"]
        size = os.fstat(fd).st_size
        try:
            if self.layout is None:
                raise MemoryTierError("the first hold named no layout")
            storages, tensors = parse_layout(self.layout, size)
        except MemoryTierError as e:
            os.close(fd)
            self._answer(trainer, {"type": "refused", "buffer": buffer, "error": str(e)})
            return
        if self.pending is not None:  # never sealed: a newer one came first
            superseded, self.pending = self.pending, None
            self._answer(superseded.trainer, {"type": "superseded", "buffer": superseded.buffer})
            self._release(superseded)
        checksummed = with_checksums(storages, message.get("xxh3"))
        self.pending = _Snapshot(fd, size, buffer, step, message["tree"], tensors,
                                 checksummed or storages, checksummed is not None, trainer)

    def seal(self) -> None:
        """Checksum the pending hold (unless it came with its checksums) and hold it, letting go
        of sealed ones past ``keep``."""
        snapshot, self.pending = self.pending, None
        if snapshot is None:
            return
        if snapshot.size and not snapshot.checksummed:
            memory, owned = self.mapping(snapshot)
            try:
                with memoryview(memory) as view:
                    snapshot.storages = [
                        HeldStorage(s.offset, s.nbytes, tuple(
                            checksum(view[at:min(at + CHUNK_BYTES, s.offset + s.nbytes)])
                            for at in range(s.offset, s.offset + s.nbytes, CHUNK_BYTES)))
                        for s in snapshot.storages]
            finally:
                if owned:
                    memory.close()
        self.sealed.append(snapshot)
        self._keep_newest(self.keep)
        self._answer(snapshot.trainer, {"type": "sealed", "buffer": snapshot.buffer,
                                        "step": snapshot.step, "bytes": self.held_bytes()})
        snapshot.trainer = None

    def mapping(self, snapshot: _Snapshot) -> tuple[mmap.mmap, bool]:
        """``snapshot``'s memory, mapped read-only, and whether the caller closes the mapping.
        A trainer's slots come back step after step: a mapping kept per slot while its trainer
        is attached is not faulted in page by page again at every seal (half the cost of sealing
        otherwise). It holds no memory that the trainer does not hold too (its staging slot), and
        goes when the trainer does (``drop``)."""
        trainer = snapshot.trainer
        st = os.fstat(snapshot.fd)
        identity = (st.st_dev, st.st_ino, snapshot.size)
        if trainer is None or trainer.sock.fileno() not in self.trainers:
            return mmap.mmap(snapshot.fd, snapshot.size, prot=mmap.PROT_READ), True
        known = trainer.mapped.get(snapshot.buffer)
        if known is not None and known[0] == identity:
            return known[1], False
        memory = mmap.mmap(snapshot.fd, snapshot.size, prot=mmap.PROT_READ)
        if known is not None:
            known[1].close()
        elif len(trainer.mapped) >= MAPPED_PER_TRAINER:  # more slots than a pool has: not kept
            return memory, True
        trainer.mapped[snapshot.buffer] = (identity, memory)
        return memory, False

    def _keep_newest(self, count: int) -> None:
        """Let go of the sealed snapshots but the newest ``count``."""
        while len(self.sealed) > count:
            self._release(self.sealed.pop(0))

    def _query(self, trainer: _Trainer, step: Optional[int]) -> None:
        """Answer with the sealed snapshot of ``step`` (None: the newest), or with nothing."""
        if step is not None and not is_int(step):
            raise MemoryTierError("a malformed query")
        for other in [t for t in self.trainers.values() if t is not trainer]:
            if other.pidfd is not None and _readable_fd(other.pidfd):  # dead: its holds first
                self._drain(other)
                self.drop(other)
        self.seal()
        held = next((s for s in reversed(self.sealed) if step is None or s.step == step), None)
        if held is None:
            self._answer(trainer, {"type": "held", "step": None})
            return
        self._answer(trainer, held_message(held.step, held.tree, held.tensors, held.storages,
                                           [s.step for s in self.sealed]), held.fd)

    def _answer(self, trainer: Optional[_Trainer], message: dict,
                fd: Optional[int] = None) -> None:
        if trainer is None or trainer.sock.fileno() not in self.trainers:
            return
        try:
            send(trainer.sock, message, fd)
        except Gone:
            self.drop(trainer)

    def held_bytes(self) -> int:
        """The memory the keeper holds: the sealed snapshots' memfds and the one being sealed."""
        return sum(s.size for s in [*self.sealed, self.pending] if s is not None)

    def _release(self, snapshot: _Snapshot) -> None:
        os.close(snapshot.fd)

    def close(self) -> None:
        for trainer in list(self.trainers.values()):
            self.drop(trainer)
        self._keep_newest(0)
        if self.pending is not None:
            self._release(self.pending)
            self.pending = None
        if self.launcher is not None:
            os.close(self.launcher)
            self.launcher = None
        self.listener.close()


def _readable(sock: socket.socket) -> bool:
    return _readable_fd(sock.fileno())


def _readable_fd(fd: int) -> bool:
    """Whether ``fd`` has something to read now (or its end: EOF, a process's exit)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    first = socket.socket(fileno=args.fd)
    os.chdir("/")  # hold no directory of the job's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    first.settimeout(FRAME_TIMEOUT_S)
    hello, fd = receive(first)  # the spawning trainer's: the identity and the log level
    if fd is not None:
        os.close(fd)
    level, nice = hello.get("log_level"), hello.get("nice")
    if is_int(nice, 0, 19):  # as the writer: the trainer keeps the CPU
        os.nice(nice)
    logging.basicConfig(level=level if is_int(level) else logging.WARNING, stream=sys.stderr,
                        format=f"async_ckpt keeper[rank {hello.get('rank')}] %(levelname)s "
                               "%(message)s")
    identity = (hello.get("dev"), hello.get("ino"), hello.get("rank"))
    if not all(is_int(v) for v in identity):
        raise SystemExit("the keeper's first message must be its trainer's hello")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(keeper_address(os.getuid(), *identity))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        send(first, {"type": "exists"})  # another keeper has the address: the trainer uses it
        return
    listener.listen(MAX_CONNECTIONS)
    keeper = Keeper(listener, identity, idle_timeout=1.0)  # (the hello sets it)
    trainer = keeper.add(first)
    try:
        if trainer is None:
            return
        keeper.handle(trainer, hello, None)
    except MemoryTierError as e:
        log.error("the trainer that started the keeper sent %s", e)
        keeper.close()
        return
    keeper.serve()


if __name__ == "__main__":
    main()
