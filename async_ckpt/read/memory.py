"""How much memory a read may still take, checked before it allocates.

Sizes come from files, so every read that allocates by them asks first. What the machine has
available (psutil) is not what this process may use: under ``ulimit -v`` (``RLIMIT_AS``) or
``RLIMIT_DATA`` an allocation fails long before, and in a container the cgroup's ``memory.max``
kills the process instead. The usable figure is the least of the three.
"""

from __future__ import annotations

import os
import re
import resource
from typing import Callable, Optional, TypeVar

import psutil

from ..errors import InsufficientMemoryError

T = TypeVar("T")


def usable_memory() -> int:
    """Bytes this process may still allocate: the least of the machine's available memory, the
    room left under ``RLIMIT_AS`` and ``RLIMIT_DATA``, and the room left in its cgroup."""
    room = [psutil.virtual_memory().available]
    status = _proc_status()
    for limit, field in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY and field in status:
            room.append(max(0, soft - status[field]))
    cgroup = _cgroup_room()
    if cgroup is not None:
        room.append(cgroup)
    return min(room)


def require_memory(need: int, what: str, todo: str) -> None:
    """InsufficientMemoryError unless ``need`` bytes fit in ``usable_memory()``: "``what`` needs
    X GB of host memory, Y GB is usable now; ``todo``"."""
    usable = usable_memory()
    if need > usable:
        raise InsufficientMemoryError(f"{what} needs {need / 1e9:.2f} GB of host memory, "
                                      f"{usable / 1e9:.2f} GB is usable now; {todo}")


def allocating(allocate: Callable[[], T], nbytes: int, what: str) -> T:
    """``allocate()``, with the allocator's own failure (a torch ``RuntimeError``, a
    ``MemoryError``: memory taken by others since the check) as InsufficientMemoryError."""
    try:
        return allocate()
    except MemoryError as e:
        raise _refused(nbytes, what) from e
    except RuntimeError as e:  # torch's allocators say so in words; any other error is a bug
        if type(e).__name__ != "OutOfMemoryError" and not _ALLOCATOR_FAILED.search(str(e)):
            raise
        raise _refused(nbytes, what) from e


_ALLOCATOR_FAILED = re.compile(r"can't allocate memory|not enough memory|out of memory",
                               re.IGNORECASE)


def _refused(nbytes: int, what: str) -> InsufficientMemoryError:
    return InsufficientMemoryError(f"allocating {nbytes / 1e9:.2f} GB for {what} failed: the "
                                   "memory is not there now; free memory and try again")


def _proc_status() -> dict[str, int]:
    """``/proc/self/status``'s sizes in bytes (empty where there is no /proc)."""
    found = {}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                    found[name] = int(parts[0]) * 1024
    except OSError:
        pass
    return found


def _cgroup_room() -> Optional[int]:
    """Bytes left under this process's cgroup memory limit (v2 ``memory.max``, else v1
    ``memory.limit_in_bytes``), or None where there is none or it cannot be read."""
    try:
        with open("/proc/self/cgroup", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            room = _room(os.path.join(base, "memory.max"), os.path.join(base, "memory.current"))
        elif "memory" in controllers.split(","):
            base = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
            room = _room(os.path.join(base, "memory.limit_in_bytes"),
                         os.path.join(base, "memory.usage_in_bytes"))
        else:
            continue
        if room is not None:
            return room
    return None


def _room(limit_file: str, usage_file: str) -> Optional[int]:
    try:
        with open(limit_file, encoding="ascii") as f:
            limit = f.read().strip()
        with open(usage_file, encoding="ascii") as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit" page count
        return None
    return max(0, int(limit) - usage)
