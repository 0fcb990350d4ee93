"""Timing, statistics, disk settling and memory sampling shared by every benchmark; method
(interleaved rounds, medians with min-max, paired ratios): docs/performance.md, "What runs"."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import psutil
import torch

from async_ckpt.storage.local import fsync_dir


def log(message: str) -> None:
    """Progress goes to stderr so that stdout holds only the report."""
    print(message, file=sys.stderr, flush=True)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread(values: Sequence[float], samples: bool = False) -> dict:
    """``{"median", "min", "max", "n"}``: min-max, not percentiles: a cell has a few rounds."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values to summarise")
    return {"median": float(np.median(values)), "min": min(values), "max": max(values),
            "n": len(values), **({"samples": values} if samples else {})}


def ratio_spread(values: Sequence[float], references: Sequence[float]) -> dict:
    """``spread`` of ``values[i] / references[i]``: each round against its own floor or peer."""
    if len(values) != len(references):
        raise ValueError(f"{len(values)} values against {len(references)} references")
    return spread([v / r for v, r in zip(values, references)])


def rotated(items: Sequence, shift: int) -> list:
    """Round ``shift``'s order: from ``items[shift]``, forward in even rounds, back in odd."""
    items = list(items)
    start = shift % max(1, len(items))
    step = -1 if shift % 2 else 1
    return [items[(start + step * i) % len(items)] for i in range(len(items))]


def load_now() -> dict:
    """Loadavg and the reclaim counters now."""
    return {"loadavg": list(os.getloadavg()), "vmstat": vmstat()}


def load_between(start: dict, end: dict) -> dict:
    """Loadavg at both ends and how far the reclaim counters moved: the report's machine load."""
    return {"loadavg_start": start["loadavg"], "loadavg_end": end["loadavg"],
            "vmstat_delta": {k: end["vmstat"][k] - start["vmstat"].get(k, 0)
                             for k in end["vmstat"]}}


def slope(values: Sequence[float]) -> Optional[float]:
    """Least-squares growth per item; None under 3 points, too few to tell growth from noise."""
    if len(values) < 3:
        return None
    return float(np.polyfit(np.arange(len(values)), np.asarray(values, dtype=float), 1)[0])


def rss(pids: Iterable[int] = ()) -> tuple[int, int]:
    """(RSS of this process, summed RSS of ``pids``); a process that is gone counts 0."""
    own = psutil.Process().memory_info().rss
    others = 0
    for pid in pids:
        try:
            others += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return own, others


def release_free_memory() -> None:
    """glibc ``malloc_trim``, else a system's copies reuse pages another freed, unseen in RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssSampler:
    """Peak RSS of the trainer and the writers, from a thread: transient copies are freed before
    any call returns, so a before/after reading misses them."""

    def __init__(self, writer_pids: Callable[[], Sequence[int]] = lambda: (),
                 interval_s: float = 0.01):
        self.writer_pids, self.interval_s = writer_pids, interval_s
        self.trainer_peak = self.writer_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> "RssSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def sample(self) -> tuple[int, int]:
        trainer, writer = rss(self.writer_pids())
        self.trainer_peak = max(self.trainer_peak, trainer)
        self.writer_peak = max(self.writer_peak, writer)
        return trainer, writer

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


RECLAIM_KEYS = ("pgscan_kswapd", "pgscan_direct", "allocstall_normal", "allocstall_movable")


def vmstat() -> dict:
    """Kernel reclaim counters: when they move, memory pressure slowed page-cache writes."""
    with open("/proc/vmstat") as f:
        counters = dict(line.split() for line in f)
    return {k: int(counters.get(k, 0)) for k in RECLAIM_KEYS}


SETTLE_BELOW_BYTES = 32 << 20  # "settled": the kernel has less than this left to write
SETTLE_BYTES_PER_S = 100e6  # this VM disk's rate once its write burst is spent: bounds the wait
SETTLE_MAX_S = 30.0
SETTLE_POLL_S = 0.02


@dataclass(frozen=True)
class Settled:
    """One ``settle``: seconds waited, unwritten bytes before and after, whether it ran out."""

    waited_s: float
    unwritten_before: int
    unwritten_after: int
    timed_out: bool


def unwritten_bytes() -> int:
    """``Dirty`` + ``Writeback`` of ``/proc/meminfo`` (0 without it)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return 0
    return sum(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("Dirty", "Writeback"))


def settle(nbytes: int, below: int = SETTLE_BELOW_BYTES, *, clock=time.monotonic,
           sleep=time.sleep) -> Settled:
    """Wait out the write-back of what ran before, so that what is timed next does not pay it."""
    limit = min(SETTLE_MAX_S, nbytes / SETTLE_BYTES_PER_S)
    start = clock()
    before = now = unwritten_bytes()
    while now >= below and clock() - start < limit:
        sleep(SETTLE_POLL_S)
        now = unwritten_bytes()
    return Settled(clock() - start, before, now, now >= below)


def machine() -> dict:
    """What the numbers were measured on."""
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
            "cpu_model": _cpu_model(), "ram_bytes": psutil.virtual_memory().total,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "kernel": platform.release(),
            "loadavg_start": os.getloadavg()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def dir_bytes(*paths: str) -> int:
    """Bytes of the files at or under ``paths``; a hard-linked file counts once (one write)."""
    sizes = {}
    for path in paths:
        for name in files_under(path):
            info = os.stat(name)
            sizes[info.st_dev, info.st_ino] = info.st_size
    return sum(sizes.values())


def files_under(path: str) -> list[str]:
    """``path`` itself if it is a file, else every file under it."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(parent, name) for parent, _, names in os.walk(path) for name in names]


def evict(path: str) -> None:
    """Drop the files' cached pages, so that the next read (a cold restore) comes from the disk;
    fsync first, as ``POSIX_FADV_DONTNEED`` drops clean pages only."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str, settle: bool = False) -> None:
    """Remove a file or tree if there; ``settle``: fsync the parent (a write right after a large
    delete is slow here)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
    parent = os.path.dirname(os.path.abspath(path))
    if settle and os.path.isdir(parent):
        fsync_dir(parent)


def fsync_tree(path: str) -> None:
    """fsync everything under ``path`` and its parent: durability for a peer that never fsyncs."""
    for parent, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(parent)
    fsync_dir(os.path.dirname(os.path.abspath(path)))

