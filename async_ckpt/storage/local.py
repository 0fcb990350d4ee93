"""The local POSIX directory: the only ways the library opens, writes, replaces and deletes files.

``LocalStorage(root)`` is the ``storage.base.Storage`` of a local directory, and also owns the
files that only a local directory has: the ranks' lock files (``storage.locks``) and heartbeat
files. The module functions below are its building blocks, also used directly by the writer for
files outside a checkpoint root (a ``Marker``), and for a shard opened by path.

Durability: a rename is only durable once the directory that holds it is fsynced; a file's
contents only once the file is. Every commit path goes through these helpers so that the order
(write, fsync file, rename, fsync directory) is written down once.

Untrusted directories (docs/SECURITY.md): files are opened only when they are regular files,
checked without blocking (a FIFO would hang the reader, a device could act); deletion removes only
entries whose names are ours (``storage.names.is_ours``), directly inside the given directory,
without following symlinks.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, ContextManager, Iterable, Optional, Type, Union

import numpy

from .base import (DIRECT_ALIGNMENT, UNCOUNTED_SPACE, DataFileSink, ShardSink, ShardSource,
                   Storage)
from ..errors import (CheckpointDirError, CheckpointError, CorruptSnapshotError, DiskFullError,
                      SnapshotWriteError)
from .locks import every_rank_exclusively, lock_path, take_rank_lock
from .names import HEARTBEAT_FILE, PARTIAL_SUFFIX, heartbeat_file_name, is_ours, replacement_name

log = logging.getLogger(__name__)
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_MAX_HEARTBEAT_BYTES = 4096


def fsync_dir(path: str) -> None:
    """Make renames, creations and deletions inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str) -> bool:
    """Create directory ``path`` and any missing parents so that the new entries are durable: the
    parent of every directory found missing is fsynced once it is created. Returns False, having
    fsynced nothing, when ``path`` already was a directory; raises FileExistsError when it (or a
    parent) is something else.

    Several processes may race to create the same directory. One whose mkdir finds it already there
    lost the race: it fsyncs the parent all the same, since the winner may not have yet.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return False
    parent = os.path.dirname(path)
    if parent != path:
        make_dirs(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    fsync_dir(parent)
    return True


def write_all(fd: int, data) -> None:
    """``os.write`` until every byte of ``data`` (any buffer) is written; short writes happen."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


@dataclass(frozen=True)
class Linked:
    """A file's bytes as the file ``path`` holds them, which nothing writes to any more (a
    snapshot's data file): no byte written again. Where the file system can, a clone of it (a
    reflink, ``FICLONE``: a file of its own sharing its blocks, so that rewriting one leaves the
    other whole); else a hard link to it (the same file: rewriting it in place damages ``path``,
    which its checksums then tell); else (another file system) what ``copy`` writes."""

    path: str
    copy: Callable[[BinaryIO], None]


_FICLONE = getattr(fcntl, "FICLONE", 0x40049409)  # Linux's ioctl (_IOW(0x94, 9, int)); in
# fcntl from Python 3.12


def _clone(source: str, path: str, durable: bool) -> bool:
    """Create the new file ``path`` as a clone of ``source`` (``Linked``); False, with nothing
    left at ``path``, where the file system cannot clone (ext4, tmpfs, another file system)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _FICLONE, src)
        finally:
            os.close(src)
        if durable:
            os.fsync(fd)
    except OSError as e:  # EOPNOTSUPP, EXDEV, EINVAL: link or copy instead
        os.close(fd)
        _unlink_quietly(path)
        log.debug("cannot clone %s to %s (%s)", source, path, e.strerror)
        return False
    os.close(fd)
    return True


Content = Union[bytes, Callable[[BinaryIO], None], Linked]
"""A file's bytes, a function that writes them to the (seekable) file it is given (for a file
too large to hold in memory), or an existing file's bytes."""


def _create_file(path: str, data: Content, durable: bool = True) -> None:
    """Create the new file ``path`` holding ``data`` (fsynced when ``durable``; the caller makes
    the directory entry durable)."""
    if isinstance(data, Linked):
        if _clone(data.path, path, durable):
            return
        try:
            os.link(data.path, path, follow_symlinks=False)
            return
        except FileExistsError:
            raise
        except OSError as e:  # EXDEV, EPERM, EMLINK: write the bytes instead
            log.debug("cannot link %s to %s (%s); copying it", data.path, path, e.strerror)
            data = data.copy
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        if callable(data):
            with open(fd, "wb", closefd=False) as f:
                data(f)
        else:
            write_all(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: Content, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers, and a crash, see either the old or the new
    file, whole.

    ``durable``: the new file survives a power cut once this returns; the old one is never removed
    before the new one is durable (the mistake DCP made). Without it (liveness files such as
    heartbeats) nothing is fsynced.
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, replacement_name(os.path.basename(path), os.getpid()))
    _unlink_quietly(tmp)  # a stale one (or a planted link): never written through
    try:
        _create_file(tmp, data, durable)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if durable:
        fsync_dir(directory)


def atomic_directory(path: str, files: Iterable[tuple[str, Content]]) -> None:
    """Make ``path`` a directory holding ``files`` ((name, content) pairs, names of one path
    component), all at once and durably: readers, and a crash, see no directory (or the one it
    replaces) or the whole new one. The files are written and fsynced in a fresh sibling, which
    is then renamed to ``path``; a directory already at ``path`` is moved aside first and removed
    after."""
    path = os.path.abspath(path)
    parent, base = os.path.split(path)
    make_dirs(parent)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        for name, data in files:
            if not name or name in (".", "..") or os.sep in name or "\0" in name:
                raise ValueError(f"{name!r} is not a file name")
            _create_file(os.path.join(tmp, name), data)
        os.chmod(tmp, 0o777 & ~umask())  # as mkdir would have made it, not mkdtemp's 0700
        fsync_dir(tmp)
        aside = None
        if os.path.lexists(path):
            aside = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(path, os.path.join(aside, base))
        os.rename(tmp, path)
        fsync_dir(parent)
    except BaseException:
        remove_tree(tmp)
        raise
    if aside is not None:
        remove_tree(aside)


def free_space(path: str) -> int:
    """Bytes free for new files under ``path``; ``UNCOUNTED_SPACE`` where its file system reports
    a size of 0 (ramfs, some FUSE file systems), which keeps no count to check against."""
    usage = shutil.disk_usage(path)
    return usage.free if usage.total else UNCOUNTED_SPACE


def umask() -> int:
    """The process's umask: the permissions an ``open``/``mkdir`` would give, for files made with
    ``tempfile``'s private ones first."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def ensure_writable_dir(path: str) -> str:
    """Create ``path`` if needed (durably: see ``make_dirs``) and check it is a writable directory;
    returns its absolute path."""
    path = os.path.abspath(os.fspath(path))
    try:
        make_dirs(path)
    except FileExistsError as e:
        raise CheckpointDirError(f"{path} exists and is not a directory; pass a directory path") from e
    except OSError as e:
        raise CheckpointDirError(
            f"cannot create checkpoint directory {path}: {e.strerror}; "
            "create it yourself or choose a writable location") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointDirError(
            f"checkpoint directory {path} is not writable by this process; fix its permissions "
            "or choose another directory")
    return path


def write_error(exc: OSError, what: str) -> SnapshotWriteError:
    """Turn an OSError raised while writing ``what`` into the library's typed error."""
    if exc.errno in _DISK_FULL_ERRNOS:
        return DiskFullError(
            f"disk full while writing {what}: {exc.strerror}. Free space (or lower keep_last), "
            "then snapshot again; committed snapshots are intact")
    return SnapshotWriteError(
        f"writing {what} failed: {exc.strerror or exc}. Committed snapshots are intact; "
        "check the file system, then snapshot again")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_regular(path: str, error: Type[CheckpointError], flags: int = os.O_RDONLY) -> int:
    """A file descriptor of ``path``, which must be a regular file (a symlink to one is followed).

    Opened with O_NONBLOCK so that a FIFO planted in the directory cannot hang the caller, and
    checked with fstat on the open descriptor. FileNotFoundError propagates (callers say what a
    missing file means); anything else that is not a readable regular file raises ``error``.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise error(f"{path} is not a regular file; the checkpoint directory was tampered with")
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL
        raise error(f"cannot open {path!r}: {getattr(e, 'strerror', None) or e}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path} is not a regular file; the checkpoint directory was tampered with")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int, error: Type[CheckpointError]) -> bytes:
    """The whole content of the regular file ``path``, refusing one larger than ``limit`` bytes
    before reading it."""
    fd = open_regular(path, error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{path} has {size} bytes, more than the {limit} a valid one can have")
        data = os.pread(fd, size + 1, 0)
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror}") from e
    finally:
        os.close(fd)
    if len(data) > limit:
        raise error(f"{path} grew past {limit} bytes while read")
    return data


def remove_entries(root: str, names: Iterable[str]) -> None:
    """Delete the named entries directly inside ``root``; missing ones are fine.

    Only names of ours are deleted (snapshot directories, shard files, interrupted manifest
    replacements); anything else is logged and left alone. A symlink is removed as a link, never
    followed, and a directory's tree is removed without following the symlinks inside it.
    """
    for name in names:
        if not is_ours(name):
            log.error("refusing to delete %r under %s: not a name async_ckpt writes", name, root)
            continue
        path = os.path.join(root, name)
        _quietly(remove_tree if os.path.isdir(path) and not os.path.islink(path) else os.unlink,
                 path)


def _quietly(remove: Callable[[str], None], path: str) -> None:
    """``remove(path)``: a missing entry is fine, any other failure is logged and left."""
    try:
        remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not delete %s: %s", path, e.strerror)


def remove_tree(top: str) -> None:
    """Remove the directory ``top`` and everything below it, without following links and
    without recursion (``shutil.rmtree`` recurses: a leftover 1,100 directories deep raised
    RecursionError). Each directory is listed once; what cannot be removed is logged and left."""
    stack, listed = [top], set()
    while stack:
        path = stack[-1]
        if path in listed:  # its children are gone (or logged): now the directory itself
            stack.pop()
            _quietly(os.rmdir, path)
            continue
        listed.add(path)
        try:  # opened without following a link: one swapped in is unlinked, never entered
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as e:  # a link (ELOOP, ENOTDIR), ENAMETOOLONG far down, EACCES
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                stack.pop()
                listed.discard(path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                log.warning("could not list %s: %s", path, e.strerror)
            continue
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(os.path.join(path, entry.name))
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.name, dir_fd=fd)
        except OSError as e:
            log.warning("could not list %s: %s", path, e.strerror)
        finally:
            os.close(fd)


def tree_bytes(path: str) -> int:
    """Bytes of the files at or under ``path`` (0 when it vanished), links not followed, walked
    without recursion (``os.walk`` recurses)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(info.st_mode):
        return info.st_size
    total, stack = 0, [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        total += _size_of(entry) or 0
        except OSError:  # vanished, unreadable, too long a path: not counted
            continue
    return total


WRITE_PIECE_BYTES = 1 << 20
"""Bytes per ``write`` call of a shard. Buffered writes of 2 MiB and more cost 2-4x as much per
byte as 1 MiB ones on the VMs measured (docs/performance.md), and smaller pieces gain nothing."""

WRITE_BACK_WINDOW_BYTES = 64 << 20
"""A shard's write-back window: once this many bytes are written, the kernel is told to start
writing them to disk, and the writer waits for the window before them to be on disk. Dirty pages
stay under two windows, so the kernel never throttles the writer for a burst of dirty memory,
the disk is busy while the writer still copies, and the final fsync has at most two windows left.
Pages stay cached (nothing is dropped), so a restore right after a snapshot reads from memory.
Chosen by measurement (256 MB to 2 GB, 16-128 MiB windows; bench/ reports the result)."""

_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


def _load_sync_file_range():
    """libc's ``sync_file_range`` (Linux; not in the os module), or None where there is none. A
    ctypes call releases the GIL while the kernel works."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


class WriteBack:
    """Drives the write-back window of one file written front to back (see
    ``WRITE_BACK_WINDOW_BYTES``): ``wrote(end)`` after each write, with the file's size so far.

    Where the file system cannot (EINVAL, ESPIPE, ENOSYS, no ``sync_file_range`` at all) it stops
    and leaves everything to the final fsync; a real error (EIO, ENOSPC) raises OSError as a
    failed write would."""

    _UNSUPPORTED = {errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP}

    def __init__(self, fd: int, window: int = WRITE_BACK_WINDOW_BYTES):
        self._fd, self._window = fd, window
        self._enabled = _sync_file_range is not None
        self._started = 0  # write-back has been started for [0, _started)
        self._previous: Optional[tuple[int, int]] = None  # the range started last

    def wrote(self, end: int) -> None:
        if not self._enabled or end - self._started < self._window:
            return
        current = (self._started, end - self._started)
        if self._call(*current, _SYNC_FILE_RANGE_WRITE) and self._previous is not None:
            self._call(*self._previous, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
                       | _SYNC_FILE_RANGE_WAIT_AFTER)
        self._started, self._previous = end, current

    def _call(self, offset: int, length: int, flags: int) -> bool:
        if _sync_file_range(self._fd, offset, length, flags) == 0:
            return True
        code = ctypes.get_errno()
        if code in self._UNSUPPORTED:
            self._enabled = False
            return False
        raise OSError(code, os.strerror(code))


DIRECT_PIECE_BYTES = 4 << 20
"""Bytes per direct write from a staging slot's memory. Measured on this VM (ext4, 256 MB and
1 GB, docs/performance.md): 4 MiB pieces need half the CPU of 1 MiB ones (0.05 against 0.11 CPU
seconds per GB) at the same speed."""

DIRECT_IN_FLIGHT = 4
"""Direct writes in flight at once, each on a thread of its own (``pwritev`` releases the GIL):
the disk always has the next piece queued. 2 and 4 measured within noise of 8 here."""

BOUNCE_BYTES = 1 << 20
"""Bytes of each aligned bounce buffer: what cannot go straight from its memory (the header,
compressed chunks, small storages, the index) is copied into one and written direct from there."""


class _BufferedWrites:
    """Writes through the page cache, in pieces of ``WRITE_PIECE_BYTES`` under a ``WriteBack``
    window: both measured to make the bytes durable at the disk's speed where direct I/O is not
    to be had. Every write has returned by the time ``write`` does."""

    def __init__(self, fd: int):
        self._fd, self._written = fd, 0
        self._write_back = WriteBack(fd)

    def write(self, view: memoryview) -> None:
        for start in range(0, len(view), WRITE_PIECE_BYTES):
            piece = view[start:start + WRITE_PIECE_BYTES]
            write_all(self._fd, piece)
            self._written += len(piece)
            self._write_back.wrote(self._written)

    def writes_directly(self, view: memoryview) -> bool:
        return False

    def settle(self) -> None:
        pass

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """``pwritev`` until every byte of ``view`` is at ``offset``; a write that makes no progress
    is a full disk."""
    while view:
        written = os.pwritev(fd, [view], offset)
        if written == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[written:], offset + written


def _address(view: memoryview) -> int:
    """Where ``view``'s first byte is in memory (read-only buffers too)."""
    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


class _DirectWrites:
    """Writes with ``O_DIRECT`` (the file descriptor has it), ``DIRECT_IN_FLIGHT`` at a time on
    threads: a buffer appended at an aligned offset from aligned memory goes to the disk from
    that memory, in pieces of ``DIRECT_PIECE_BYTES``; every other byte through aligned bounce
    buffers. Nothing enters the page cache and the writing needs almost no CPU (docs/
    performance.md). ``end`` pads the last block with zeros and cuts the file back to its
    length."""

    def __init__(self, fd: int):
        self._fd = fd
        self._pool = ThreadPoolExecutor(DIRECT_IN_FLIGHT, "shard-write")
        self._in_flight: collections.deque = collections.deque()  # (future, bounce or None)
        self._spare: list[mmap.mmap] = []
        self._bounces = 0
        self._bounce: Optional[mmap.mmap] = None  # holds [_end - _fill, _end), aligned start
        self._fill = 0
        self._end = 0  # bytes appended so far

    def writes_directly(self, view: memoryview) -> bool:
        return len(view) >= DIRECT_ALIGNMENT and _address(view) % DIRECT_ALIGNMENT == 0

    def write(self, view: memoryview) -> None:
        if self._end % DIRECT_ALIGNMENT == 0 and self.writes_directly(view):
            self._send_bounce()  # an aligned end: the bounce holds whole blocks
            direct = len(view) - len(view) % DIRECT_ALIGNMENT
            for start in range(0, direct, DIRECT_PIECE_BYTES):
                self._submit(view[start:min(start + DIRECT_PIECE_BYTES, direct)],
                             self._end + start, None)
            self._end += direct
            view = view[direct:]
        while view:
            if self._bounce is None:
                self._bounce = self._take_bounce()
            n = min(len(view), BOUNCE_BYTES - self._fill)
            self._bounce[self._fill:self._fill + n] = view[:n]
            self._fill, self._end, view = self._fill + n, self._end + n, view[n:]
            if self._fill == BOUNCE_BYTES:
                self._send_bounce()

    def _send_bounce(self, length: Optional[int] = None) -> None:
        if self._fill:
            length = length or self._fill
            self._submit(memoryview(self._bounce)[:length], self._end - self._fill, self._bounce)
            self._bounce, self._fill = None, 0

    def _take_bounce(self) -> mmap.mmap:
        while not self._spare and self._bounces > DIRECT_IN_FLIGHT:
            self._complete_oldest()
        if self._spare:
            return self._spare.pop()
        self._bounces += 1
        return mmap.mmap(-1, BOUNCE_BYTES)  # anonymous: page-aligned

    def _submit(self, view: memoryview, offset: int, bounce: Optional[mmap.mmap]) -> None:
        while len(self._in_flight) >= DIRECT_IN_FLIGHT:
            self._complete_oldest()
        self._in_flight.append((self._pool.submit(_write_at, self._fd, view, offset), bounce))

    def _complete_oldest(self) -> None:
        future, bounce = self._in_flight.popleft()
        try:
            future.result()
        finally:
            if bounce is not None:
                self._spare.append(bounce)

    def settle(self) -> None:
        while self._in_flight:
            self._complete_oldest()

    def end(self) -> None:
        """Write what the bounce buffer holds, the last block padded with zeros, and wait for
        every write; the file is then cut back to the bytes appended."""
        pad = -self._fill % DIRECT_ALIGNMENT
        if pad:
            self._bounce[self._fill:self._fill + pad] = bytes(pad)
        self._send_bounce(self._fill + pad)
        self.settle()
        if pad:
            os.ftruncate(self._fd, self._end)

    def close(self) -> None:
        """Wait for every write still in flight (their errors no longer matter), then stop."""
        for future, _ in self._in_flight:
            future.cancel()
        self._pool.shutdown(wait=True)
        self._in_flight.clear()


_refusals_logged: set[int] = set()  # the file systems (st_dev) where O_DIRECT was refused


def _open_new(path: str, direct: bool) -> tuple[int, bool]:
    """Create ``path``; with ``direct``, opened for direct I/O where its file system takes it
    (the open and one aligned write of a block, which the shard's header overwrites). Returns
    the file descriptor and whether it writes direct; a refusal is logged once per file
    system."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if not direct:
        return os.open(path, flags, 0o644), False
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _log_refusal(path, e)
        _unlink_quietly(path)  # Linux creates the file before it refuses O_DIRECT: ours (O_EXCL)
        return os.open(path, flags, 0o644), False
    try:
        _write_at(fd, memoryview(mmap.mmap(-1, DIRECT_ALIGNMENT)), 0)  # anonymous: aligned
        return fd, True
    except OSError as e:
        if e.errno != errno.EINVAL:
            os.close(fd)
            raise
        _log_refusal(path, e)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    os.ftruncate(fd, 0)
    return fd, False


def _log_refusal(path: str, e: OSError) -> None:
    device = os.stat(os.path.dirname(path) or ".").st_dev
    if device not in _refusals_logged:
        _refusals_logged.add(device)
        log.warning("the file system of %s refuses direct I/O (%s): shards there are written "
                    "through the page cache, which needs more CPU", os.path.dirname(path),
                    e.strerror)


class LocalShardSink(ShardSink):
    """A new file written at ``path`` and renamed to ``final`` once durable (``final`` may be
    ``path`` itself: renaming a file onto itself does nothing). With ``direct``, written with
    direct I/O where the file system allows it (``_DirectWrites``), else through the page cache
    (``_BufferedWrites``)."""

    def __init__(self, path: str, final: str, direct: bool = False):
        self._path, self._final = path, final
        self._fd, self.direct = _open_new(path, direct)
        self._writes = _DirectWrites(self._fd) if self.direct else _BufferedWrites(self._fd)
        self._renamed = False

    def write(self, buffers: Iterable) -> None:
        for b in buffers:
            self._writes.write(memoryview(b).cast("B"))

    def settle(self) -> None:
        self._writes.settle()

    def writes_directly(self, data) -> bool:
        return self._writes.writes_directly(memoryview(data).cast("B"))

    def finish(self) -> None:
        self._writes.end()
        os.fsync(self._fd)
        self._close()
        os.rename(self._path, self._final)  # the final name says: these bytes are durable
        self._renamed = True
        fsync_dir(os.path.dirname(self._final))

    def abort(self) -> None:
        self._close()
        if not self._renamed:
            remove_entries(os.path.dirname(self._path), [os.path.basename(self._path)])

    def _close(self) -> None:
        if self._fd >= 0:
            self._writes.close()
            os.close(self._fd)
            self._fd = -1


class LocalDataFile(DataFileSink):
    """A new file written as a shard is (pieces of ``WRITE_PIECE_BYTES`` under a ``WriteBack``
    window, so that the disk works while it is written). Read-only (mode 0444): a framework's
    file hard-linked to it is the snapshot's bytes, and a program that rewrote that file in place
    instead of replacing it would damage the snapshot."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                           | os.O_CLOEXEC, 0o444)
        self._position = self._end = 0
        self._write_back = WriteBack(self._fd)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_PIECE_BYTES):
            write_all(self._fd, view[start:start + WRITE_PIECE_BYTES])
            self._position += min(WRITE_PIECE_BYTES, len(view) - start)
            if self._position > self._end:
                self._end = self._position
                self._write_back.wrote(self._end)
        return len(view)

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._position = os.lseek(self._fd, offset, whence)
        return self._position

    def finish(self) -> int:
        os.fsync(self._fd)
        return self._end

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalShardSource(ShardSource):
    """An open regular file (see ``open_shard_file``)."""

    def __init__(self, fd: int, path: str):
        self._fd, self.name = fd, path
        info = os.fstat(fd)
        self.size, self.linked = info.st_size, info.st_nlink > 1

    def read_into(self, buffer, offset: int) -> int:
        return os.preadv(self._fd, [buffer], offset)

    def map(self) -> mmap.mmap:
        return mmap.mmap(self._fd, self.size, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def sibling(self, name: str) -> "LocalShardSource":
        return open_shard_file(os.path.join(os.path.dirname(self.name), name))

    def siblings(self) -> tuple[tuple[str, int], ...]:
        return list_directory(os.path.dirname(self.name))


def new_shard_file(path: str) -> LocalShardSink:
    """A sink writing the new file ``path`` directly (no temporary name): for files outside a
    snapshot directory's protocol, e.g. tests and tools. FileExistsError when it is there."""
    return LocalShardSink(path, path)


def open_shard_file(path: str) -> LocalShardSource:
    """The shard file ``path`` for reading; missing or not a regular file is CorruptSnapshotError
    (a shard that a manifest or a listing names must be there)."""
    try:
        fd = open_regular(path, CorruptSnapshotError)
    except FileNotFoundError as e:
        raise CorruptSnapshotError(f"{path} is missing; the snapshot is incomplete") from e
    try:
        return LocalShardSource(fd, path)
    except BaseException:
        os.close(fd)
        raise


class LocalStorage(Storage):
    """The checkpoint root ``root``, a local directory, with the semantics documented above.
    ``direct_io``: shards are written with direct I/O where the file system allows it
    (``LocalShardSink``)."""

    def __init__(self, root: Union[str, os.PathLike], direct_io: bool = False):
        self.root = os.fspath(root)
        self.direct_io = direct_io

    def location(self, *names: str) -> str:
        return os.path.join(self.root, *names)

    def make_snapshot_dir(self, dir: str) -> None:
        # make_dirs fsyncs the root when it creates the directory; when another rank already had,
        # fsync it anyway: that rank may not have yet. One fsync of the root per snapshot.
        if not make_dirs(self.location(dir)):
            fsync_dir(self.root)

    def create_shard(self, dir: str, file: str) -> LocalShardSink:
        final = self.location(dir, file)
        return LocalShardSink(final + PARTIAL_SUFFIX, final, self.direct_io)

    def create_data_file(self, dir: str, file: str) -> LocalDataFile:
        """(``LocalShardSink.finish`` syncs the directory, so the data file's name is durable
        with the shard's.)"""
        return LocalDataFile(self.location(dir, file))

    def list_snapshot(self, dir: str) -> tuple[tuple[str, int], ...]:
        return list_directory(self.location(dir))

    def sync_snapshot(self, dir: str) -> None:
        fsync_dir(self.location(dir))

    def open_shard(self, dir: str, file: str) -> LocalShardSource:
        return open_shard_file(self.location(dir, file))

    def read_file(self, name: str, limit: int, error: Type[CheckpointError]) -> bytes:
        return read_regular(self.location(name), limit, error)

    def publish(self, name: str, data: bytes) -> None:
        atomic_write(self.location(name), data)

    def version(self, name: str) -> Optional[tuple]:
        """(inode, size, mtime): a replacement always brings a new inode."""
        try:
            st = os.stat(self.location(name))
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.location(name))

    def list_root(self) -> list[str]:
        return sorted(os.listdir(self.root))

    def entry_bytes(self, name: str) -> int:
        return tree_bytes(self.location(name))

    def remove(self, names: Iterable[str]) -> None:
        remove_entries(self.root, names)

    def free_bytes(self) -> int:
        return free_space(self.root)

    # --- what only a local directory has ---------------------------------------------------

    def exclude_engines(self) -> ContextManager[Callable[[], None]]:
        """Every rank's lock held exclusively, without waiting (``storage.locks``)."""
        return every_rank_exclusively(self.root)

    def take_lock(self, rank: int, timeout: float) -> int:
        """An engine's lock of ``rank`` on this directory (``storage.locks.take_rank_lock``): a
        file descriptor; closing it releases the lock."""
        return take_rank_lock(self.root, rank, timeout)

    def lock_file(self, rank: int) -> str:
        """The path of ``rank``'s lock file, which the engine's writer process joins."""
        return lock_path(self.root, rank)

    def identity(self) -> tuple[int, int]:
        """(device, inode) of the directory: what tells it from any other while it exists. A
        directory emptied in place keeps it, and one made anew may get a freed inode again."""
        st = os.stat(self.root)
        return st.st_dev, st.st_ino

    def write_heartbeat(self, rank: int, data: bytes) -> None:
        """Replace ``rank``'s heartbeat file atomically, not durably: it is about liveness now,
        not after a power cut."""
        atomic_write(self.location(heartbeat_file_name(rank)), data, durable=False)

    def heartbeats(self) -> list[bytes]:
        """Every rank's heartbeat file, by name; one that cannot be read (not a regular file,
        too large, gone while listed) is left out: the next beat replaces it. Empty when the
        directory is missing."""
        beats = []
        try:
            names = self.list_root()
        except FileNotFoundError:
            return beats
        for name in filter(HEARTBEAT_FILE.fullmatch, names):
            try:
                beats.append(self.read_file(name, _MAX_HEARTBEAT_BYTES, CheckpointDirError))
            except (OSError, CheckpointDirError):
                continue
        return beats


def list_directory(path: str) -> tuple[tuple[str, int], ...]:
    """The (name, size) of the entries of directory ``path``, sorted (``Storage.list_snapshot``):
    empty also when ``path`` is not a directory (a link is not followed); an entry that vanishes
    while listed (a rename) is left out, and links inside are not followed."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return ()
        with os.scandir(path) as entries:
            found = [(e.name, _size_of(e)) for e in entries]
    except FileNotFoundError:
        return ()
    return tuple(sorted((name, size) for name, size in found if size is not None))


def _size_of(entry: os.DirEntry) -> Optional[int]:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return None
