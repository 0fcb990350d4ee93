"""Timing, statistics and memory sampling shared by every benchmark in ``bench/``.

The machine these benchmarks run on is noisy (shared, 2 cores, a VM whose freed memory goes back to
the host), so single numbers are never reported: a figure is the median of repetitions interleaved
across systems (``rotated``: every system once per round, in rotating order, so a drift of the
machine hits all alike) with its min-max spread (``spread``), and a ratio to a floor or a peer is
taken round by round ("paired", ``ratio_spread``), which is less sensitive to the machine's speed
drifting during the run than a ratio of medians.
"""

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
    """The one summary of repeated measurements: ``{"median", "min", "max", "n"}`` (and the
    values as ``"samples"``). Min-max rather than a percentile because there are only a few
    (interleaved) repetitions per cell."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values to summarise")
    return {"median": float(np.median(values)), "min": min(values), "max": max(values),
            "n": len(values), **({"samples": values} if samples else {})}


def ratio_spread(values: Sequence[float], references: Sequence[float]) -> dict:
    """``spread`` of the pairwise ratios ``values[i] / references[i]``: each repetition against the
    floor or peer measured in the same round."""
    if len(values) != len(references):
        raise ValueError(f"{len(values)} values against {len(references)} references")
    return spread([v / r for v, r in zip(values, references)])


def rotated(items: Sequence, shift: int) -> list:
    """The order of interleaved round ``shift``: it starts at ``items[shift]`` (modulo their
    number) and walks forward in even rounds, backward in odd ones. Over the rounds no item always
    runs first, and each item follows one neighbour in even rounds and the other in odd ones, so
    that no cell always pays for the same predecessor's write-back."""
    items = list(items)
    start = shift % max(1, len(items))
    step = -1 if shift % 2 else 1
    return [items[(start + step * i) % len(items)] for i in range(len(items))]


def load_now() -> dict:
    """The machine's load at a point of the run: loadavg and the reclaim counters (``vmstat``)."""
    return {"loadavg": list(os.getloadavg()), "vmstat": vmstat()}


def load_between(start: dict, end: dict) -> dict:
    """What the report shows of a round or a case: loadavg at its start and end, and how far the
    reclaim counters moved in between."""
    return {"loadavg_start": start["loadavg"], "loadavg_end": end["loadavg"],
            "vmstat_delta": {k: end["vmstat"][k] - start["vmstat"].get(k, 0)
                             for k in end["vmstat"]}}


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


RECLAIM_KEYS = ("pgscan_kswapd", "pgscan_direct", "allocstall_normal", "allocstall_movable")


def vmstat() -> dict:
    """Kernel reclaim counters: when they move during the run, memory pressure slowed page-cache
    writes (the floors' and the systems' alike)."""
    with open("/proc/vmstat") as f:
        counters = dict(line.split() for line in f)
    return {k: int(counters.get(k, 0)) for k in RECLAIM_KEYS}


SETTLE_BELOW_BYTES = 32 << 20  # "settled": the kernel has less than this left to write
SETTLE_BYTES_PER_S = 100e6  # this VM disk's rate once its write burst is spent: bounds the wait
SETTLE_MAX_S = 30.0
SETTLE_POLL_S = 0.02


@dataclass(frozen=True)
class Settled:
    """One wait for the disk to settle (``settle``): seconds waited, the kernel's unwritten bytes
    (``Dirty`` + ``Writeback``) before and after, and whether the wait ran out first."""

    waited_s: float
    unwritten_before: int
    unwritten_after: int
    timed_out: bool


def unwritten_bytes() -> int:
    """``Dirty`` + ``Writeback`` of ``/proc/meminfo``: page-cache bytes the kernel has yet to
    write; 0 where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return 0
    return sum(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("Dirty", "Writeback"))


def settle(nbytes: int, below: int = SETTLE_BELOW_BYTES, *, clock=time.monotonic,
           sleep=time.sleep) -> Settled:
    """Wait until the kernel has less than ``below`` bytes left to write, at most as long as the
    disk takes to write ``nbytes`` at its slow rate (capped at ``SETTLE_MAX_S``): so that what is
    timed next does not pay for the write-back of what ran before it. Another job's writes can
    keep the machine above ``below``; then the wait runs out, and the result says so."""
    limit = min(SETTLE_MAX_S, nbytes / SETTLE_BYTES_PER_S)
    start = clock()
    before = now = unwritten_bytes()
    while now >= below and clock() - start < limit:
        sleep(SETTLE_POLL_S)
        now = unwritten_bytes()
    return Settled(clock() - start, before, now, now >= below)


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


def dir_bytes(*paths: str) -> int:
    """Bytes of the files at or under ``paths``, a file linked in several places counted once
    (a framework's file linked to a snapshot's data file is one write)."""
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
    """Drop the page-cache pages of every file at or under ``path`` (fsync first, so that they are
    clean and ``POSIX_FADV_DONTNEED`` can drop them): the next read comes from the disk. What a
    "cold" restore and the cold read floor start from."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str, settle: bool = False) -> None:
    """Remove a file or directory tree, if it is there. ``settle``: then fsync its parent, so that
    the deletion is committed before whatever is timed next (on this VM a write right after a
    large delete is slow)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
    parent = os.path.dirname(os.path.abspath(path))
    if settle and os.path.isdir(parent):
        fsync_dir(parent)


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


def standalone(module: str, key: str, run: Callable[[str, bool], dict],
               render: Callable[[dict], str], doc: str) -> int:
    """``python -m bench.MODULE [--quick] [--dir D]``: one benchmark alone, its report section on
    stdout (results under ``key``, as ``python -m bench`` stores them), nothing written under
    bench/results; the scratch directory is removed afterwards."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog=f"python -m bench.{module}",
                                     description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--dir", default=None, help="scratch directory parent (default /tmp)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix=f"bench-{module}-", dir=args.dir)
    try:
        print(render({key: run(root, args.quick)}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
