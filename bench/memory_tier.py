"""The memory tier (``memory_every=1``): what it costs a training loop, how fast it restores, and
how many steps a real SIGKILL costs against the disk alone (method: docs/memory_tier.md and
docs/performance.md, "What runs")."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import psutil

from async_ckpt.tools.advise import advise

from .markdown import fixed, ms, section, spread_text, table
from .measure import evict, log, ratio_spread, rotated, spread, timed
from .registry import NEVER, OURS_MEMORY
from .workloads import TrainingWorkload, restore_quietly, state_tensors
from .worker import command as command_of

FULL = {"workload": {"width": 768, "depth": 10, "batch": 16}, "steps": 24, "rounds": 3,
        "kills": 3}
QUICK = {"workload": {"width": 128, "depth": 2, "batch": 8}, "steps": 4, "rounds": 1, "kills": 0}
STAGINGS = ("eager", "lazy")
MTBF_S = 24 * 3600.0


def run(root: str, quick: bool) -> dict:
    """The results block of results.json: per round and staging, the loops and restores; the
    kills; and the figures ``render`` shows."""
    config = QUICK if quick else FULL
    workload = TrainingWorkload(**config["workload"])
    log(f"memory tier: {workload.nbytes / 1e6:.0f} MB state, {config['rounds']} rounds")
    rounds = []
    for index in range(config["rounds"]):
        measured = {"copy_s": _copy_floor(workload)}
        for staging in rotated(STAGINGS, index):
            measured[staging] = _loop(workload, os.path.join(root, f"memory-{index}-{staging}"),
                                      staging, config["steps"], restores=staging == "eager")
        rounds.append(measured)
    copy = [r["copy_s"] for r in rounds]
    figures = {staging: {
        "blocking_s": spread([r[staging]["blocking_s"] for r in rounds]),
        "blocking_x_copy": ratio_spread([r[staging]["blocking_s"] for r in rounds], copy),
        "overhead": ratio_spread([r[staging]["step_s"] for r in rounds],
                                 [r[staging]["baseline_step_s"] for r in rounds])}
        for staging in STAGINGS}
    restores = {way: [r["eager"]["restore_s"][way] for r in rounds]
                for way in ("memory", "warm", "cold")}
    figures["restore"] = {
        **{f"{way}_s": spread(times) for way, times in restores.items()},
        **{f"{way}_x_copy": ratio_spread(times, copy) for way, times in restores.items()},
        "memory_x_warm": ratio_spread(restores["memory"], restores["warm"]),
        "memory_x_cold": ratio_spread(restores["memory"], restores["cold"])}
    step_s = spread([r["eager"]["baseline_step_s"] for r in rounds])["median"]
    durable_s = spread([r["eager"]["to_durable_s"] for r in rounds])["median"]
    disk_blocking_s = spread([r["eager"]["disk_blocking_s"] for r in rounds])["median"]
    every = advise(step_s, durable_s, MTBF_S, disk_blocking_s)["interval_steps"]
    kills = [_killed_and_restarted(workload, os.path.join(root, f"kill-{n}"), config)
             for n in range(config["kills"])]
    figures["kills"] = {"advised_every": every, "disk_redone_mean": (every - 1) / 2,
                        "memory_redone": spread([k["redone"] for k in kills]) if kills else None}
    return {"config": config, "state_bytes": workload.nbytes, "copy_floor_s": spread(copy),
            "figures": figures, "rounds": rounds, "kills": kills}


def _copy_floor(workload: TrainingWorkload) -> float:
    """One ``copy_`` of every state tensor into a preallocated twin (the best of three)."""
    sources = state_tensors(workload.state)
    twins = [t.clone() for t in sources]
    return min(timed(lambda: [d.copy_(s) for d, s in zip(twins, sources)]) for _ in range(3))


def _loop(workload: TrainingWorkload, directory: str, staging: str, steps: int,
          restores: bool) -> dict:
    """``steps`` steps without, then with, the memory tier; then (``restores``) the restores."""
    for _ in range(3):  # warm-up: the first steps allocate
        workload.step()
    start = time.perf_counter()
    for _ in range(steps):
        workload.step()
    baseline = (time.perf_counter() - start) / steps
    system = OURS_MEMORY[staging].open(workload.state, directory)
    engine = system.engine
    try:
        engine.snapshot(0)  # the disk's one snapshot, and the slots allocated
        engine.wait()
        disk = engine.stats()["snapshots"][-1]  # for advise: a disk snapshot's costs
        to_durable, disk_blocking = disk["to_commit_s"], disk["blocking_s"]
        blocking, start = [], time.perf_counter()
        for step in range(1, steps + 1):
            workload.step()
            blocking.append(timed(lambda: engine.snapshot(step)))
        step_s = (time.perf_counter() - start) / steps
        measured = {"baseline_step_s": baseline, "step_s": step_s, "to_durable_s": to_durable,
                    "disk_blocking_s": disk_blocking, "blocking_s": spread(blocking)["median"]}
        if restores:
            measured["restore_s"] = _restores(system, workload, directory, steps)
        return measured
    finally:
        system.close()


def _restores(system, workload: TrainingWorkload, directory: str,
              step: int) -> dict:
    """Restore from memory, then from a disk snapshot of the same step: right after it was
    written (from its staging slot), and cold (evicted, in an engine opened again)."""
    engine = system.engine
    expected = workload.clone_tensors()
    deadline = time.monotonic() + 120
    while engine.stats()["memory_step"] != step:  # the keeper seals it off the training process
        if time.monotonic() > deadline:
            raise RuntimeError(f"the keeper did not seal step {step} in 120 s")
        time.sleep(0.005)
    times = {}
    for way in ("memory", "warm", "cold"):
        if way == "warm":  # the restored state, committed as the next step
            engine.snapshot(step + 1, force=True)
            engine.wait()
        if way == "cold":
            evict(directory)
            system.restart()
            engine = system.engine
        workload.step()  # the restore has something to undo
        times[way] = timed(lambda: restore_quietly(engine))
        tier = engine.stats()["restored_from"]
        if tier != ("memory" if way == "memory" else "disk") or workload.differing_tensors(
                expected):
            raise RuntimeError(f"the {way} restore read {tier} or differs from the state")
    return times


def _killed_and_restarted(workload: TrainingWorkload, directory: str, config: dict) -> dict:
    """A child trains with the memory tier and is SIGKILLed after a random step; its restart
    restores. The killed run's last finished step, the restored one, and what it redid."""
    log_path = directory + ".jsonl"
    command = command_of("memory_tier", dir=directory, log=log_path,
                         workload=json.dumps(config["workload"]))
    kill_after = random.randint(20, 60)
    child = subprocess.Popen(command + ["--mode", "train"], start_new_session=True)
    lines = []
    deadline = time.monotonic() + 600
    while not lines or lines[-1].get("step", -1) < kill_after:
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the memory tier's kill run ended before its kill")
        time.sleep(0.002)
        lines = _read_lines(log_path)
    os.killpg(child.pid, signal.SIGKILL)  # the trainer and its writer; the keeper lives on
    child.wait()
    finished = _read_lines(log_path)[-1]["step"]
    restart = subprocess.run(command + ["--mode", "restore"], capture_output=True, text=True, check=True,
                             timeout=600)
    restored = json.loads(restart.stdout.splitlines()[-1])
    keeper = restored["keeper"]
    if keeper is not None and psutil.pid_exists(keeper):
        os.kill(keeper, signal.SIGKILL)  # it would wait out its idle timeout for a restart
    if restored["tier"] != "memory":
        raise RuntimeError(f"the restart restored from {restored['tier']}, not memory")
    return {"finished": finished, "restored": restored["step"],
            "redone": finished - restored["step"]}


def _read_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines(keepends=True)
                if line.endswith("\n")]


def worker(args) -> None:
    """The kill runs' child: ``--mode train`` logs each step once its memory snapshot is taken;
    ``restore`` prints what the restart restored, from which tier, and the keeper's pid."""
    workload = TrainingWorkload(**json.loads(args.workload))
    system = OURS_MEMORY["eager"].open(workload.state, args.dir)
    engine = system.engine
    try:
        if args.mode == "restore":
            step = restore_quietly(engine)
            stats = engine.stats()
            print(json.dumps({"step": step, "tier": stats["restored_from"],
                              "keeper": stats["keeper_pid"]}), flush=True)
            return
        with open(args.log, "a") as log_file:
            for step in range(NEVER):
                workload.step()
                engine.snapshot(step)
                log_file.write(json.dumps({"step": step}) + "\n")
                log_file.flush()
    finally:
        system.close()


def render(block: dict) -> str:
    figures, restore, kills = block["figures"], block["figures"]["restore"], \
        block["figures"]["kills"]
    x = fixed(2)
    rows = [[staging, ms(figures[staging]["blocking_s"]),
             spread_text(figures[staging]["blocking_x_copy"], x, "x"),
             spread_text(figures[staging]["overhead"], x, "x")] for staging in STAGINGS]
    restores = [[way, ms(restore[f"{way}_s"]), spread_text(restore[f"{way}_x_copy"], x, "x")]
                for way in ("memory", "warm", "cold")]
    redone = ("not measured (full runs only)" if kills["memory_redone"] is None
              else spread_text(kills["memory_redone"], fixed(0), " steps"))
    return section(
        "Memory tier (`memory_every=1`)",
        f"State {block['state_bytes'] / 1e6:.0f} MB; copy floor {ms(block['copy_floor_s'])}; "
        f"medians of {block['config']['rounds']} interleaved rounds, min-max in brackets.",
        table(["staging", "blocking per memory snapshot", "÷ copy floor",
               "step time ÷ no checkpointing"], rows),
        table(["restore", "time", "÷ copy floor"], restores),
        f"Restore from memory ÷ warm disk restore: {spread_text(restore['memory_x_warm'], x, 'x')}"
        f"; ÷ cold: {spread_text(restore['memory_x_cold'], x, 'x')}.",
        f"Steps redone after a SIGKILL at a random step: memory tier {redone}; the disk alone at "
        f"the interval `async-ckpt advise` gives here (every {kills['advised_every']} steps, "
        f"MTBF 24 h) {kills['disk_redone_mean']:.1f} on average.")
