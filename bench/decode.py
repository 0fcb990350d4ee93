"""zstd restores across cores: a warm restore of a zstd snapshot by a child confined to one core
and to every core (method: docs/performance.md, "The data path's choices")."""

from __future__ import annotations

import json
import os
import subprocess
import time

from .markdown import ratio, seconds, section, table
from .measure import log, ratio_spread, spread
from .registry import OURS_ASYNC, OURS_ASYNC_ZSTD
from .rounds import run_rounds
from .workloads import build_state
from .worker import command as command_of

FULL = {"size_gb": 1.0, "rounds": 3}
QUICK = {"size_gb": 0.008, "rounds": 1}  # a child costs a torch import: a smoke test


def _restore_seconds(directory: str, size_gb: float) -> float:
    """In a child: the warm restore time of ``directory``'s snapshot into a fresh state of the same
    shape, after one warm-up restore (which starts the verify threads and faults the pages)."""
    state, _ = build_state(size_gb)
    system = OURS_ASYNC.open(state, directory)
    try:
        system.restore()
        start = time.perf_counter()
        system.restore()
        return time.perf_counter() - start
    finally:
        system.close()


def _in_child(directory: str, size_gb: float, cores: int) -> float:
    """``_restore_seconds`` in a fresh interpreter confined to the first ``cores`` cores."""
    allowed = sorted(os.sched_getaffinity(0))[:cores]
    proc = subprocess.run(
        command_of("decode", dir=directory, size_gb=size_gb),
        preexec_fn=lambda: os.sched_setaffinity(0, allowed), capture_output=True, text=True,
        check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(proc.stdout.strip().splitlines()[-1])["restore_s"]


def run(root: str, quick: bool) -> dict:
    """Save once, restore on 1 core and on all of them in every round; the results block."""
    config = QUICK if quick else FULL
    directory = os.path.join(root, "decode")
    state, nbytes = build_state(config["size_gb"])
    system = OURS_ASYNC_ZSTD.open(state, directory)
    try:
        system.save(1)
    finally:
        system.close()  # waits for the commit
    del state
    every = len(os.sched_getaffinity(0))
    counts = sorted({1, every})

    def restore(index: int, cores: int, floor_hook) -> dict:
        seconds = _in_child(directory, config["size_gb"], cores)
        log(f"  zstd restore on {cores} core(s): {seconds:.3f} s")
        return {"restore_s": seconds}

    record = run_rounds(counts, config["rounds"], 0, dict, restore, name=str)
    samples = {n: [run["restore_s"] for run in record["systems"][str(n)]["runs"]] for n in counts}
    return {"config": config, "state_bytes": nbytes, "cores": counts,
            "restore_s": {str(n): spread(v, samples=True) for n, v in samples.items()},
            "speedup": ratio_spread(samples[1], samples[every])}  # one core's time over all's


def render(block: dict) -> str:
    nbytes = block["state_bytes"]
    rows = [[str(cores), seconds(s), f"{nbytes / s['median'] / 1e9:.2f} GB/s",
             f"{nbytes / s['median'] / 1e9 / cores:.2f} GB/s"]
            for cores, s in ((c, block["restore_s"][str(c)]) for c in block["cores"])]
    return section(
        "zstd restore across cores",
        f"A fp32 {nbytes / 1e9:.3g} GB state saved with `compression=\"zstd\"`, restored warm into "
        "a fresh state of the same shape by a child process confined to 1 core and to every core; "
        f"medians (min–max) of {len(block['restore_s']['1']['samples'])} interleaved rounds, a "
        "warm-up restore first in each child. Throughput counts the state's (decoded) bytes.",
        table(["cores", "warm restore", "decoded", "per core"], rows),
        f"Speed-up of {block['cores'][-1]} cores over 1, round by round: "
        f"{ratio(block['speedup'])}.")


def worker(args) -> None:
    """The child of ``_in_child``: its restore time on stdout."""
    print(json.dumps({"restore_s": _restore_seconds(args.dir, args.size_gb)}))
