"""The training process's handle on its keeper: find it or start it, greet it, hand it staged
slots, ask it for what it holds. No torch here: what was held becomes tensors in ``read/held.py``.

Everything the keeper answers is checked as untrusted input (``protocol.py``): its user at
connect time, every frame's size and structure, and the memory of a held snapshot before it is
mapped (a memfd sealed against shrinking, so that no read of the mapping can fault: a file cut
short under a mapping would kill this process with SIGBUS).
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import stat
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..errors import MemoryTierError
from ..format.layout import ALIGNMENT
from ..write.client import start_module
from .protocol import (FRAME_TIMEOUT_S, Gone, Held, check_same_user, keeper_address, parse_held,
                       receive, send)

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0
"""How long a trainer waits for a keeper to start and greet it."""
QUERY_TIMEOUT_S = 120.0
"""How long a restore waits for the keeper's answer (it seals the newest hold first)."""
QUIT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Sealed:
    """The keeper checksummed buffer ``buffer`` (step ``step``) and holds it now, instead of the
    buffer it held before; it holds ``held_bytes`` in all."""

    buffer: int
    step: int
    held_bytes: int


@dataclass(frozen=True)
class LetGo:
    """The keeper will not hold buffer ``buffer``: a newer hold came first (``superseded``), or
    it refused it (``error``)."""

    buffer: int
    error: Optional[str] = None


KeeperEvent = Union[Sealed, LetGo]


@dataclass
class HeldMemory:
    """A snapshot the keeper held, as a restore receives it: its structure checked (``held``),
    its memfd mapped privately (``memory``: writes stay in this process; None for an empty
    one). Its checksums are for the reader to verify."""

    held: Held
    memory: Optional[mmap.mmap]


class KeeperClient:
    """A connection to the keeper of one rank of one checkpoint directory, greeted."""

    def __init__(self, sock: socket.socket, pid: int, step: Optional[int], held_bytes: int,
                 started: bool, process: Optional[subprocess.Popen]):
        self.sock = sock
        self.pid = pid  # the keeper's
        self.step = step  # the step it held when greeted (None: nothing)
        self.held_bytes = held_bytes
        self.started = started  # this trainer started it (none was there)
        self._process = process
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)

    @classmethod
    def open(cls, dev: int, ino: int, rank: int, session: str, idle_timeout: float,
             nice: int, keep: int) -> "KeeperClient":
        """Greet the keeper of (``dev``, ``ino``, ``rank``), starting one (at niceness
        ``nice``), detached from this process's session, when none listens; it is to hold the
        newest ``keep`` sealed snapshots. MemoryTierError when that fails, or when the process
        at the keeper's address is another user's."""
        address = keeper_address(os.getuid(), dev, ino, rank)
        hello = {"type": "hello", "session": session, "dev": dev, "ino": ino, "rank": rank,
                 "launcher": os.getppid(), "idle_timeout": idle_timeout, "nice": nice,
                 "keep": keep,
                 "log_level": logging.getLogger("async_ckpt").getEffectiveLevel()}
        sock = _connect(address)
        if sock is not None:
            return cls._greet(sock, hello, started=False, process=None)
        try:
            ours, process = start_module("async_ckpt.keeper.keeper", stdout=subprocess.DEVNULL,
                                         stderr=_log_target(), start_new_session=True)
        except OSError as e:
            raise MemoryTierError(f"could not start the keeper process: {e}") from e
        try:
            client = cls._greet(ours, hello, started=True, process=process)
        except BaseException:
            process.kill()
            process.wait()
            raise
        if client is not None:
            return client
        process.wait(START_TIMEOUT_S)  # another keeper has the address (started meanwhile)
        sock = _connect(address)
        client = None if sock is None else cls._greet(sock, hello, started=False, process=None)
        if client is None:
            raise MemoryTierError("the keeper's address was taken, but nobody answers there")
        return client

    @classmethod
    def _greet(cls, sock: socket.socket, hello: dict, started: bool,
               process: Optional[subprocess.Popen]) -> Optional["KeeperClient"]:
        """The client after ``hello`` is welcomed; None when the keeper answers ``exists``."""
        try:
            sock.settimeout(START_TIMEOUT_S)
            send(sock, hello)
            reply, fd = receive(sock)
            if fd is not None:
                os.close(fd)
                raise MemoryTierError("the keeper's welcome carried a descriptor")
            if reply["type"] == "exists":
                sock.close()
                return None
            pid, step, held = reply.get("pid"), reply.get("step"), reply.get("bytes")
            if not (reply["type"] == "welcome" and _is_count(pid)
                    and (step is None or _is_count(step)) and _is_count(held)):
                raise MemoryTierError(f"the keeper answered hello with {reply['type'][:40]!r}")
            sock.settimeout(FRAME_TIMEOUT_S)
        except Gone as e:
            sock.close()
            raise MemoryTierError(f"the keeper closed the connection when greeted ({e}); see "
                                  "its log on the job's stderr") from e
        except BaseException:
            sock.close()
            raise
        return cls(sock, pid, step, held, started, process)

    def hold(self, buffer: int, fd: int, step: int, tree: dict, layout: Optional[dict],
             checksums: Optional[Sequence[Sequence[str]]] = None) -> None:
        """Hand the keeper staged buffer ``buffer`` (``fd``, its memfd) of ``step``; ``layout``
        (``protocol.layout_message``) when it differs from the last hold's; ``checksums``: each
        storage's chunk checksums where the copy made them (else the keeper does). Raises
        ``Gone``."""
        send(self.sock, {"type": "hold", "buffer": buffer, "step": step, "tree": tree,
                         "layout": layout,
                         "xxh3": None if checksums is None else [list(c) for c in checksums]},
             fd)

    def events(self, timeout: Optional[float] = 0) -> list[KeeperEvent]:
        """What the keeper has answered so far: waits up to ``timeout`` seconds (None: until
        something comes) for the first. Raises ``Gone``, or MemoryTierError for an answer that is
        not one of the protocol's."""
        found: list[KeeperEvent] = []
        while self._poller.poll(None if timeout is None else int(timeout * 1000)):
            message, fd = receive(self.sock)
            found.append(_event(message, fd))
            timeout = 0
        return found

    def query(self, step: Optional[int] = None) -> tuple[list[KeeperEvent], Optional[HeldMemory]]:
        """The answers to earlier holds, and the snapshot of ``step`` the keeper holds (None:
        its newest), or None when it holds none (of that step)."""
        send(self.sock, {"type": "query", "step": step})
        found: list[KeeperEvent] = []
        self.sock.settimeout(QUERY_TIMEOUT_S)
        try:
            while True:
                message, fd = receive(self.sock)
                if message["type"] != "held":
                    found.append(_event(message, fd))
                    continue
                if message.get("step") is None:
                    if fd is not None:
                        os.close(fd)
                    return found, None
                if fd is None:
                    raise MemoryTierError("the keeper's answer came without its memory")
                return found, _mapped(message, fd)
        finally:
            self.sock.settimeout(FRAME_TIMEOUT_S)

    def close(self, quit: bool) -> None:
        """Let go of the keeper; ``quit``: tell it to exit, and wait until it has."""
        try:
            if quit:
                send(self.sock, {"type": "quit"})
                self.sock.settimeout(QUIT_TIMEOUT_S)
                while self.sock.recv(1 << 16):  # answers in flight, then the end
                    pass
        except (Gone, OSError) as e:
            log.debug("the keeper went before it was told to quit: %s", e)
        finally:
            self.sock.close()
        if self._process is None:
            return
        if not quit:
            self._process.poll()  # ours: reaped if it died, else left to the job's restart
            return
        try:
            self._process.wait(QUIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the keeper (pid %d) did not exit when told to; killing it", self.pid)
            self._process.kill()
            self._process.wait()


def _log_target() -> Optional[int]:
    """Where the keeper logs: the trainer's stderr when that is a terminal or a file, else
    nowhere. Never a pipe or a socket: the keeper, outliving the trainer, would hold it open, and
    whatever reads the trainer's output to its end would wait for the keeper too."""
    try:
        mode = os.fstat(2).st_mode
    except OSError:
        return subprocess.DEVNULL
    return None if stat.S_ISREG(mode) or stat.S_ISCHR(mode) else subprocess.DEVNULL


def _connect(address: bytes) -> Optional[socket.socket]:
    """A connection to the keeper at ``address``, of this user; None when none listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        check_same_user(sock, "the process listening at the keeper's address")
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _event(message: dict, fd: Optional[int]) -> KeeperEvent:
    """A keeper's answer to a hold, checked."""
    if fd is not None:
        os.close(fd)
        raise MemoryTierError("the keeper's answer to a hold carried a descriptor")
    kind, buffer = message["type"], message.get("buffer")
    if kind == "sealed" and _is_count(buffer) and _is_count(message.get("step")) \
            and _is_count(message.get("bytes")):
        return Sealed(buffer, message["step"], message["bytes"])
    if kind == "superseded" and _is_count(buffer):
        return LetGo(buffer)
    if kind == "refused" and _is_count(buffer) and isinstance(message.get("error"), str):
        return LetGo(buffer, message["error"][:500])
    raise MemoryTierError(f"the keeper answered with a malformed {kind[:40]!r}")


def _mapped(message: dict, fd: int) -> HeldMemory:
    """The held snapshot in ``message`` over memfd ``fd`` (closed here; ``receive`` checked it
    is sealed memory), checked and mapped."""
    try:
        st = os.fstat(fd)
        held = parse_held(message, st.st_size, ALIGNMENT)
        memory = (mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE) if st.st_size else None)
    finally:
        os.close(fd)
    return HeldMemory(held, memory)
