"""State-size sweep: blocking time, time-to-durable, restore time and bytes of every system, for
model + Adam states from tens of MB to GBs (fp32, and bf16), against the floors.

For each state ("case") the systems run one at a time, each in a block: open, one warm-up snapshot
(excluded: it allocates staging buffers, spawns executor processes), ``repeats`` measured snapshots
each followed by ``wait()`` (so writes never overlap each other or a floor), ``restore_repeats``
restores of the newest snapshot, close. One system at a time keeps memory bounded (a 2 GB state,
its staging copy and the floors' two buffers fit in 24 GiB with room for the page cache; all nine
systems open at once would not). Floor samples are interleaved between blocks (every
``floor_every`` blocks; each block records the samples taken just before and after it) and the
figures compare every system with their median; the block order is rotated from case to case so
that no system always runs first.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from .floors import Floors
from .measure import RssSampler, log, release_free_memory, rss, timed
from .systems import System, SystemSpec, Unavailable, run_guarded
from .workloads import build_state

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def size_label(size_gb: float) -> str:
    return f"{size_gb * 1000:g} MB" if size_gb < 1 else f"{size_gb:g} GB"


def case_label(dtype: str, size_gb: float) -> str:
    """The key of a case in results.json and the reports, e.g. ``fp32 256 MB``."""
    return f"{dtype} {size_label(size_gb)}"


def repeats_for(size_gb: float, quick: bool) -> int:
    """Measured snapshots per system: fewer for big states, which are slower and vary less."""
    if quick:
        return 1
    return 5 if size_gb < 0.2 else 3 if size_gb < 1.5 else 1


def run_sweep(specs: Sequence[SystemSpec], cases: Sequence[tuple[str, float]], root: str,
              quick: bool, floor_every: int) -> dict:
    results = {}
    for index, (dtype, size_gb) in enumerate(cases):
        label = case_label(dtype, size_gb)
        shift = index % len(specs)
        order = list(specs[shift:]) + list(specs[:shift])
        results[label] = run_case(order, dtype, size_gb, root, repeats_for(size_gb, quick),
                                  1 if size_gb >= 1 or quick else 2, floor_every)
    return results


def run_case(specs: Sequence[SystemSpec], dtype: str, size_gb: float, root: str, repeats: int,
             restore_repeats: int, floor_every: int) -> dict:
    state, nbytes = build_state(size_gb, DTYPES[dtype])
    label = case_label(dtype, size_gb)
    log(f"sweep {label}: {nbytes / 1e9:.3f} GB of tensors, {repeats} snapshots per system")
    case = {"dtype": dtype, "size_gb": size_gb, "bytes": nbytes,
            "layers": len(state["model"]) // 2, "repeats": repeats, "systems": {}}
    floors = Floors(root, nbytes)
    try:
        before, waiting = floors.measure(), []
        for position, spec in enumerate(specs):
            block = run_block(spec, state, os.path.join(root, "sweep"), repeats, restore_repeats)
            block["floor_before"] = before
            case["systems"][spec.name] = block
            waiting.append(block)
            if (position + 1) % floor_every == 0 or position == len(specs) - 1:
                before = floors.measure()
                for earlier in waiting:
                    earlier["floor_after"] = before
                waiting = []
        case["floors"] = floors.samples
        case["floor_buffer_bytes"] = floors.buffer_bytes
    finally:
        floors.close()
    return case


def run_block(spec: SystemSpec, state: dict, directory: str, repeats: int,
              restore_repeats: int) -> dict:
    """One system on one state: warm-up, measured snapshots, restores. A peer that cannot open or
    fails is reported with the reason; a failure of async_ckpt itself is raised."""
    try:
        system = spec.open(state, directory)
    except Unavailable as e:
        log(f"  {spec.name}: n/a ({e})")
        return {"available": False, "reason": str(e)}
    release_free_memory()
    trainer_before, _ = rss()

    def measure() -> dict:
        with RssSampler(system.writer_pids) as sampler:
            warmup = measure_snapshot(system, 0)
            runs = [measure_snapshot(system, step) for step in range(1, repeats + 1)]
            restores = [timed(system.restore) for _ in range(restore_repeats)]
            details = system.details()
        log(f"  {spec.name}: blocking {[round(r['blocking_s'], 3) for r in runs]} s, to-commit "
            f"{[round(r['to_commit_s'], 3) for r in runs]} s, "
            f"restore {[round(r, 3) for r in restores]} s")
        return {"available": True, "warmup": warmup, "runs": runs, "restore_s": restores,
                "trainer_peak_extra_bytes": sampler.trainer_peak - trainer_before,
                "writer_peak_bytes": sampler.writer_peak, "details": details}

    return run_guarded(spec, system, directory, measure)


def measure_snapshot(system: System, step: int) -> dict:
    """One snapshot, waited for: its blocking time, time-to-durable and size on disk."""
    blocking = timed(lambda: system.save(step))
    system.wait()
    record = {"step": step, "blocking_s": blocking, "to_commit_s": system.to_commit_s(),
              "stored_bytes": system.stored_bytes()}
    details = system.details().get("snapshot")
    if details:
        record["engine"] = details
    return record
