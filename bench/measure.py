"""Timing, statistics and memory sampling shared by every benchmark in ``bench/``.

The machine these benchmarks run on is noisy (shared, 2 cores, a VM whose freed memory goes back to
the host), so single numbers are never reported: a figure is a median with its p95, and a ratio to a
floor is taken run by run against the floor samples measured just around that run ("paired"), which
is less sensitive to the machine's speed drifting during the run than a ratio of medians.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import time
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


def med_p95(values: Sequence[float]) -> dict:
    return {"median": float(np.median(values)), "p95": float(np.percentile(values, 95))}


def paired_ratio(runs: Sequence[dict], key: str, floor_key: str) -> float:
    """Median over runs of each run's ``key`` / the mean of the two floor samples measured just
    before and just after it (``run["floor_before"]``, ``run["floor_after"]``)."""
    return float(np.median([
        r[key] * 2 / (r["floor_before"][floor_key] + r["floor_after"][floor_key]) for r in runs]))


def slope(values: Sequence[float]) -> Optional[float]:
    """Least-squares growth per item of ``values`` (e.g. RSS after each snapshot); None when there
    are fewer than 3 points, too few to tell growth from noise."""
    if len(values) < 3:
        return None
    return float(np.polyfit(np.arange(len(values)), np.asarray(values, dtype=float), 1)[0])


def rss(pids: Iterable[int] = ()) -> tuple[int, int]:
    """(RSS of this process, summed RSS of ``pids``); processes that are gone count 0."""
    own = psutil.Process().memory_info().rss
    others = 0
    for pid in pids:
        try:
            others += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return own, others


def release_free_memory() -> None:
    """Hand the C heap's free memory back to the kernel (glibc ``malloc_trim``), so that RSS
    measured next starts from what is in use: otherwise a system's transient copies reuse heap
    pages an earlier system freed, and never show in RSS. A no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssSampler:
    """Peak RSS of the trainer (this process) and of a system's writer processes, sampled by a
    background thread, because a snapshot's transient copies (DCP's default stager allocates a fresh
    copy of the state per save) are freed before any call returns and a before/after reading misses
    them. Reading ``/proc/<pid>/statm`` costs tens of microseconds, so sampling every 10 ms perturbs
    training by well under 1%, and equally for every system (the no-checkpoint run included)."""

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


def vmstat() -> dict:
    """Kernel reclaim counters: when they move during the run, memory pressure slowed page-cache
    writes (the floors' and the systems' alike)."""
    keys = ("pgscan_kswapd", "pgscan_direct", "allocstall_normal", "allocstall_movable")
    with open("/proc/vmstat") as f:
        counters = dict(line.split() for line in f)
    return {k: int(counters.get(k, 0)) for k in keys}


def machine() -> dict:
    """What the numbers were measured on; printed with every report."""
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


def dir_bytes(path: str) -> int:
    """Bytes of the files at or under ``path``."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(parent, name))
               for parent, _, names in os.walk(path) for name in names)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (and ``path``'s parent): what it costs to make
    a checkpoint written without fsync durable."""
    for parent, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(parent)
    fsync_dir(os.path.dirname(os.path.abspath(path)))

