"""Direct writes (``direct_io``, the default) against the buffered writer (``direct_io=False``),
quiet and with every core kept busy (method: docs/performance.md, "What runs"; ``--dir``: put it
on the disk you checkpoint to)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

from .core import run_case, runs_at
from .harness import log, ratio_spread, spread
from .markdown import fixed, ratio, seconds, section, spread_text, table
from .systems import OURS_ASYNC, OURS_BUFFERED

FULL = {"sizes_gb": (0.256, 1.0, 2.0), "loads": (0, len(os.sched_getaffinity(0))), "rounds": 3}
QUICK = {"sizes_gb": (0.008,), "loads": (0,), "rounds": 1}
WRITERS = {"direct": OURS_ASYNC, "buffered": OURS_BUFFERED}
assert all(runs_at(spec, max(FULL["sizes_gb"])) for spec in WRITERS.values()), \
    "run_case leaves a system out of sizes it does not run at: both writers must run at all"
PHASES = {"blocking_s": "`snapshot()`", "queue_s": "queued", "write_s": "writing",
          "encode_cpu_s": "of which checksums (CPU)", "fsync_s": "fsync", "commit_s": "commit"}
"""The engine's figures of the snapshot (``stats()``): where its time to durable went."""
FIGURES = ("to_durable_s", "writer_cpu_s_per_gb", "restore_s", "restore_cold_s", *PHASES)
DURABLE_LIMITS = {"quiet": 1.2, "loaded": 1.5}
"""Issue 39's targets: the direct writer's time to durable over the disk floor, by load."""
COLD_RESTORE_LIMIT = 1.2  # its cold restore over the cold read floor
SAME_AS_BUFFERED = 1.1
"""Warm restore and blocking "no slower than today": the direct writer's over the buffered
writer's, round by round, within a tenth (the noise of a cell of three rounds here)."""


@contextmanager
def burners(count: int):
    """``count`` processes that keep a core busy each, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run(root: str, quick: bool) -> dict:
    """The sweep's measurement (``core.run_case``) of both writers at every size and load; the
    results block."""
    config = QUICK if quick else FULL
    cells = []
    for size_gb in config["sizes_gb"]:
        for load in config["loads"]:
            log(f"direct writes, {load} burner(s):")
            with burners(load):
                case = run_case(list(WRITERS.values()), "fp32", size_gb, root, config["rounds"],
                                0, writer_cpu=True, part="direct")
            cells.append(_cell(size_gb, load, case))
    return {"config": {**config, "sizes_gb": list(config["sizes_gb"]),
                       "loads": list(config["loads"])}, "cells": cells}


def _cell(size_gb: float, load: int, case: dict) -> dict:
    nbytes, floors = case["bytes"], case["floors"]
    durable_floor = [f["durable_s"] for f in floors]
    cold_floor = [f["read_cold_s"] for f in floors]
    cell = {"size_gb": size_gb, "burners": load, "state_bytes": nbytes,
            "floors": {"durable_s": spread(durable_floor, samples=True),
                       "read_cold_s": spread(cold_floor, samples=True),
                       "ways": [f["durable_ways"] for f in floors]}}
    for name, spec in WRITERS.items():
        runs = [{"to_durable_s": r["wall_to_durable_s"],
                 "writer_cpu_s_per_gb": r["writer_cpu_s"] / (nbytes / 1e9),
                 "restore_s": r["restore_s"], "restore_cold_s": r["restore_cold_s"],
                 **{key: r["engine"][key] for key in PHASES}}
                for r in case["systems"][spec.name]["runs"]]
        figures = {k: spread([r[k] for r in runs], samples=True) for k in FIGURES}
        figures["to_durable_over_floor"] = ratio_spread([r["to_durable_s"] for r in runs],
                                                        durable_floor)
        figures["cold_restore_over_floor"] = ratio_spread([r["restore_cold_s"] for r in runs],
                                                          cold_floor)
        cell[name] = figures
    return cell


def render(block: dict) -> str:
    rows = []
    for cell in block["cells"]:
        for name in WRITERS:
            f = cell[name]
            rows.append([f"{cell['state_bytes'] / 1e9:.3g} GB", str(cell["burners"]), name,
                         seconds(f["to_durable_s"]), ratio(f["to_durable_over_floor"]),
                         spread_text(f["writer_cpu_s_per_gb"], fixed(2)), seconds(f["restore_s"]),
                         seconds(f["restore_cold_s"]), ratio(f["cold_restore_over_floor"])])
        rows.append(["", "", "floors", seconds(cell["floors"]["durable_s"]), "", "", "",
                     seconds(cell["floors"]["read_cold_s"]), ""])
    return section(
        "Direct writes against the buffered writer",
        f"fp32 states; medians (min–max) of {block['config']['rounds']} interleaved rounds, ratios "
        "round by round to the floors of the same round (the disk floor: the fastest of fio "
        "direct qd8, 1 MiB writes + fsync, ...; the cold read floor), under the same load "
        "(burners: processes spinning on a core each). Writer CPU: the writer process's CPU "
        "seconds per GB of state while the snapshot became durable. Restore: right after the "
        "snapshot, in the same process; cold: its files evicted and the engine opened again (as "
        "a restarted process restores).",
        table(["state", "burners", "writer", "time to durable", "×floor", "writer CPU s/GB",
               "restore", "cold restore", "×cold read"], rows),
        *_targets(block), *_phases(block))


def _targets(block: dict) -> list[str]:
    """Issue 39's targets, cell by cell: met, or missed by how much (the breakdown below says
    where the time went)."""
    rows = []
    for cell in block["cells"]:
        direct, buffered = cell["direct"], cell["buffered"]
        load = "loaded" if cell["burners"] else "quiet"
        checks = [(f"time to durable ÷ disk floor ({load})", DURABLE_LIMITS[load],
                   direct["to_durable_over_floor"]),
                  ("cold restore ÷ cold read", COLD_RESTORE_LIMIT,
                   direct["cold_restore_over_floor"])]
        for key, what in (("restore_s", "restore right after ÷ buffered's"),
                          ("blocking_s", "`snapshot()` ÷ buffered's")):
            if "samples" in direct.get(key, {}):  # (results of older runs kept none)
                checks.append((what, SAME_AS_BUFFERED, ratio_spread(
                    direct[key]["samples"], buffered[key]["samples"])))
        rows += [[f"{cell['state_bytes'] / 1e9:.3g} GB", str(cell["burners"]), what,
                  f"≤ {limit:g}×", ratio(r), "meets" if r["median"] <= limit
                  else f"MISSES by {r['median'] / limit - 1:.0%}"]
                 for what, limit, r in checks]
    return ["The direct writer against issue 39's targets (ratios round by round; \"by\": how far "
            "the median is above the limit):",
            table(["state", "burners", "target", "limit", "direct writer", "verdict"], rows)]


def _phases(block: dict) -> list[str]:
    """Where each time to durable went, by the engine's own figures (none in results of runs
    before they were recorded)."""
    if "write_s" not in block["cells"][0]["direct"]:
        return []
    rows = [[f"{cell['state_bytes'] / 1e9:.3g} GB", str(cell["burners"]), name,
             *(spread_text(cell[name][key], fixed(3)) for key in ("to_durable_s", *PHASES))]
            for cell in block["cells"] for name in WRITERS]
    return ["Where the time to durable went, in seconds, by the engine's `stats()` of the same "
            "snapshots: `snapshot()` (capture and the staging copy, in the training process), "
            "queued (from the job's hand-over to the writer until it starts on it), writing "
            "(checksums and compression run on the writer's threads meanwhile: their CPU "
            "seconds, summed over the threads, in the next column, which can exceed the wall "
            "time), fsync (the index written, the files and the directory fsynced), commit (the "
            "manifest, made durable). What the columns leave out of time to durable is the "
            "messages between the processes.",
            table(["state", "burners", "writer", "time to durable", *PHASES.values()], rows)]
