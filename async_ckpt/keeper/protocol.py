"""What a trainer and its keeper process say to each other, and how each checks the other.

Unlike the writer's socketpair (two processes of one job, pickled messages), a keeper listens on
an address any process of the machine can connect to, and outlives the trainer that started it,
so each side treats the other as untrusted: it checks the peer's user (``SO_PEERCRED``), and
every message is a frame, a header (magic, length) and a JSON object, its length bounded before
it is read and its parse bounded by the format's JSON budget (``values.parse_json``), never
unpickled. A file descriptor (a staging slot's memfd) may ride on a frame's header
(``SCM_RIGHTS``); a frame that carries one may be as large as the memory it describes allows
(``shard.index_budget``), any other ``MAX_PLAIN_FRAME`` bytes. docs/memory_tier.md lists the
messages:

  trainer -> keeper: hello (first), then hold (+ memfd), query, quit
  keeper -> trainer: welcome, or exists (a keeper started for an address another one holds);
                     per hold: sealed, superseded or refused; per query: held (+ the memfd, when
                     it holds a snapshot)
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import stat
import struct
from dataclasses import dataclass
from typing import Any, Optional

from ..checks import is_int
from ..errors import MemoryTierError
from ..format import values
from ..format.records import HeldStorage
from ..format.shard import CHUNK_BYTES, MAX_INDEX_BYTES, index_budget, is_checksum
from ..storage.names import MAX_STEP

MAGIC = b"ACKK"
_HEADER = struct.Struct("<4sI")  # magic, payload length
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_FD_SIZE = array.array("i").itemsize
_MAX_FDS = 4  # room to see (and refuse) a frame that carries more than one descriptor
MAX_PLAIN_FRAME = 1 << 20
"""The largest frame without a descriptor: hello, query, quit and the small replies."""
FRAME_TIMEOUT_S = 30.0
"""How long one side waits for the rest of a frame (or to hand one over) before giving the
other up: a peer that stalls mid-frame is not waited for forever."""


class Gone(ConnectionError):
    """The other side closed the connection (or died)."""


def keeper_address(uid: int, dev: int, ino: int, rank: int) -> bytes:
    """The abstract Unix socket address of the keeper of ``rank`` of the checkpoint directory
    whose identity is (``dev``, ``ino``), for user ``uid``: one keeper per rank, directory and
    user, nothing on any file system (the name goes when the keeper does)."""
    return f"\0async_ckpt-keeper/{uid}/{dev}/{ino}/{rank}".encode()


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of ``sock``, as the kernel saw it connect."""
    pid, uid, _ = _CREDENTIALS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return pid, uid


def check_same_user(sock: socket.socket, what: str) -> int:
    """The peer's pid, once its user is this process's; MemoryTierError otherwise."""
    pid, uid = peer(sock)
    if uid != os.getuid():
        raise MemoryTierError(f"{what} (pid {pid}) belongs to user {uid}, not to this user "
                              f"({os.getuid()}): it is not used. Another user's process holds "
                              "the keeper's address; the memory tier is off, the disk is not")
    return pid


def send(sock: socket.socket, message: dict, fd: Optional[int] = None) -> None:
    """Send one frame, ``fd`` (if any) riding on its header. Raises ``Gone`` when the other side
    is not there any more (or does not take the frame within ``FRAME_TIMEOUT_S``)."""
    payload = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    header = _HEADER.pack(MAGIC, len(payload))
    try:
        if fd is None:
            sock.sendall(header + payload)
            return
        sent = sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [fd]))])
        sock.sendall(header[sent:] + payload)
    except OSError as e:  # a broken pipe, a reset, a timeout: the peer is gone either way
        raise Gone(str(e)) from e


def receive(sock: socket.socket) -> tuple[dict, Optional[int]]:
    """The next frame: its message and the descriptor that came with it (the caller's to close).

    Raises ``Gone`` when the connection ends before a frame begins, MemoryTierError for anything
    that is not a well-formed frame (closing any descriptor that came with it)."""
    header, fds = _receive_header(sock)
    fd = None
    try:
        magic, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise MemoryTierError("the keeper's connection carried something that is not a "
                                  "frame of its protocol")
        if len(fds) > 1:
            raise MemoryTierError(f"a frame carried {len(fds)} descriptors; the protocol "
                                  "sends at most one")
        fd = fds.pop() if fds else None
        budget = MAX_PLAIN_FRAME if fd is None else index_budget(_memory_size(fd))
        if length > min(budget // values.JSON_BYTES_PER_BYTE, MAX_INDEX_BYTES):
            raise MemoryTierError(f"a frame of {length} bytes is larger than its message can be")
        payload = _receive_exactly(sock, length)
        try:
            message = values.parse_json(payload, budget)
        except (ValueError, RecursionError) as e:
            raise MemoryTierError(f"a frame is not the JSON object the protocol sends: {e}") from e
        if not (isinstance(message, dict) and type(message.get("type")) is str):
            raise MemoryTierError("a frame is not a message of the protocol (no type)")
        return message, fd
    except BaseException:
        for other in fds + ([fd] if fd is not None else []):
            os.close(other)
        raise


def _receive_header(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The header's bytes and the descriptors that came with them."""
    header, fds = b"", []
    while len(header) < _HEADER.size:
        try:
            data, ancillary, flags, _ = sock.recvmsg(
                _HEADER.size - len(header), socket.CMSG_SPACE(_MAX_FDS * _FD_SIZE),
                socket.MSG_CMSG_CLOEXEC)
        except OSError as e:
            _close_all(fds)
            raise Gone(str(e)) from e
        for level, kind, blob in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", blob[:len(blob) - len(blob) % _FD_SIZE]).tolist()
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            raise MemoryTierError("a frame carried more descriptors than the protocol sends")
        if not data:
            _close_all(fds)
            if header:
                raise MemoryTierError("the connection ended inside a frame's header")
            raise Gone("the connection was closed")
        header += data
    return header, fds


def _receive_exactly(sock: socket.socket, length: int) -> bytes:
    buffer = bytearray(length)
    view, got = memoryview(buffer), 0
    while got < length:
        try:
            n = sock.recv_into(view[got:])
        except OSError as e:
            raise Gone(str(e)) from e
        if n == 0:
            raise MemoryTierError("the connection ended inside a frame")
        got += n
    return bytes(buffer)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _memory_size(fd: int) -> int:
    """The size of a frame's descriptor, which must be a memfd sealed against shrinking (a staging
    slot is): each side maps the other's memory, and a file cut short under a mapping would
    crash the process that reads it (SIGBUS), so no other descriptor is taken."""
    st = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a file that takes seals
        seals = 0
    if not stat.S_ISREG(st.st_mode) or not seals & fcntl.F_SEAL_SHRINK:
        raise MemoryTierError("a frame carried a descriptor that is not memory sealed against "
                              "shrinking; it is not mapped (a file cut short under a mapping "
                              "would crash the process reading it)")
    return st.st_size


# --- what the messages hold ------------------------------------------------------------------


def layout_message(storages: list[tuple[int, int]], tensors: list[dict]) -> dict:
    """A hold's ``layout``: where each storage sits in the slot, and the tensor records
    (docs/FORMAT.md 3.5, ``storage`` numbering these storages)."""
    return {"storages": [[offset, nbytes] for offset, nbytes in storages], "tensors": tensors}


def parse_layout(layout: Any, size: int) -> tuple[list[HeldStorage], list]:
    """A hold's layout, checked against the slot's ``size``: storages inside it, tensors a list
    (their records are checked by whoever builds tensors on them)."""
    if not (isinstance(layout, dict) and isinstance(layout.get("storages"), list)
            and isinstance(layout.get("tensors"), list)):
        raise MemoryTierError("a hold's layout is malformed")
    storages = []
    for s in layout["storages"]:
        if not (isinstance(s, list) and len(s) == 2 and is_int(s[0]) and is_int(s[1])
                and s[0] + s[1] <= size):
            raise MemoryTierError("a hold's layout names bytes outside its memory")
        storages.append(HeldStorage(s[0], s[1]))
    return storages, layout["tensors"]


def with_checksums(storages: list[HeldStorage], checksums: Any) -> Optional[list[HeldStorage]]:
    """``storages`` with the chunk checksums a hold carries (``xxh3``: made by the trainer's copy,
    one list per storage, one per chunk), or None where it carries none, or not one per chunk
    of every storage: then the keeper makes them."""
    if not (isinstance(checksums, list) and len(checksums) == len(storages)
            and all(isinstance(c, list) and len(c) == chunk_count(s.nbytes)
                    and all(map(is_checksum, c)) for s, c in zip(storages, checksums))):
        return None
    return [HeldStorage(s.offset, s.nbytes, tuple(c)) for s, c in zip(storages, checksums)]


def chunk_count(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


KEEP_MAX = 2
"""Sealed snapshots a keeper holds at most (``hello``'s ``keep``): two where several ranks must
agree on a step, so that a rank that died while staging step N still finds N-1 in the others'."""


def held_message(step: int, tree: Any, tensors: list, storages: list[HeldStorage],
                 steps: list[int]) -> dict:
    """The answer to a query when the keeper holds a sealed snapshot of ``step`` (its memfd rides
    along); ``steps``: every step it holds sealed, oldest first."""
    return {"type": "held", "step": step, "tree": tree, "tensors": tensors,
            "storages": [{"offset": s.offset, "nbytes": s.nbytes, "xxh3": list(s.checksums)}
                         for s in storages], "steps": steps}


@dataclass(frozen=True)
class Held:
    """A held snapshot as a trainer received it, its structure checked: the step, the state
    tree and tensor records (checked further as they are used), the storages and their chunk
    checksums (``HeldStorage``) inside ``size`` bytes of the memfd, and every step the keeper
    holds sealed (``steps``, oldest first, ``step`` among them)."""

    step: int
    tree: Any
    tensors: list
    storages: tuple[HeldStorage, ...]
    steps: tuple[int, ...]


def parse_held(message: dict, size: int, alignment: int) -> Held:
    """The keeper's ``held`` answer for a memfd of ``size`` bytes: every storage inside it, at a
    multiple of ``alignment`` (as a slot places them), with one checksum per chunk. Raises
    MemoryTierError for anything else."""
    step, storages, steps = message.get("step"), message.get("storages"), message.get("steps")
    if not (is_int(step, 0, MAX_STEP - 1) and isinstance(message.get("tree"), dict)
            and isinstance(message.get("tensors"), list) and isinstance(storages, list)
            and isinstance(steps, list) and 0 < len(steps) <= KEEP_MAX and step in steps
            and all(is_int(s, 0, MAX_STEP - 1) for s in steps)):
        raise MemoryTierError("the keeper's answer is malformed")
    parsed = []
    for s in storages:
        if not (isinstance(s, dict) and is_int(s.get("offset")) and is_int(s.get("nbytes"))
                and s["offset"] % alignment == 0 and s["offset"] + s["nbytes"] <= size
                and isinstance(s.get("xxh3"), list) and len(s["xxh3"]) == chunk_count(s["nbytes"])
                and all(map(is_checksum, s["xxh3"]))):
            raise MemoryTierError("the keeper's answer names a storage outside its memory, or "
                                  "without a checksum for each chunk")
        parsed.append(HeldStorage(s["offset"], s["nbytes"], tuple(s["xxh3"])))
    return Held(step, message["tree"], message["tensors"], tuple(parsed), tuple(steps))
