"""The report's core measurements and what results.json concludes from them: the state-size sweep
(per system and state, a snapshot, a warm and a cold restore), the training loop (each system's
loops paired with loops without checkpointing), the recovery check, the figures and the targets.
Method: docs/performance.md, "What runs" and "Reading the numbers"."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import psutil
import torch

from .floors import FLOOR_KEYS, Floors
from .harness import (FloorHook, RssSampler, files_under, log, ratio_spread, release_free_memory,
                      rss, run_rounds, slope, spread, timed)
from .records import (Cell, Consistency, Damage, FigureValues, NotAvailable, TargetRatio,
                      TargetRow, Targets, Value)
from .systems import (BIG_SYSTEMS, DCP_SAVE, NONE, OURS_ASYNC, OURS_ASYNC_ZSTD, OURS_SYNC,
                      TORCH_SAVE, NoCheckpoint, System, SystemSpec, run_guarded, shutdown_dcp)
from .workloads import TrainingWorkload, build_state


@contextlib.contextmanager
def scratch(prefix: str, parent: Optional[str]):
    """A directory for a run's files (under ``parent``, else the system's temporary directory),
    removed afterwards, with the process group DCP's peers started in this process."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield root
    finally:
        shutdown_dcp()
        shutil.rmtree(root, ignore_errors=True)


# --- the state-size sweep -------------------------------------------------------------------------

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
             shift: int, writer_cpu: bool = False, part: str = "sweep") -> dict:
    """``rounds`` interleaved rounds of ``measure_round`` on one state; a system that fails in
    any is n/a for all. ``part``: the part it measures for (log lines, scratch directory)."""
    state, nbytes = build_state(size_gb, DTYPES[dtype])
    label = case_label(dtype, size_gb)
    running = [s for s in specs if runs_at(s, size_gb)]
    log(f"{part} {label}: {nbytes / 1e9:.3f} GB of tensors, {rounds} rounds of {len(running)} "
        "systems")
    case = {"dtype": dtype, "size_gb": size_gb, "bytes": nbytes,
            "layers": len(state["model"]) // 2, "rounds": rounds}
    directory = os.path.join(root, part)
    floors = Floors(root, nbytes)
    try:
        case.update(run_rounds(running, rounds, shift, floors.measure, lambda index, spec, hook:
                               run_guarded(spec, state, directory, functools.partial(
                                   measure_round, spec, hook, writer_cpu=writer_cpu)),
                               settle_bytes=nbytes))
        case["floor_buffer_bytes"] = floors.buffer_bytes
    finally:
        floors.close()
    skipped = {"available": False, "skipped": True, "reason": SKIPPED}
    case["systems"] = {s.name: case["systems"].get(s.name, skipped) for s in specs}
    return case


def measure_round(spec: SystemSpec, floor_hook: FloorHook, system: System,
                     writer_cpu: bool = False) -> dict:
    """A warm-up snapshot, the measured one, a warm restore right after it in its process, a cold
    one as a restarted process does it; ``floor_hook`` runs before the cleanup (never after a
    deletion). ``writer_cpu``: also the snapshot's wall time to durable and its writer's CPU time."""
    release_free_memory()
    trainer_before, _ = rss()
    with RssSampler(system.writer_pids) as sampler:
        warmup = measure_snapshot(system, 0)
        run = measure_snapshot(system, 1, writer_cpu)
        run["restore_s"] = timed(system.restore)
        details = system.details()
        run["restore_cold_s"] = system.cold_restore_s(system.newest_path())
    log(f"  {spec.name}: blocking {run['blocking_s']:.3f} s, to-commit "
        f"{run['to_commit_s']:.3f} s, restore {run['restore_s']:.3f} s warm, "
        f"{run['restore_cold_s']:.3f} s cold")
    floor_hook()
    return {**run, "warmup": warmup, "details": details,
            "trainer_peak_extra_bytes": sampler.trainer_peak - trainer_before,
            "writer_peak_bytes": sampler.writer_peak}


def measure_snapshot(system: System, step: int, writer_cpu: bool = False) -> dict:
    """One snapshot, waited for, so writes never overlap each other or a floor."""
    cpu, start = _writer_cpu_s(system) if writer_cpu else 0.0, time.perf_counter()
    blocking = timed(lambda: system.save(step))
    system.wait()
    durable = ({"wall_to_durable_s": time.perf_counter() - start,
                "writer_cpu_s": _writer_cpu_s(system) - cpu} if writer_cpu else {})
    record = {"step": step, "blocking_s": blocking, "to_commit_s": system.to_commit_s(),
              "stored_bytes": system.stored_bytes(), **durable}
    details: Optional[dict] = system.details().get("snapshot")
    if details:
        record["engine"] = details
    return record


def _writer_cpu_s(system: System) -> float:
    times = psutil.Process(system.writer_pids()[0]).cpu_times()
    return times.user + times.system


# --- the training loop ----------------------------------------------------------------------------

GROWTH_SKIP = 3  # RSS growth per snapshot: the slope after the first 3, which allocate buffers


def run_training(specs: Sequence[SystemSpec], root: str, ks: Sequence[int], steps: dict,
                 workload_options: dict, rounds: int) -> dict:
    """``systems[name]`` holds ``runs`` (one per round) and the first round's ``consistency``."""
    workload = TrainingWorkload(**workload_options)
    pristine = workload.clone_tensors()
    log(f"training: {workload.nbytes / 1e6:.0f} MB state; K {list(ks)}; steps {steps}; "
        f"{rounds} rounds")
    results = {"state_bytes": workload.nbytes, "workload": workload_options,
               "steps": {str(k): steps[k] for k in ks}, "rounds": rounds}
    directory = os.path.join(root, "train")

    def run_slot(index: int, spec: SystemSpec, floor_hook: FloorHook) -> dict:
        workload.load_tensors(pristine)
        return run_guarded(spec, workload.state, directory, functools.partial(
            measure_training, spec, workload, {k: steps[k] for k in ks}, floor_hook,
            consistency_check=index == 0))

    floors = Floors(root, workload.nbytes)
    try:
        results.update(run_rounds(specs, rounds, 0, floors.measure, run_slot,
                                  settle_bytes=workload.nbytes))
    finally:
        floors.close()
    for block in results["systems"].values():
        if block["available"]:
            block["consistency"] = block["runs"][0].pop("consistency")
    return results


def measure_training(spec: SystemSpec, workload: TrainingWorkload, steps: dict,
                     floor_hook: FloorHook, system: System, consistency_check: bool) -> dict:
    """A warm-up snapshot, ``paired_loops`` under the RSS sampler, then (in the first round)
    ``check_consistency``, whose restores stay out of the loop's RSS."""
    release_free_memory()
    trainer_before, _ = rss()
    after_snapshot: list[tuple[int, int]] = []
    with RssSampler(system.writer_pids) as sampler:
        system.save(0)
        system.wait()
        loops, step = paired_loops(system, workload, steps, 0, after_snapshot)
    trainer_after = [t for t, _ in after_snapshot[GROWTH_SKIP:]]
    writer_after = [w for _, w in after_snapshot[GROWTH_SKIP:]]
    record = {"available": True, "loops": loops,
              "trainer_peak_extra_bytes": sampler.trainer_peak - trainer_before,
              "writer_peak_bytes": sampler.writer_peak,
              "trainer_growth_per_snapshot_bytes": slope(trainer_after),
              "writer_growth_per_snapshot_bytes": slope(writer_after),
              "rss_after_snapshot": after_snapshot}
    if consistency_check:
        record["consistency"] = check_consistency(system, workload, step + 1)
    log(f"  {spec.name}: " + ", ".join(
        f"K={k} {loop['steps_per_s']:.1f} steps/s ({loop['baseline']['steps_per_s']:.1f} without)"
        for k, loop in loops.items()))
    floor_hook()
    return record


def paired_loops(system: System, workload, steps: dict[int, int], step: int,
                 after_snapshot: Optional[list] = None, fenced: bool = False,
                 settle: Callable[[], None] = lambda: None) -> tuple[dict, int]:
    """Per K, ``run_loop`` of ``steps[K]`` steps without checkpointing, then as many with
    ``system``: its loop's figures under ``str(K)``, the first's under its ``baseline``. The loop
    without checkpointing does what the other does around its saves (RSS readings, fences);
    ``settle`` runs before each loop (the GPU's synchronisation)."""
    baseline, loops = NoCheckpoint(workload.state, system.directory), {}
    for k, n in steps.items():
        settle()
        base, step = run_loop(baseline, workload, k, n, step,
                              None if after_snapshot is None else [], fenced)
        settle()
        loops[str(k)], step = run_loop(system, workload, k, n, step, after_snapshot, fenced)
        loops[str(k)]["baseline"] = base
    return loops, step


def run_loop(system: System, workload, k: int, n_steps: int, step: int,
             after_snapshot: Optional[list] = None, fenced: bool = False) -> tuple[dict, int]:
    """``n_steps`` training steps with a save after step ``i`` when ``i % k == 0``; returns the
    loop's figures and the global step reached. ``after_snapshot``: RSS after each save, if a list.
    ``fenced`` (the GPU benchmark's): ``system.fence()`` before the optimizer step after a save
    (the workload's ``before_update``) and at the loop's end, counted in that save's blocking."""
    blocking = []
    pending = [False]  # a save not fenced yet

    def before_update() -> None:
        if pending[0]:
            blocking[-1] += timed(system.fence)
            pending[0] = False

    start = time.perf_counter()
    for i in range(n_steps):
        workload.step(before_update) if fenced else workload.step()
        step += 1
        if i % k == 0:
            blocking.append(timed(lambda: system.save(step)))
            pending[0] = True
            if after_snapshot is not None:
                after_snapshot.append(rss(system.writer_pids()))
    if fenced:
        before_update()
    loop_s = time.perf_counter() - start
    drain_s = timed(system.wait)
    return {"steps": n_steps, "loop_s": loop_s, "steps_per_s": n_steps / loop_s,
            "step_s": loop_s / n_steps, "drain_s": drain_s, "blocking_s": blocking}, step


# --- recovery consistency -------------------------------------------------------------------------

def check_consistency(system: System, workload: TrainingWorkload, step: int) -> Consistency:
    """Is a restore bit-exact, and is one flipped byte caught? On a system with older snapshots,
    so that one that detects damage can fall back."""
    to_commit, expected = snapshot_then_move_on(system, workload, step)
    system.restart()  # restores read the files, as after a crash (not what the process holds)
    restored = system.restore()
    differing = workload.differing_tensors(expected)
    result = functools.partial(Consistency, step, to_commit, restored, differing == 0, differing,
                               len(expected))
    flip_byte(max(files_under(system.newest_path()), key=os.path.getsize))
    system.restart()
    workload.step()
    try:
        with _quietly():  # the fallback's warning is the finding, recorded below
            restored = system.restore()
    except Exception as e:  # noqa: BLE001 - any error is a detection; its type is the finding
        return result(Damage("detected", type(e).__name__))
    differing = workload.differing_tensors(expected)
    if restored is not None and restored != step:
        return result(Damage("detected", f"fell back to step {restored}"))
    if differing:
        return result(Damage("not detected",
                             f"loaded silently; {differing} of {len(expected)} tensors wrong"))
    return result(Damage("no effect", "the flipped byte changed no tensor"))


def snapshot_then_move_on(system: System, workload, step: int) -> tuple[float, list]:
    """``system.saved(step)`` and the state's tensors at it, then two more training steps, so
    that a restore that does nothing is caught."""
    to_commit = system.saved(step)
    expected = workload.clone_tensors()
    workload.step()
    workload.step()
    return to_commit, expected


@contextlib.contextmanager
def _quietly():
    """No warnings or logs below ERROR: a deliberately damaged restore's would read as trouble."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


# --- from the runs: what results.json concludes --------------------------------------------------

def summaries(specs: Sequence[SystemSpec], sweep: dict, training: Optional[dict]) -> dict:
    """results.json's blocks built from the sweep's and the training loop's runs (with typed
    records, which ``records.to_json`` writes)."""
    blocks = {"systems": _availability(specs, sweep, training),
              "floors": _floor_summary(sweep, training),
              "figures": build_figures(sweep, training, specs),
              "targets": build_targets(sweep, specs)}
    if training is not None:
        blocks["consistency"] = {name: block["consistency"] if block["available"]
                                 else NotAvailable(block["reason"])
                                 for name, block in training["systems"].items()}
    return blocks


def _availability(specs: Sequence[SystemSpec], sweep: dict,
                  training: Optional[dict]) -> list[dict]:
    """Per system, in report order: whether it ran, and if it failed somewhere, why."""
    rows = []
    for spec in specs:
        blocks = [c["systems"][spec.name] for c in sweep.values()
                  if not c["systems"][spec.name].get("skipped")]
        if training is not None:
            blocks.append(training["systems"][spec.name])
        failed = [b for b in blocks if not b["available"]]
        rows.append({"name": spec.name, "ours": spec.ours, "ran": len(failed) < len(blocks),
                     "reason": failed[0]["reason"] if failed else None,
                     "failed_cases": len(failed)})
    return rows


def _floor_summary(sweep: dict, training: Optional[dict]) -> dict:
    groups = {label: (c["floors"], c["bytes"]) for label, c in sweep.items()}
    if training is not None:
        groups[f"training state ({training['state_bytes'] / 1e6:.3g} MB)"] = (
            training["floors"], training["state_bytes"])
    summary = {}
    for label, (samples, nbytes) in groups.items():
        summary[label] = {}
        for key in FLOOR_KEYS:
            stats = spread([s[key] for s in samples])
            stem = key.removesuffix("_s")  # the fastest way of each round, where there are several
            ways = ({"fastest": [s[f"{stem}_way"] for s in samples],
                     "ways": [s[f"{stem}_ways"] for s in samples]}
                    if f"{stem}_way" in samples[0] else {})
            summary[label][key] = {**stats, "gbps": nbytes / stats["median"] / 1e9, **ways}
    return summary


@dataclass(frozen=True)
class Figure:
    """``min_best_of_floor``: no peer ratio below this fraction of the floor (noise); ``peer_ratio``
    False: a ratio means nothing (overheads near zero), the best peer is still named."""

    key: str
    title: str
    unit: str
    floor: str
    lower_is_better: bool = True
    min_best_of_floor: float = 0.0
    peer_ratio: bool = True


SWEEP_FIGURES = (
    Figure("blocking_s", "blocking time per snapshot", "s", "one copy_ of the state's bytes"),
    Figure("to_durable_s", "time from snapshot() to durable commit", "s",
           "the fastest way to make the state's bytes durable"),
    Figure("restore_s", "warm restore time into the live model and optimizer, right after the "
           "snapshot (files in the page cache)", "s", "the fastest read of the state's bytes from the page cache"),
    Figure("restore_cold_s", "cold restore time into the live model and optimizer, as a "
           "restarted process restores (files evicted from the page cache)", "s", "the fastest sequential read of the state's bytes from "
           "the disk"),
    Figure("stored_bytes", "bytes written per snapshot", "B", "the state's tensor bytes"),
    Figure("compression_ratio", "compression ratio (tensor bytes / bytes written)", "x",
           "1 (stored raw)", lower_is_better=False),
)
TRAINING_FIGURES = (
    Figure("throughput_steps_s", "training throughput", "steps/s", "no checkpointing",
           lower_is_better=False),
    Figure("step_overhead_pct", "per-step time overhead against the same loop without "
           "checkpointing run just before it", "%", "0 (the paired loop without checkpointing)",
           peer_ratio=False),
    Figure("loop_blocking_s", "blocking time per snapshot in the training loop", "s",
           "one copy_ of the state's bytes"),
)
MEMORY_FIGURES = (
    Figure("trainer_peak_extra_bytes", "peak trainer RSS above its RSS before the first snapshot",
           "B", "the state's tensor bytes", min_best_of_floor=0.01),
    Figure("writer_peak_bytes", "peak RSS of the writer processes", "B",
           "the state's tensor bytes", min_best_of_floor=0.01),
    Figure("rss_growth_per_snapshot_bytes", "RSS growth per snapshot (trainer + writer)", "B",
           "the state's tensor bytes", min_best_of_floor=0.01),
)
FIGURES = SWEEP_FIGURES + TRAINING_FIGURES + MEMORY_FIGURES
SWEEP_SOURCES = {  # figure: (the key of a sweep run, the floor key it is paired with)
    "blocking_s": ("blocking_s", "copy_s"), "to_durable_s": ("to_commit_s", "durable_s"),
    "restore_s": ("restore_s", "read_cache_s"), "restore_cold_s": ("restore_cold_s", "read_cold_s"),
}


def build_figures(sweep: dict, training: Optional[dict],
                  specs: Sequence[SystemSpec]) -> dict[str, FigureValues]:
    """Every figure of the preset's ``specs`` from the sweep's and the training loop's runs."""
    names = [spec.name for spec in specs]
    peers = {spec.name for spec in specs if not spec.ours}
    figures = {f.key: _figure(f, {case: _entries(names, data["systems"], lambda runs: _sweep_entry(
        f.key, runs, data)) for case, data in sweep.items()}, peers) for f in SWEEP_FIGURES}
    if training is None:
        return figures
    blocks, floors = training["systems"], training["floors"]
    for f in TRAINING_FIGURES:
        figures[f.key] = _figure(f, {f"K={k}": {
            **({NONE.name: _none_entry(training, k)} if f.key == "throughput_steps_s" else {}),
            **_entries(names, blocks, lambda runs: _training_entry(f.key, runs, k, floors))}
            for k in training["steps"]}, peers)
    for f in MEMORY_FIGURES:
        figures[f.key] = _figure(f, {"loop": _entries(names, blocks, lambda runs: _memory_entry(
            f.key, runs, training["state_bytes"]))}, peers)
    return figures


def _figure(figure: Figure, by_case: dict[str, dict[str, Value]], peers: set[str]) -> FigureValues:
    """Each case's best peer and every value's ratio to it, laid out by system."""
    best = {}
    for case, entries in by_case.items():
        measured = {n: e for n, e in entries.items() if n in peers and isinstance(e, Cell)}
        if not measured:
            best[case] = None
            continue
        pick = min if figure.lower_is_better else max
        best[case] = pick(measured, key=lambda n: measured[n].median)
        reference = measured[best[case]].median
        meaningful = figure.peer_ratio and \
            reference > figure.min_best_of_floor * (measured[best[case]].floor or 0)
        for name, entry in entries.items():
            if isinstance(entry, Cell):
                entries[name] = replace(entry, x_best_peer=entry.median / reference
                                        if meaningful and reference > 0 else None)
    names = list(next(iter(by_case.values()))) if by_case else []
    return FigureValues(figure.title, figure.unit, figure.floor, figure.lower_is_better,
                        list(by_case), best,
                        {name: {case: by_case[case][name] for case in by_case} for name in names})


def _entries(names: Sequence[str], blocks: dict,
             entry: Callable[[list], Value]) -> dict[str, Value]:
    """Per system of ``names``, ``entry`` of its runs, or why it has none."""
    return {name: NotAvailable("did not run") if blocks.get(name) is None
            else entry(blocks[name]["runs"]) if blocks[name].get("available", True)
            else NotAvailable(blocks[name]["reason"]) for name in names}


def _entry(values: list, floors, **extra) -> Cell:
    """``floors``: one per value (the same round's) or one for all (bytes)."""
    floors = list(floors) if isinstance(floors, (list, tuple)) else [floors] * len(values)
    paired = ratio_spread(values, floors)["median"] if all(floors) else None
    return Cell(**spread(values), floor=spread(floors)["median"] if all(floors) else None,
                x_floor=paired, extra=extra)


def _sweep_entry(key: str, runs: list, case: dict) -> Cell:
    nbytes = case["bytes"]
    if key in SWEEP_SOURCES:
        run_key, floor_key = SWEEP_SOURCES[key]
        return _entry([r[run_key] for r in runs],
                      [case["floors"][r["round"]][floor_key] for r in runs])
    stored = [r["stored_bytes"] for r in runs]
    if key == "stored_bytes":
        return _entry(stored, nbytes)
    return _entry([nbytes / s for s in stored], 1.0)  # compression_ratio


def _none_entry(training: dict, k: str) -> Value:
    """Every loop without checkpointing at ``k`` together: the report's reference row (each
    system's ratios use its own paired loops)."""
    rates = [r["loops"][k]["baseline"]["steps_per_s"] for b in training["systems"].values()
             if b.get("available") for r in b["runs"]]
    return _entry(rates, rates, drain_s=0.0) if rates else NotAvailable("no snapshots")


def _training_entry(key: str, runs: list, k: str, floors: list) -> Cell:
    loops = [r["loops"][k] for r in runs]
    if key == "throughput_steps_s":
        return _entry([lp["steps_per_s"] for lp in loops],
                      [lp["baseline"]["steps_per_s"] for lp in loops],
                      drain_s=spread([lp["drain_s"] for lp in loops])["median"])
    if key == "step_overhead_pct":  # no floor to divide by: the loop's own baseline is its 0
        return _entry([(lp["step_s"] / lp["baseline"]["step_s"] - 1) * 100 for lp in loops], 0.0,
                      step_s=spread([lp["step_s"] for lp in loops]),
                      baseline_step_s=spread([lp["baseline"]["step_s"] for lp in loops]))
    return _entry([spread(lp["blocking_s"])["median"] for lp in loops],
                  [floors[r["round"]]["copy_s"] for r in runs],
                  snapshots=sum(len(lp["blocking_s"]) for lp in loops))


def _memory_entry(key: str, runs: list, state_bytes: int) -> Value:
    if key == "trainer_peak_extra_bytes":
        values = [r["trainer_peak_extra_bytes"] for r in runs]
    elif key == "writer_peak_bytes":
        values = [r["writer_peak_bytes"] for r in runs]
        if not any(values):
            return NotAvailable("writes in the training process: counted in the trainer's RSS")
    else:
        if any(r["trainer_growth_per_snapshot_bytes"] is None for r in runs):
            return NotAvailable(f"fewer than 3 snapshots after the first {GROWTH_SKIP} of a round")
        # whole bytes: the fit's float noise is not growth
        values = [round(r["trainer_growth_per_snapshot_bytes"]
                        + (r["writer_growth_per_snapshot_bytes"] or 0.0)) for r in runs]
    return _entry(values, state_bytes)


# --- the targets of the issue "At the storage floor", on the sweep's paired ratios --------------

MAX_ZSTD_STORED = 0.8  # the zstd target applies where zstd stores at most this fraction of raw


@dataclass(frozen=True)
class Target:
    """``value`` of ``system`` over ``reference_value`` of ``reference`` (None: the floor)."""

    key: str
    title: str
    system: str
    value: str
    reference: Optional[str]
    reference_value: str
    limit: float


TARGETS = (
    Target("async_blocking_x_copy", "async_ckpt async blocking / copy floor (one copy_ of the "
           "state)", OURS_ASYNC.name, "blocking_s", None, "copy_s", 1.5),
    Target("async_durable_x_disk", "async_ckpt async time to durable / disk floor (fastest way "
           "to make the bytes durable)", OURS_ASYNC.name, "to_commit_s", None, "durable_s", 1.1),
    Target("async_durable_x_torch_save", "async_ckpt async time to durable / torch.save + fsync "
           "time to durable", OURS_ASYNC.name, "to_commit_s", TORCH_SAVE.name, "to_commit_s", 0.8),
    Target("zstd_durable_x_async", "async_ckpt async zstd time to durable / async_ckpt async time "
           f"to durable (where zstd stores ≤ {MAX_ZSTD_STORED:g}× raw)", OURS_ASYNC_ZSTD.name,
           "to_commit_s", OURS_ASYNC.name, "to_commit_s", 1.0),
    Target("sync_blocking_x_torch_save", "async_ckpt sync blocking / torch.save + fsync blocking",
           OURS_SYNC.name, "blocking_s", TORCH_SAVE.name, "blocking_s", 1.0),
    Target("async_restore_x_dcp", "async_ckpt async warm restore / DCP save's restore (DCP load)",
           OURS_ASYNC.name, "restore_s", DCP_SAVE.name, "restore_s", 0.5),
    Target("async_restore_x_read", "async_ckpt async warm restore / warm read floor (fastest "
           "read from the page cache)", OURS_ASYNC.name, "restore_s", None, "read_cache_s", 1.2),
    Target("async_cold_restore_x_cold_read", "async_ckpt async cold restore / cold read floor "
           "(fastest read from the disk)", OURS_ASYNC.name, "restore_cold_s", None, "read_cold_s",
           1.1),
)


def build_targets(sweep: dict, specs: Sequence[SystemSpec]) -> Targets:
    """Each target whose systems all ran in this preset, in each fp32 case."""
    ran = {spec.name for spec in specs}
    cases = [label for label, case in sweep.items() if case["dtype"] == "fp32"]
    rows = [TargetRow(t.key, t.title, t.limit, {label: _ratio(t, sweep[label]) for label in cases})
            for t in TARGETS if {t.system, t.reference} - {None} <= ran]
    return Targets(cases, rows)


def _runs(case: dict, name: str) -> Optional[dict]:
    """``{round: run}`` of a system that ran in this case, else None."""
    block = case["systems"].get(name)
    if not block or not block.get("available"):
        return None
    return {run["round"]: run for run in block["runs"]}


def _ratio(target: Target, case: dict) -> Union[TargetRatio, NotAvailable]:
    runs = _runs(case, target.system)
    if runs is None:
        return NotAvailable(f"{target.system} did not run")
    if target.reference is None:
        references = dict(enumerate(case["floors"]))
    else:
        references = _runs(case, target.reference)
        if references is None:
            return NotAvailable(f"{target.reference} did not run")
    if target.system == OURS_ASYNC_ZSTD.name:
        stored = max(run["stored_bytes"] for run in runs.values()) / case["bytes"]
        if stored > MAX_ZSTD_STORED:
            return NotAvailable(f"zstd stored {stored:.2f}× raw")
    rounds = sorted(set(runs) & set(references))
    entry = ratio_spread([runs[i][target.value] for i in rounds],
                         [references[i][target.reference_value] for i in rounds])
    return TargetRatio(**entry, meets=entry["median"] <= target.limit)
