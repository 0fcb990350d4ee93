"""State-size sweep: blocking, time to durable, restores and bytes per system and state size;
method: docs/performance.md, "What runs"."""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from .floors import Floors
from .harness import FloorHook, RssSampler, log, release_free_memory, rss, run_rounds, timed
from .systems import BIG_SYSTEMS, System, SystemSpec, run_guarded
from .workloads import build_state

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BIG_GB = 1.0
SKIPPED = f"not run at {BIG_GB:g} GB and above"


def size_label(size_gb: float) -> str:
    return f"{size_gb * 1000:g} MB" if size_gb < 1 else f"{size_gb:g} GB"


def case_label(dtype: str, size_gb: float) -> str:
    """A case's key in results.json and the reports, e.g. ``fp32 256 MB``."""
    return f"{dtype} {size_label(size_gb)}"


def runs_at(spec: SystemSpec, size_gb: float) -> bool:
    return size_gb < BIG_GB or spec.name in BIG_SYSTEMS


def run_sweep(specs: Sequence[SystemSpec], cases: Sequence[tuple[str, float]], root: str,
              rounds: int) -> dict:
    return {case_label(dtype, size_gb): run_case(specs, dtype, size_gb, root, rounds, index)
            for index, (dtype, size_gb) in enumerate(cases)}


def run_case(specs: Sequence[SystemSpec], dtype: str, size_gb: float, root: str, rounds: int,
             shift: int) -> dict:
    """``rounds`` interleaved rounds on one state; a system that fails in any is n/a for all."""
    state, nbytes = build_state(size_gb, DTYPES[dtype])
    label = case_label(dtype, size_gb)
    running = [s for s in specs if runs_at(s, size_gb)]
    log(f"sweep {label}: {nbytes / 1e9:.3f} GB of tensors, {rounds} rounds of {len(running)} "
        "systems")
    case = {"dtype": dtype, "size_gb": size_gb, "bytes": nbytes,
            "layers": len(state["model"]) // 2, "rounds": rounds}
    directory = os.path.join(root, "sweep")
    floors = Floors(root, nbytes)
    try:
        case.update(run_rounds(running, rounds, shift, floors.measure,
                               lambda index, spec, hook: run_round(spec, state, directory, hook),
                               settle_bytes=nbytes))
        case["floor_buffer_bytes"] = floors.buffer_bytes
    finally:
        floors.close()
    skipped = {"available": False, "skipped": True, "reason": SKIPPED}
    case["systems"] = {s.name: case["systems"].get(s.name, skipped) for s in specs}
    return case


def run_round(spec: SystemSpec, state: dict, directory: str, floor_hook: FloorHook) -> dict:
    """One system, one round; ``floor_hook`` runs before the cleanup (never after a deletion)."""

    def measure(system: System) -> dict:
        release_free_memory()
        trainer_before, _ = rss()
        with RssSampler(system.writer_pids) as sampler:
            warmup = measure_snapshot(system, 0)
            run = measure_snapshot(system, 1)
            run["restore_s"] = timed(system.restore)  # right after the snapshot, in its process
            details = system.details()
            run["restore_cold_s"] = system.cold_restore_s(system.newest_path())
        log(f"  {spec.name}: blocking {run['blocking_s']:.3f} s, to-commit "
            f"{run['to_commit_s']:.3f} s, restore {run['restore_s']:.3f} s warm, "
            f"{run['restore_cold_s']:.3f} s cold")
        floor_hook()
        return {**run, "warmup": warmup, "details": details,
                "trainer_peak_extra_bytes": sampler.trainer_peak - trainer_before,
                "writer_peak_bytes": sampler.writer_peak}

    return run_guarded(spec, state, directory, measure)


def measure_snapshot(system: System, step: int) -> dict:
    """One snapshot, waited for, so writes never overlap each other or a floor."""
    blocking = timed(lambda: system.save(step))
    system.wait()
    record = {"step": step, "blocking_s": blocking, "to_commit_s": system.to_commit_s(),
              "stored_bytes": system.stored_bytes()}
    details: Optional[dict] = system.details().get("snapshot")
    if details:
        record["engine"] = details
    return record
