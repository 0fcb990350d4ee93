"""A real training loop with a snapshot every K steps: throughput against no checkpointing, blocking
time per snapshot in the loop, memory, and whether a restore is bit-exact and damage is caught.

The systems run in interleaved rounds (``harness.run_rounds``: each once per round, in rotating
order, one training-state floor sample per round). In each round each system starts from the same
model and optimizer values, opens, takes one untimed warm-up snapshot, then for each K runs
``steps[K]`` training steps without checkpointing and right after them the same number with the
system, saving after step ``i`` when ``i % K == 0``; then closes. The overhead is
each loop against the no-checkpoint loop just before it: on a shared machine whose speed drifts by
tens of percent over minutes, only such pairs compare like with like. A loop's time ends with its
last training step: the newest snapshot's write then still overlaps the K - 1 steps a longer run
would do, as every earlier one did; its drain (``wait()``) is timed apart. A save that must wait
for an earlier one (every slot of ours busy, or DCP's and torchsnapshot's one save in flight)
waits inside ``save``, in the loop.

Memory: the trainer's and the writer processes' RSS are sampled throughout (peak above the trainer's
RSS before the first snapshot, with the C heap's free memory handed back first), and read after
every snapshot; growth per snapshot is the slope of those readings after the first three (which
allocate staging buffers).

In the first round only, ``consistency.check`` on the open system: a snapshot, two more steps,
restore, compare bit for bit; then one flipped byte in the snapshot's largest file and another
restore.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

from . import consistency
from .floors import Floors
from .harness import (FloorHook, RssSampler, log, release_free_memory, rss, run_rounds, slope,
                      timed)
from .systems import NoCheckpoint, System, SystemSpec, run_guarded
from .workloads import TrainingWorkload

GROWTH_SKIP = 3


def run_training(specs: Sequence[SystemSpec], root: str, ks: Sequence[int], steps: dict,
                 workload_options: dict, rounds: int) -> dict:
    """``systems[name]`` holds ``runs`` (one per round, ``harness.run_rounds``) and the first
    round's ``consistency``."""
    workload = TrainingWorkload(**workload_options)
    pristine = workload.clone_tensors()
    log(f"training: {workload.nbytes / 1e6:.0f} MB state; K {list(ks)}; steps {steps}; "
        f"{rounds} rounds")
    results = {"state_bytes": workload.nbytes, "workload": workload_options,
               "steps": {str(k): steps[k] for k in ks}, "rounds": rounds}
    directory = os.path.join(root, "train")

    def run_slot(index: int, spec: SystemSpec, floor_hook: FloorHook) -> dict:
        workload.load_tensors(pristine)
        return run_system(spec, workload, directory, ks, steps, floor_hook,
                          consistency_check=index == 0)

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


def run_system(spec: SystemSpec, workload: TrainingWorkload, directory: str, ks: Sequence[int],
               steps: dict, floor_hook: FloorHook, consistency_check: bool) -> dict:
    def measure(system: System) -> dict:
        baseline = NoCheckpoint(workload.state, directory)
        release_free_memory()
        trainer_before, _ = rss()
        after_snapshot: list[tuple[int, int]] = []
        with RssSampler(system.writer_pids) as sampler:
            step = 0
            system.save(step)
            system.wait()
            loops = {}
            for k in ks:
                base, step = run_loop(baseline, workload, k, steps[k], step, [])
                loops[str(k)], step = run_loop(system, workload, k, steps[k], step, after_snapshot)
                loops[str(k)]["baseline"] = base
        trainer_after = [t for t, _ in after_snapshot[GROWTH_SKIP:]]
        writer_after = [w for _, w in after_snapshot[GROWTH_SKIP:]]
        record = {"available": True, "loops": loops,
                  "trainer_peak_extra_bytes": sampler.trainer_peak - trainer_before,
                  "writer_peak_bytes": sampler.writer_peak,
                  "trainer_growth_per_snapshot_bytes": slope(trainer_after),
                  "writer_growth_per_snapshot_bytes": slope(writer_after),
                  "rss_after_snapshot": after_snapshot}
        if consistency_check:  # restores: not in the loop's RSS
            record["consistency"] = consistency.check(system, workload, step + 1)
        log(f"  {spec.name}: " + ", ".join(
            f"K={k} {loop['steps_per_s']:.1f} steps/s ({loop['baseline']['steps_per_s']:.1f} without)"
            for k, loop in loops.items()))
        floor_hook()
        return record

    return run_guarded(spec, workload.state, directory, measure)


def run_loop(system, workload: TrainingWorkload, k: int, n_steps: int, step: int,
             after_snapshot: Optional[list] = None,
             fence: Optional[Callable[[], None]] = None) -> tuple[dict, int]:
    """``n_steps`` training steps with a save after step ``i`` when ``i % k == 0``; returns the
    loop's figures and the global step reached. ``after_snapshot``: RSS after each save, if a list.
    ``fence`` (the GPU benchmark's): called before the optimizer step after a save (the workload's
    ``before_update``) and at the loop's end, counted in that save's blocking time."""
    blocking = []
    pending = [False]  # a save not fenced yet

    def before_update() -> None:
        if pending[0]:
            blocking[-1] += timed(fence)
            pending[0] = False

    start = time.perf_counter()
    for i in range(n_steps):
        if fence is None:
            workload.step()
        else:
            workload.step(before_update)
        step += 1
        if i % k == 0:
            blocking.append(timed(lambda: system.save(step)))
            pending[0] = True
            if after_snapshot is not None:
                after_snapshot.append(rss(system.writer_pids()))
    if fence is not None:
        before_update()
    loop_s = time.perf_counter() - start
    drain_s = timed(system.wait)
    return {"steps": n_steps, "loop_s": loop_s, "steps_per_s": n_steps / loop_s,
            "step_s": loop_s / n_steps, "drain_s": drain_s, "blocking_s": blocking}, step
