"""What every part measures with: timing, statistics, disk settling, memory sampling, the rounds
runner, the torchrun workers and their collectives; method (interleaved rounds, medians with
min-max, paired ratios): docs/performance.md, "What runs"."""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import psutil
import torch
import torch.distributed as dist

from async_ckpt.storage.local import fsync_dir

from . import records


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


def after_warmup(rounds: list) -> list:
    """The rounds a figure counts: all but the first, which allocates what later rounds reuse
    (all, where only one ran)."""
    return rounds[1:] or rounds


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


def write_atomic(path: str, text: str) -> None:
    """``text`` to ``path`` through a temporary file: a stopped run never leaves half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_results(out: str, results: dict, render: Callable[[dict], str],
                  write_json: bool = True) -> dict:
    """results.json (with typed records, ``records.to_json``) and report.md written whole, the
    report printed; rendered from the results as results.json holds them, as ``--render`` reads
    them, which are returned."""
    saved = json.dumps(results, indent=1, default=records.to_json)
    results = json.loads(saved)
    text = render(results)
    if write_json:
        write_atomic(os.path.join(out, "results.json"), saved)
    write_atomic(os.path.join(out, "report.md"), text)
    print(text)
    return results


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
    """fsync ``path`` (every file and directory under it, if a directory) and its parent:
    durability for what a peer or a framework writes and never fsyncs."""
    files = [path] if os.path.isfile(path) else []
    for parent, _, names in os.walk(path):
        files += [os.path.join(parent, name) for name in names] + [parent]
    for name in files + [os.path.dirname(os.path.abspath(path))]:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- interleaved rounds (docs/performance.md, "What runs") ----------------------------------------

FloorHook = Callable[[], dict]


class FloorSlot:
    """The round's one floor sample: taken by the first system's hook call, else right after it
    (n/a, failed), so that it never follows a large deletion; later calls return it."""

    def __init__(self, measure: Callable[[], dict]):
        self._measure, self.sample = measure, None

    def take(self) -> dict:
        if self.sample is None:
            self.sample = self._measure()
        return self.sample


def run_rounds(items: Sequence, rounds: int, shift: int, measure_floor: Callable[[], dict],
               run_slot: Callable[[int, object, FloorHook], dict],
               name: Callable[[object], str] = lambda item: item.name,
               settle_bytes: int = 0, budget_s: Optional[float] = None) -> dict:
    """``run_slot(round, item, hook)`` per item and round (``settle_bytes``: what a slot writes;
    ``hook()``: the round's floor sample, to call before the slot's cleanup); an n/a run drops the
    item's earlier runs too, so every available item has one run per round. ``budget_s``: no
    round that would end past this many seconds of rounds."""
    blocks = {name(item): {"available": True, "runs": []} for item in items}
    record: dict = {"systems": blocks, "order": [], "settle": [], "floors": [], "loads": []}
    first, started = load_now(), time.perf_counter()
    for index in range(rounds):
        order = [item for item in rotated(items, shift + index) if blocks[name(item)]["available"]]
        start = load_now()
        slot = FloorSlot(measure_floor)
        settled = []
        for item in order:
            settled.append({"name": name(item), **asdict(settle(settle_bytes))})
            run = run_slot(index, item, slot.take)
            if run.get("available", True):
                blocks[name(item)]["runs"].append({"round": index, **run})
            else:
                blocks[name(item)] = {"available": False, "reason": run["reason"]}
            slot.take()
        slot.take()
        record["order"].append([name(item) for item in order])
        record["settle"].append(settled)
        record["floors"].append(slot.sample)
        record["loads"].append(load_between(start, load_now()))
        elapsed = time.perf_counter() - started
        if budget_s is not None and elapsed * (index + 2) / (index + 1) > budget_s:
            break
    record["load"] = load_between(first, load_now())
    return record


def interleaved(what: str, systems: Sequence[str], rounds: int,
                measure: Callable[[str, int], dict], **options) -> list[dict]:
    """Each round's figures (``one_round``): the rounds of the parts that keep no floors, settles
    or loads."""
    return [one_round(what, systems, n, rounds, measure, **options) for n in range(rounds)]


def one_round(what: str, systems: Sequence[str], n: int, rounds: int,
              measure: Callable[[str, int], dict], before: Callable[[], dict] = dict,
              after: Callable[[], dict] = dict,
              shown: Optional[Callable[[dict], str]] = None) -> dict:
    """Round ``n``: ``before()``, ``measure(system, n)`` of every system in ``rotated`` order,
    ``after()``, merged; a progress line (``shown``, else the top-level seconds) from rank 0."""
    figures = before()
    for system in rotated(systems, n):
        figures.update(measure(system, n))
    figures.update(after())
    if not dist.is_initialized() or dist.get_rank() == 0:
        log(f"{what}: round {n + 1}/{rounds}: " + (shown(figures) if shown else ", ".join(
            f"{key} {value:.3g}" for key, value in figures.items() if isinstance(value, float))))
    return figures


def samples(record: dict, key: str) -> dict[str, list]:
    """Each available item's ``key``, round by round, from a ``run_rounds`` record."""
    return {name: [run[key] for run in block["runs"]]
            for name, block in record["systems"].items() if block["available"]}


def summarised(rounds: list[dict], keys: Iterable[str],
               ratios: Mapping[str, tuple[str, str]]) -> dict:
    """Each key's spread over the rounds after the warm-up (``figures``), and each named
    ``(key, reference)``'s ratio, round by round (``ratios``)."""
    measured = after_warmup(rounds)

    def column(key: str) -> list[float]:
        return [r[key] for r in measured]

    return {"figures": {key: spread(column(key)) for key in keys},
            "ratios": {name: ratio_spread(column(key), column(reference))
                       for name, (key, reference) in ratios.items()}}


@dataclass(frozen=True)
class PartOf:
    """One of a module's parts, for ``parts.PARTS``: its block's key in results.json,
    ``run(root, quick[, rounds])`` (the block) and ``render(block)`` (its section)."""

    key: str
    run: Callable[..., dict]
    render: Callable[[dict], str]


# --- workers: a part's code in a process of its own (a torchrun rank, a child on some cores) ------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(part: str, **options) -> list[str]:
    """The command line of ``part``'s worker, ``bench.PART.worker(args)`` run by ``python -m
    bench.harness PART``: ``size_gb=1`` becomes ``--size-gb 1``."""
    return [sys.executable, "-m", "bench.harness", part,
            *(text for key, value in options.items()
              for text in (f"--{key.replace('_', '-')}", str(value)))]


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.harness")
    parser.add_argument("part")
    for option in ("--dir", "--out", "--phase", "--restore", "--keep", "--log", "--workload",
                   "--mode", "--framework"):
        parser.add_argument(option)
    for option in ("--rounds", "--width", "--layers"):
        parser.add_argument(option, type=int)
    parser.add_argument("--size-gb", type=float, default=0.0)
    return parser.parse_args(argv)


def torchrun(what: str, part: str, world: int, directory: str, size_gb: float, rounds: int,
             *options: str) -> dict:
    """``part``'s worker on ``world`` ranks under torchrun, from the repository root, working in
    ``directory``: what rank 0 wrote (``finish``). What the run printed is shown only if it
    fails."""
    out = directory + ".json"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc-per-node={world}", *command(part, dir=directory, out=out,
                                                    size_gb=size_gb, rounds=rounds)[1:],
              *options]
    log(f"{what}: {' '.join(launch[2:])}")
    done = subprocess.run(launch, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n" + done.stdout[-4000:])
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def finish(out: str, found: dict) -> None:
    """A worker's end: rank 0 writes what it found to ``out`` (``torchrun`` returns it); the
    process group goes while Python is alive, with the objects that hold it, not at exit."""
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(found, f)
    gc.collect()
    dist.destroy_process_group()


def gather(value) -> list:
    """``value`` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective): the slowest rank's time."""
    return _all_reduced(seconds, dist.ReduceOp.MAX)


def slowest_timed(fn: Callable[[], object]) -> float:
    """``fn`` started on every rank at once (a barrier) and timed: the slowest rank's seconds."""
    dist.barrier()
    return slowest(timed(fn))


def total(value: float) -> float:
    """The sum of every rank's ``value`` (a collective): bytes of a state across the ranks."""
    return _all_reduced(value, dist.ReduceOp.SUM)


def _all_reduced(value: float, op) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


if __name__ == "__main__":
    args = _arguments(sys.argv[1:])
    if "LOCAL_RANK" in os.environ:  # under torchrun: several ranks share this machine's cores
        torch.set_num_threads(1)
    importlib.import_module(f"bench.{args.part}").worker(args)
