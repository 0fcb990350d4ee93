"""The engine's features, a part each, measured on their own: the memory tier (``MEMORY_TIER``,
method: docs/memory_tier.md), incremental snapshots (``INCREMENTAL``), zstd restores across cores
(``DECODE``) and the remote tier (``REMOTE``); method: docs/performance.md, "What runs" and "The
data path's choices"."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator
from unittest import mock

import psutil
import torch

from async_ckpt.format.manifest import read_manifest
from async_ckpt.storage.local import LocalStorage
from async_ckpt.storage.remote import PART_BYTES, TRANSFER_CONCURRENCY, ObjectStorage
from async_ckpt.tools.advise import advise

from .floors import copy_s
from .harness import (REPO, PartOf, command, evict, interleaved, log, ratio_spread, remove,
                      run_rounds, samples, spread, summarised, timed)
from .markdown import fixed, ms, ratio, seconds, section, spread_text, table
from .systems import (NEVER, OURS_ASYNC, OURS_ASYNC_ZSTD, OURS_INCREMENTAL, OURS_MEMORY,
                      OURS_REMOTE)
from .workloads import TrainingWorkload, build_state, restore_quietly, state_tensors, tensor_bytes

if TYPE_CHECKING:  # started in _moto only: the other parts run without tests/ on the path
    from tests.s3server import S3Server

# --- the memory tier (``memory_every=1``): what it costs a training loop, how fast it restores, and
# how many steps a real SIGKILL costs against the disk alone --------------------------------------

MEMORY_TIER_CONFIGS = (  # full, --quick
    {"workload": {"width": 768, "depth": 10, "batch": 16}, "steps": 24, "rounds": 3, "kills": 3},
    {"workload": {"width": 128, "depth": 2, "batch": 8}, "steps": 4, "rounds": 1, "kills": 0})
STAGINGS = ("eager", "lazy")
RESTORE_WAYS = ("memory", "warm", "cold")
MTBF_S = 24 * 3600.0


def run_memory_tier(root: str, quick: bool) -> dict:
    """The results block of results.json: per round and staging, the loops and restores; the
    kills; and the figures ``render_memory_tier`` shows."""
    config = MEMORY_TIER_CONFIGS[quick]
    workload = TrainingWorkload(**config["workload"])
    log(f"memory tier: {workload.nbytes / 1e6:.0f} MB state, {config['rounds']} rounds")
    rounds = interleaved("memory tier", STAGINGS, config["rounds"], lambda staging, index: {
        staging: _loop(workload, os.path.join(root, f"memory-{index}-{staging}"), staging,
                       config["steps"], restores=staging == "eager")},
        before=lambda: {"copy_s": _copy_floor(workload)})
    copy = [r["copy_s"] for r in rounds]

    def column(staging: str, key: str) -> list[float]:
        return [r[staging][key] for r in rounds]

    figures = {staging: {
        "blocking_s": spread(column(staging, "blocking_s")),
        "blocking_x_copy": ratio_spread(column(staging, "blocking_s"), copy),
        "overhead": ratio_spread(column(staging, "step_s"), column(staging, "baseline_step_s"))}
        for staging in STAGINGS}
    restores = {way: [r["eager"]["restore_s"][way] for r in rounds] for way in RESTORE_WAYS}
    figures["restore"] = {
        **{f"{way}_s": spread(times) for way, times in restores.items()},
        **{f"{way}_x_copy": ratio_spread(times, copy) for way, times in restores.items()},
        "memory_x_warm": ratio_spread(restores["memory"], restores["warm"]),
        "memory_x_cold": ratio_spread(restores["memory"], restores["cold"])}
    eager = {key: spread(column("eager", key))["median"]
             for key in ("baseline_step_s", "to_durable_s", "disk_blocking_s")}
    every = advise(eager["baseline_step_s"], eager["to_durable_s"], MTBF_S,
                   eager["disk_blocking_s"])["interval_steps"]
    kills = [_killed_and_restarted(os.path.join(root, f"kill-{n}"), config)
             for n in range(config["kills"])]
    figures["kills"] = {"advised_every": every, "disk_redone_mean": (every - 1) / 2,
                        "memory_redone": spread([k["redone"] for k in kills]) if kills else None}
    return {"config": config, "state_bytes": workload.nbytes, "copy_floor_s": spread(copy),
            "figures": figures, "rounds": rounds, "kills": kills}


def _copy_floor(workload: TrainingWorkload) -> float:
    """One ``copy_`` of every state tensor into a preallocated twin (the best of three)."""
    sources = state_tensors(workload.state)
    twins = [t.clone() for t in sources]
    return min(copy_s(sources, twins) for _ in range(3))


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
        blocking, start = [], time.perf_counter()
        for step in range(1, steps + 1):
            workload.step()
            blocking.append(timed(lambda: engine.snapshot(step)))
        measured = {"baseline_step_s": baseline, "step_s": (time.perf_counter() - start) / steps,
                    "to_durable_s": disk["to_commit_s"], "disk_blocking_s": disk["blocking_s"],
                    "blocking_s": spread(blocking)["median"]}
        if restores:
            measured["restore_s"] = _restores(system, workload, directory, steps)
        return measured
    finally:
        system.close()


def _restores(system, workload: TrainingWorkload, directory: str, step: int) -> dict:
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
    for way in RESTORE_WAYS:
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


def _killed_and_restarted(directory: str, config: dict) -> dict:
    """A child trains with the memory tier and is SIGKILLed after a random step; its restart
    restores. The killed run's last finished step, the restored one, and what it redid."""
    log_path = directory + ".jsonl"
    child_command = command("features", dir=directory, log=log_path,
                            workload=json.dumps(config["workload"]))
    kill_after = random.randint(20, 60)
    child = subprocess.Popen(child_command + ["--mode", "train"], start_new_session=True)
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
    restart = subprocess.run(child_command + ["--mode", "restore"], capture_output=True,
                             text=True, check=True, timeout=600)
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


def _kill_run_child(args) -> None:
    """``--mode train`` logs each step once its memory snapshot is taken; ``restore`` prints what
    the restart restored, from which tier, and the keeper's pid."""
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


def render_memory_tier(block: dict) -> str:
    figures, restore, kills = block["figures"], block["figures"]["restore"], \
        block["figures"]["kills"]

    def times(entry: dict) -> str:
        return spread_text(entry, fixed(2), "x")

    rows = [[staging, ms(figures[staging]["blocking_s"]), times(figures[staging]["blocking_x_copy"]),
             times(figures[staging]["overhead"])] for staging in STAGINGS]
    restores = [[way, ms(restore[f"{way}_s"]), times(restore[f"{way}_x_copy"])]
                for way in RESTORE_WAYS]
    redone = ("not measured (full runs only)" if kills["memory_redone"] is None
              else spread_text(kills["memory_redone"], fixed(0), " steps"))
    return section(
        "Memory tier (`memory_every=1`)",
        f"State {block['state_bytes'] / 1e6:.0f} MB; copy floor {ms(block['copy_floor_s'])}; "
        f"medians of {block['config']['rounds']} interleaved rounds, min-max in brackets.",
        table(["staging", "blocking per memory snapshot", "÷ copy floor",
               "step time ÷ no checkpointing"], rows),
        table(["restore", "time", "÷ copy floor"], restores),
        f"Restore from memory ÷ warm disk restore: {times(restore['memory_x_warm'])}; ÷ cold: "
        f"{times(restore['memory_x_cold'])}.",
        f"Steps redone after a SIGKILL at a random step: memory tier {redone}; the disk alone at "
        f"the interval `async-ckpt advise` gives here (every {kills['advised_every']} steps, "
        f"MTBF 24 h) {kills['disk_redone_mean']:.1f} on average.")


# --- incremental snapshots on a LoRA-style state (a frozen base, a trainable adapter): what the
# frozen base costs each snapshot, against a state of the adapter alone ---------------------------

INCREMENTAL_CONFIGS = (  # full (a 1 GiB base, a 20 MiB adapter), --quick
    {"width": 4096, "layers": 16, "rank": 40, "repetitions": 9},
    {"width": 256, "layers": 4, "rank": 4, "repetitions": 3})
TARGET_RATIO = 1.2


def lora_state(width: int, layers: int, rank: int, seed: int = 0) -> dict:
    """Frozen ``layers`` x (width x width) fp32 weights, a rank-``rank`` adapter per layer, and
    AdamW over the adapter (its state created by one step)."""
    torch.manual_seed(seed)
    base = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(layers)]).requires_grad_(False)
    adapter = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, rank, bias=False),
                                                      torch.nn.Linear(rank, width, bias=False))
                                  for _ in range(layers))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
    state = {"base": base, "adapter": adapter, "optimizer": optimizer}
    _adapter_step(state)
    return state


def _adapter_step(state: dict) -> None:
    for p in state["adapter"].parameters():
        p.grad = torch.randn_like(p)
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def run_incremental(root: str, quick: bool) -> dict:
    """The incremental engine on the whole state and the plain one on the trainable part alone,
    in fresh directories under ``root``; the results block of results.json, with their ratios
    snapshot by snapshot (pairwise: the runs take turns)."""
    config = INCREMENTAL_CONFIGS[quick]
    state = lora_state(config["width"], config["layers"], config["rank"])
    nbytes = {"base": sum(t.nbytes for t in state["base"].state_dict().values()),
              "trainable": tensor_bytes({"model": state["adapter"],
                                         "optimizer": state["optimizer"]})}
    log(f"incremental: base {nbytes['base'] / 1e6:.1f} MB, adapter and AdamW state "
        f"{nbytes['trainable'] / 1e6:.1f} MB")
    trainable = {"adapter": state["adapter"], "optimizer": state["optimizer"]}
    runs = _snapshots({"incremental": (state, OURS_INCREMENTAL),
                       "trainable only": (trainable, OURS_ASYNC)}, root, config["repetitions"],
                      nbytes["base"] + nbytes["trainable"])
    ratios = {key: ratio_spread(runs["incremental"][key]["samples"],
                                runs["trainable only"][key]["samples"])
              for key in ("blocking_s", "written_bytes")}
    return {"config": config, "base_bytes": nbytes["base"], "trainable_bytes": nbytes["trainable"],
            "runs": runs, "ratios": ratios, "target_ratio": TARGET_RATIO}


def _snapshots(states: dict, root: str, repetitions: int, nbytes: int) -> dict:
    """Blocking time and shard bytes of ``repetitions`` snapshots after a warm-up one, for each
    run of ``states`` (name -> (state, the registry's system)), one snapshot of each per
    interleaved round, after the disk settled (for at most the time it takes to write ``nbytes``)."""
    systems = {name: spec.open(state, os.path.join(root, f"incremental-{name.replace(' ', '-')}"))
               for name, (state, spec) in states.items()}

    def snapshot(index: int, name: str, floor_hook) -> dict:
        _adapter_step(states[name][0])
        took = timed(lambda: systems[name].save(index))
        systems[name].wait()
        return {"blocking_s": took}

    try:
        blocking = samples(run_rounds(list(states), repetitions + 1, 0, dict, snapshot, name=str,
                                      settle_bytes=nbytes), "blocking_s")
        stats = {name: system.engine.stats()["snapshots"] for name, system in systems.items()}
    finally:
        for system in systems.values():
            system.close()
    return {name: {"blocking_s": spread(blocking[name][1:], samples=True),
                   "written_bytes": spread([float(s["shard_bytes"]) for s in snapshots[1:]],
                                           samples=True),
                   "first": {"blocking_s": snapshots[0]["blocking_s"],
                             "written_bytes": snapshots[0]["shard_bytes"]}}
            for name, snapshots in stats.items()}


def render_incremental(block: dict) -> str:
    rows = [[name, ms(r["blocking_s"], places=1),
             spread_text(r["written_bytes"], fixed(2, 1e6), " MB"),
             f"{r['first']['blocking_s'] * 1e3:.1f} ms, {r['first']['written_bytes'] / 1e6:.1f} MB"]
            for name, r in block["runs"].items()]
    ratios = block["ratios"]
    verdict = ("within" if max(r["median"] for r in ratios.values()) <= block["target_ratio"]
               else "OUTSIDE")
    return section(
        "Incremental snapshots (LoRA-style state)",
        f"Frozen base {block['base_bytes'] / 1e9:.3g} GB, adapter and its AdamW state "
        f"{block['trainable_bytes'] / 1e6:.3g} MB; median of "
        f"{len(block['runs']['incremental']['blocking_s']['samples'])} snapshots (min–max), each "
        "after one optimizer step and committed before the next; the first snapshot of each run "
        "(for the incremental run the full one) apart.",
        table(["run", "blocking per snapshot", "written per snapshot", "first snapshot"], rows),
        "Incremental / trainable only, snapshot by snapshot: blocking "
        f"{ratio(ratios['blocking_s'])}, written {ratio(ratios['written_bytes'])} (medians "
        f"{verdict} the ×{block['target_ratio']} target).")


# --- zstd restores across cores: a warm restore of a zstd snapshot by a child confined to one core
# and to every core -------------------------------------------------------------------------------

DECODE_CONFIGS = ({"size_gb": 1.0, "rounds": 3},
                  {"size_gb": 0.008, "rounds": 1})  # --quick: a child costs a torch import


def run_decode(root: str, quick: bool) -> dict:
    """Save once, restore on 1 core and on all of them in every round; the results block."""
    config = DECODE_CONFIGS[quick]
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
        allowed = sorted(os.sched_getaffinity(0))[:cores]
        child = subprocess.run(
            command("features", dir=directory, size_gb=config["size_gb"], mode="decode"),
            preexec_fn=lambda: os.sched_setaffinity(0, allowed), capture_output=True, text=True,
            check=True, cwd=REPO)
        took = json.loads(child.stdout.strip().splitlines()[-1])["restore_s"]
        log(f"  zstd restore on {cores} core(s): {took:.3f} s")
        return {"restore_s": took}

    times = samples(run_rounds(counts, config["rounds"], 0, dict, restore, name=str), "restore_s")
    return {"config": config, "state_bytes": nbytes, "cores": counts,
            "restore_s": {str(n): spread(times[str(n)], samples=True) for n in counts},
            "speedup": ratio_spread(times["1"], times[str(every)])}  # one core's time over all's


def _decode_child(args) -> None:
    """In a child confined to some cores: the warm restore time of ``args.dir``'s snapshot into a
    fresh state of the same shape, after one warm-up restore (which starts the verify threads and
    faults the pages), on stdout."""
    state, _ = build_state(args.size_gb)
    system = OURS_ASYNC.open(state, args.dir)
    try:
        system.restore()
        took = timed(system.restore)
    finally:
        system.close()
    print(json.dumps({"restore_s": took}))


def render_decode(block: dict) -> str:
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


# --- the remote tier against an S3-protocol server on loopback (``moto_server``): upload and
# restore against the client's own best bulk transfer, and a training step while the store is down

REMOTE_CONFIGS = ({"bytes": 1 << 30, "rounds": 4, "steps": 20},
                  {"bytes": 16 << 20, "rounds": 2, "steps": 3})
BUCKET = "bench-remote"
REMOTE_FIGURES = ("upload_s", "upload_floor_s", "restore_s", "download_floor_s", "step_up_s",
                  "step_down_s")
REMOTE_RATIOS = {"upload": ("upload_s", "upload_floor_s"),
                 "restore": ("restore_s", "download_floor_s"),
                 "step_down": ("step_down_s", "step_up_s")}


def run_remote(root: str, quick: bool) -> dict:
    """Start a server, measure the rounds, stop it; the results block of results.json, its
    figures over the rounds after the first, which warms up the server and the page cache."""
    config = REMOTE_CONFIGS[quick]
    with _moto() as server:
        rounds = interleaved("remote", ["remote tier"], config["rounds"], lambda *_: _one_round(
            server, root, config["bytes"], config["steps"]), shown=lambda r: (
                f"upload {r['upload_s']:.2f} s (floor {r['upload_floor_s']:.2f}), restore "
                f"{r['restore_s']:.2f} s (download {r['download_floor_s']:.2f})"))
    return {"config": config, "shard_bytes": rounds[0]["shard_bytes"],
            **summarised(rounds, REMOTE_FIGURES, REMOTE_RATIOS), "rounds": rounds}


@contextlib.contextmanager
def _moto() -> Iterator[S3Server]:
    """The test suite's moto S3 server (tests/s3server.py) on loopback with ``BUCKET`` made, the
    AWS environment pointing at it while it runs (``_steps_while_down`` stops its process)."""
    from tests.s3server import S3Server

    server = S3Server(BUCKET)
    server.start()
    try:
        with mock.patch.dict(os.environ, server.env):
            yield server
    finally:
        server.kill()


def _one_round(server: S3Server, root: str, nbytes: int, steps: int) -> dict:
    import boto3
    import obstore
    from boto3.s3.transfer import TransferConfig

    url = f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
    state = {"weights": torch.randn(nbytes // 4)}
    local = os.path.join(root, "node")
    with contextlib.closing(OURS_REMOTE.open(state, local, remote=url)) as system:
        system.save(0)
        system.wait()
        upload_s = timed(lambda: system.engine.wait(remote=True))
    record = read_manifest(LocalStorage(local)).snapshots[-1]
    shard = os.path.join(local, record.dir, record.shards[0].file)
    storage = ObjectStorage(url)
    client = boto3.client("s3")
    transfer = TransferConfig(multipart_chunksize=PART_BYTES, max_concurrency=TRANSFER_CONCURRENCY)
    key = f"{storage.prefix}/floor.bin"
    floors = {"obstore put": timed(lambda: obstore.put(
        storage.store, "floor.bin", Path(shard), chunk_size=PART_BYTES,
        max_concurrency=TRANSFER_CONCURRENCY)), "boto3 upload_file": timed(
            lambda: client.upload_file(shard, BUCKET, key, Config=transfer))}
    target = {"weights": torch.empty(nbytes // 4)}
    with contextlib.closing(OURS_REMOTE.open(target, os.path.join(root, "fresh"),
                                             remote=url)) as system:
        restore_s = timed(system.restore)
    assert torch.equal(target["weights"], state["weights"])
    downloads = {}
    start = time.perf_counter()
    size = os.path.getsize(shard)
    with open(os.path.join(root, "download.bin"), "wb") as f:
        for offset in range(0, size, PART_BYTES * TRANSFER_CONCURRENCY):
            starts = list(range(offset, min(size, offset + PART_BYTES * TRANSFER_CONCURRENCY),
                                PART_BYTES))
            for part in obstore.get_ranges(storage.store, "floor.bin", starts=starts,
                                           lengths=[min(PART_BYTES, size - s) for s in starts]):
                f.write(part)
    downloads["obstore ranged GETs"] = time.perf_counter() - start
    downloads["boto3 download_file"] = timed(lambda: client.download_file(
        BUCKET, key, os.path.join(root, "download2.bin"), Config=transfer))
    storage.remove([record.dir])
    obstore.delete(storage.store, "floor.bin")
    obstore.delete(storage.store, "manifest.json")
    for name in ("node", "fresh", "download.bin", "download2.bin"):
        remove(os.path.join(root, name))
    return {"shard_bytes": size, "upload_s": upload_s, "upload_floor_s": min(floors.values()),
            "upload_floors": floors, "restore_s": restore_s,
            "download_floor_s": min(downloads.values()), "downloads": downloads,
            **_steps_while_down(server, os.path.join(root, "steps"), steps)}


def _steps_while_down(server: S3Server, local: str, steps: int) -> dict:
    """Median seconds of a training step (snapshot every step) with the store running, and with
    its process stopped, in blocks up, down, up, down; the server runs again on return."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(2)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    x = torch.randn(256, 2048)
    times: dict[str, list[float]] = {"up": [], "down": []}
    url = f"s3://{BUCKET}/steps-{uuid.uuid4().hex[:8]}"
    with contextlib.closing(OURS_REMOTE.open({"model": model, "optimizer": opt}, local, remote=url,
                                             keep_last=2)) as system:
        step = 0
        try:
            for phase in ("up", "down", "up", "down"):
                os.kill(server.process.pid, signal.SIGSTOP if phase == "down" else signal.SIGCONT)
                for _ in range(steps):
                    start = time.perf_counter()
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    system.save(step)
                    times[phase].append(time.perf_counter() - start)
                    step += 1
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        lag = system.engine.stats()["upload_lag_steps"]
        system.engine.wait(remote=True)
    remove(local)
    return {"step_up_s": spread(times["up"])["median"],
            "step_down_s": spread(times["down"])["median"], "lag_steps_when_down": lag}


def render_remote(block: dict) -> str:
    f, r, gb = block["figures"], block["ratios"], block["shard_bytes"] / 1e9

    def transfer(key: str) -> str:
        return f"{seconds(f[key], 2)}, {gb / f[key]['median']:.2f} GB/s"

    rows = [["upload (local commit → bucket manifest)", transfer("upload_s"),
             f"{transfer('upload_floor_s')} (best bulk upload)", ratio(r["upload"])],
            ["restore on an empty node", transfer("restore_s"),
             f"{transfer('download_floor_s')} (plain parallel download)", ratio(r["restore"])]]
    if "step_down_s" in f:  # results saved before this figure existed lack it
        rows.append(["training step, snapshot every step, store stopped", ms(f["step_down_s"]),
                     f"{ms(f['step_up_s'])} (store running)", ratio(r["step_down"])])
    return section("Remote tier (moto S3 server on loopback)",
                   f"A {gb:.3g} GB shard; median of {f['upload_s']['n']} rounds after a warm-up "
                   "(min–max).", table(["", "async_ckpt", "floor", "ratio"], rows))


# --- the registry's view, and the children the parts start ----------------------------------------

MEMORY_TIER = PartOf("memory_tier", run_memory_tier, render_memory_tier)
INCREMENTAL = PartOf("incremental", run_incremental, render_incremental)
DECODE = PartOf("decode", run_decode, render_decode)
REMOTE = PartOf("remote", run_remote, render_remote)


def worker(args) -> None:
    """A child of this module's parts (``harness.command``): ``--mode decode``, a zstd restore
    on some cores; ``train``/``restore``, the memory tier's kill run and its restart."""
    children = {"decode": _decode_child, "train": _kill_run_child, "restore": _kill_run_child}
    if args.mode not in children:
        raise SystemExit(f"bench.features: --mode {args.mode!r} is none of {sorted(children)}")
    children[args.mode](args)
