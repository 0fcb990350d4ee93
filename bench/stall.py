"""Stall benchmark: how long a checkpoint stops the training loop, and how long until it is durable.

Two numbers matter for a checkpoint of a training state:

* blocking: the wall-clock time of the call in the training loop (``snapshot()``, or
  ``torch.save`` + fsync), during which training cannot go on;
* to-commit: the time from that call until the snapshot is durable and restorable (the engine's
  ``to_commit_s``; for the blocking systems it equals the blocking time).

Raw seconds mean little on a shared 2-core machine, so each is set against a floor, a physical
limit of this machine measured in the same run:

* copy floor: one ``copy_`` of the state's byte count into a preallocated, pre-faulted CPU buffer.
  An asynchronous checkpoint has to copy the state at least once before training may modify it,
  so this bounds blocking time from below.
* disk floor: the fastest of several ways to make the same byte count durable (``floors.py``:
  ``dd conv=fsync`` with 1 and 8 MiB blocks, 1 MiB ``os.write`` calls then ``fsync``, fio direct
  and buffered). Nothing can make those bytes durable faster, so this bounds to-commit time from
  below (compression off); which way won each sample is printed.
* reads (page cache, cold): the fastest ways of reading the file back, informative only; so is a
  copy into a memfd shared-memory buffer like the engine's staging slots.

The machine is noisy (shared with other jobs; a VM whose freed memory goes back to the host, so
memory touched for the first time in a while, page cache included, is slow), so measurements are
interleaved: after one warm-up snapshot per system (excluded: it allocates the staging buffer),
each of ``--repeats`` rounds runs floor, snapshot, floor, snapshot, ... once per system, in an
order rotated every round, and a last floor closes the run. Each system is compared with the
medians of the floors measured around its own snapshots, and also run by run (paired). Systems: the
engine in async mode without and with zstd, in sync mode, and ``torch.save`` + fsync; in async
mode each snapshot is followed by ``wait()`` so that commits never overlap each other or a floor.

Run as ``python bench/stall.py [--size-gb 1.0] [--repeats 7] [--dir PATH] [--quick] [--json OUT]``.
Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from typing import Optional

if __package__ in (None, ""):  # run as a script, ``python bench/stall.py``: import bench.* too
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.floors import Floors, medians  # noqa: E402
from bench.measure import log, machine, paired_ratio, rotated, rss, spread, vmstat  # noqa: E402
from bench.sweep import measure_snapshot  # noqa: E402
from bench.systems import OURS_ASYNC, OURS_ASYNC_ZSTD, OURS_SYNC, TORCH_SAVE, System  # noqa: E402
from bench.workloads import WIDTH, build_state  # noqa: E402

QUICK_SIZE_GB, QUICK_REPEATS = 0.064, 3
BLOCKING_TARGET, COMMIT_TARGET = 1.5, 1.3  # the core-engine issue: x copy floor, x disk floor
SPECS = (OURS_ASYNC, OURS_ASYNC_ZSTD, OURS_SYNC, TORCH_SAVE)
TARGET_SYSTEM = OURS_ASYNC.name
ENGINE_FIGURES = ("wait_slot_s", "capture_s", "staging_s", "queue_s", "write_s", "fsync_s",
                  "commit_s")


# --- the systems ----------------------------------------------------------------------------------

def open_systems(state: dict, root: str) -> list[System]:
    systems = []
    try:
        for index, spec in enumerate(SPECS):
            systems.append(spec.open(state, os.path.join(root, f"system-{index}")))
    except BaseException:
        close_systems(systems)
        raise
    return systems


def close_systems(systems: list[System]) -> None:
    for system in systems:
        try:
            system.close()
        finally:
            shutil.rmtree(system.directory, ignore_errors=True)


def resources(system: System) -> dict:
    """The engine's memory figures; the trainer's RSS for torch.save."""
    details = system.details()
    return {k: details.get(k) for k in ("trainer_rss", "writer_rss", "writer_shared", "pool_bytes")
            } if details else {"trainer_rss": rss()[0]}


def run_rounds(systems: list, floors: Floors, repeats: int) -> dict:
    """A warm-up snapshot per system, then ``repeats`` rounds of floor / snapshot for each system,
    in an order rotated every round, and a last floor. Each run records the floor samples taken
    just before and just after it."""
    results = {}
    for system in systems:
        log(f"{system.name}: warm-up")
        results[system.name] = {"warmup": measure_snapshot(system, 0), "runs": []}
    previous = None
    for step in range(1, repeats + 1):
        for system in rotated(systems, step - 1):
            sample = floors.measure()
            if previous is not None:
                previous["floor_after"] = sample
            previous = measure_snapshot(system, step)
            previous["floor_before"] = sample
            results[system.name]["runs"].append(previous)
            log(f"round {step}/{repeats} {system.name}: blocking {previous['blocking_s']:.3f} s, "
                f"to-commit {previous['to_commit_s']:.3f} s")
    previous["floor_after"] = floors.measure()
    for system in systems:
        results[system.name]["resources"] = resources(system)
    return results


# --- summary --------------------------------------------------------------------------------------

def summarize(result: dict) -> dict:
    runs = result["runs"]
    floor_samples = [r["floor_before"] for r in runs] + [runs[-1]["floor_after"]]
    floor = {k: entry["median"] for k, entry in medians(floor_samples).items()}
    blocking = spread([r["blocking_s"] for r in runs])
    to_commit = spread([r["to_commit_s"] for r in runs])
    summary = {"blocking_s": blocking, "to_commit_s": to_commit, "floors": floor,
               "blocking_x_copy": blocking["median"] / floor["copy_s"],
               "to_commit_x_disk": to_commit["median"] / floor["durable_s"],
               "blocking_x_copy_paired": paired_ratio(runs, "blocking_s", "copy_s"),
               "to_commit_x_disk_paired": paired_ratio(runs, "to_commit_s", "durable_s"),
               "stored_bytes": spread([r["stored_bytes"] for r in runs])["median"]}
    if "engine" in runs[0]:
        summary["engine_median_s"] = {k: spread([r["engine"][k] for r in runs])["median"]
                                      for k in ENGINE_FIGURES}
    return summary


def targets(summary: dict) -> dict:
    row = summary[TARGET_SYSTEM]
    return {"blocking <= 1.5x copy": {"ratio": row["blocking_x_copy"],
                                      "pass": row["blocking_x_copy"] <= BLOCKING_TARGET},
            "to-commit <= 1.3x disk floor (compression off)": {
                "ratio": row["to_commit_x_disk"], "pass": row["to_commit_x_disk"] <= COMMIT_TARGET}}


# --- report ---------------------------------------------------------------------------------------

def print_report(report: dict) -> None:
    m, s = report["machine"], report["state"]
    print(f"machine: nproc {m['nproc']}, RAM {m['ram_bytes'] / 2**30:.1f} GiB, torch {m['torch']} "
          f"({m['torch_threads']} threads), Python {m['python']}, load avg at start "
          f"{' '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end "
          f"{' '.join(f'{x:.2f}' for x in report['loadavg_end'])}")
    print(f"state: {s['layers']} x Linear({s['width']}, {s['width']}) + Adam, "
          f"{s['bytes'] / 1e9:.3f} GB of "
          f"tensors; {report['config']['repeats']} repeats per system after 1 warm-up")
    gb = s["bytes"] / 1e9
    floors = report["floors_all"]
    print(f"floors, median of {report['floor_samples']} interleaved samples:")
    for key, label in (("copy_s", "copy_ into a pre-faulted buffer"),
                       ("durable_s", "disk (fastest durable write)"),
                       ("read_cache_s", "read (fastest, page cache)"),
                       ("read_cold_s", "read (fastest, cold, from disk)"),
                       ("copy_shm_s", "copy_ into shared memory (memfd-like, info)")):
        print(f"  {label:<44} {floors[key]['median']:7.3f} s  ({floors[key]['min']:.3f}-"
              f"{floors[key]['max']:.3f} s, {gb / floors[key]['median']:5.2f} GB/s)")
    won = Counter(s["durable_way"] for s in report["floors_raw"])
    print("  the disk floor's way: " + ", ".join(f"{way} in {n}" for way, n in won.most_common()))
    print()
    header = (f"{'system':<20} {'blocking s med':>14} {'max':>6} {'x copy (paired)':>15} "
              f"{'copy fl':>7} {'to-commit s med':>15} {'max':>6} {'x disk (paired)':>15} "
              f"{'disk fl':>7} {'stored MB':>9}")
    print(header)
    print("-" * len(header))
    for name, row in report["summary"].items():
        b, c = row["blocking_s"], row["to_commit_s"]
        print(f"{name:<20} {b['median']:14.3f} {b['max']:6.3f} "
              f"{row['blocking_x_copy']:7.2f} ({row['blocking_x_copy_paired']:5.2f}) "
              f"{row['floors']['copy_s']:7.3f} {c['median']:15.3f} {c['max']:6.3f} "
              f"{row['to_commit_x_disk']:7.2f} ({row['to_commit_x_disk_paired']:5.2f}) "
              f"{row['floors']['durable_s']:7.2f} {row['stored_bytes'] / 1e6:9.1f}")
    print("x copy, x disk: the system's median / the median of the floors measured just before its "
          "runs (and after its last); (paired): median of each run / the mean of the floors just "
          "before and after it")
    print()
    print(f"targets ({TARGET_SYSTEM}, medians):")
    for name, t in report["targets"].items():
        print(f"  {name:<40} {t['ratio']:5.2f}x  {'PASS' if t['pass'] else 'MISS'}")
    print()
    print("engine time split, median s: " + ", ".join(k.removesuffix("_s") for k in ENGINE_FIGURES))
    for name, row in report["summary"].items():
        if "engine_median_s" in row:
            print(f"  {name:<20} " + "  ".join(f"{row['engine_median_s'][k]:6.3f}"
                                                for k in ENGINE_FIGURES))
    print()
    print("memory (MB, after the last round, every system open): trainer RSS, writer RSS (of which "
          "shared), staging pool")
    for name, result in report["systems"].items():
        r = result["resources"]
        print(f"  {name:<20} trainer {mb(r.get('trainer_rss'))}, writer {mb(r.get('writer_rss'))} "
              f"({mb(r.get('writer_shared'))}), pool {mb(r.get('pool_bytes'))}")
    print(f"  after the run: trainer RSS {mb(report['trainer_rss_end'])}; every trainer figure "
          f"includes the state ({mb(s['bytes'])}) and this benchmark's floor buffers "
          f"({mb(report['floor_buffer_bytes'])})")
    print("reclaim during the run (/proc/vmstat): "
          + ", ".join(f"{k} {v}" for k, v in report["vmstat_delta"].items()))


def mb(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 1e6:.0f}"


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=None,
                        help="model + Adam state in GB, rounded to whole 50 MB layers (at least "
                             "one); default 1.0, --quick 0.064")
    parser.add_argument("--repeats", type=int, default=None,
                        help="measured snapshots per system (default 7; --quick: 3)")
    parser.add_argument("--dir", default=None,
                        help="where to make the scratch directory (default: /tmp); it is removed")
    parser.add_argument("--quick", action="store_true", help="small state, few repeats: a smoke test")
    parser.add_argument("--json", default=None, metavar="OUT", help="write raw numbers and summary")
    args = parser.parse_args(argv)
    if args.size_gb is None:
        args.size_gb = QUICK_SIZE_GB if args.quick else 1.0
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else 7
    if args.repeats < 1 or args.size_gb <= 0:
        parser.error("--repeats and --size-gb must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    report = {"machine": machine(), "config": vars(args)}
    vmstat_start = vmstat()
    root = tempfile.mkdtemp(prefix="stall-", dir=args.dir or "/tmp")
    try:
        state, nbytes = build_state(args.size_gb, width=WIDTH)
        report["state"] = {"layers": len(state["model"]) // 2, "width": WIDTH, "bytes": nbytes}
        log(f"state: {nbytes / 1e9:.3f} GB; scratch directory {root}")
        floors = Floors(root, nbytes, shm=True)
        try:
            systems = open_systems(state, root)
            try:
                report["systems"] = run_rounds(systems, floors, args.repeats)
            finally:
                close_systems(systems)
        finally:
            floors.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    samples = floors.samples
    report["floor_buffer_bytes"] = floors.buffer_bytes
    report["floor_samples"] = len(samples)
    report["floors_all"] = medians(samples)
    report["floors_raw"] = samples
    report["summary"] = {name: summarize(r) for name, r in report["systems"].items()}
    report["targets"] = targets(report["summary"])
    report["trainer_rss_end"] = rss()[0]
    report["loadavg_end"] = os.getloadavg()
    report["vmstat_delta"] = {k: v - vmstat_start[k] for k, v in vmstat().items()}
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
