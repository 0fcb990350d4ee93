"""``python -m bench --device cuda``: the GPU path measured in one run, against DCP (issue 42).

A bf16 transformer (``workloads.TransformerWorkload``) trains on the device while the
``GPU_SYSTEMS`` checkpoint it in interleaved rounds (``harness.run_rounds``; ``run_system``), each
opened per round (``systems.run_guarded``). Floors per round: ``device_floors`` and
``floors.Floors`` on ``min(state, DISK_SAMPLE_BYTES)``, scaled to the state. ``--device cpu`` runs
the same code on the CPU; ``--quick`` is a smoke test. docs/performance.md describes the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections import namedtuple
from typing import Callable, Optional

import numpy as np
import torch

from .core import paired_loops, scratch, snapshot_then_move_on
from .floors import Floors
from .harness import log, machine, ratio_spread, run_rounds, spread, timed, write_results
from .markdown import factor, fixed, median_range, number, over_one, section, spread_text, table
from .systems import DCP_DEFAULT, DCP_PINNED, GPU_SYSTEMS, System, SystemSpec, run_guarded
from .workloads import TransformerWorkload, state_tensors

COMMITTED_RESULTS = os.path.join("bench", "results", "gpu")
DISK_SAMPLE_BYTES = 10**9
SETTLE_BYTES = 200 * 10**6  # before each system: wait at most ~2 s for the disk to settle
DCP_NAMES = (DCP_DEFAULT.name, DCP_PINNED.name)


Config = namedtuple("Config", "params_gb width seq batch rounds every steps_every_step "
                               "steps_every_n budget_s")  # loops: K = 1 and K = every


PRESETS = {  # (device, quick) -> Config
    ("cuda", False): Config(1.0, 2048, 1024, 8, 3, 10, 2, 10, 270.0),
    ("cpu", False): Config(0.02, 256, 64, 4, 3, 10, 2, 10, None),
    ("cuda", True): Config(0.01, 256, 64, 4, 2, 2, 2, 2, None),
    ("cpu", True): Config(0.0001, 64, 8, 2, 2, 2, 2, 2, None),
}


def config_for(args: argparse.Namespace) -> Config:
    given = {"params_gb": args.params_gb, "rounds": args.rounds, "budget_s": args.budget}
    return PRESETS[args.device, args.quick]._replace(**{k: v for k, v in given.items()
                                                        if v is not None})


def default_out(args: argparse.Namespace) -> str:
    """Only a full CUDA run with the preset's sizes may overwrite the committed report."""
    full = (args.device == "cuda" and not args.quick and args.params_gb is None
            and args.rounds is None and args.budget is None)
    return COMMITTED_RESULTS if full else tempfile.mkdtemp(prefix="bench-gpu-results-")


def device_floors(tensors: list[torch.Tensor], device: torch.device) -> Callable[[], dict]:
    """The copy floors of staging and restore: the state's own tensors (distinct, contiguous)
    into one page-locked buffer and back, on a side stream; plain copies on the CPU."""
    cuda, unique = device.type == "cuda", {}
    for t in tensors:  # as bytes: a copy into the view writes the tensor
        if t.is_contiguous() and t.nbytes:
            unique.setdefault(t.data_ptr(), t.detach().reshape(-1).view(torch.uint8))
    host = torch.ones(sum(t.nbytes for t in unique.values()), dtype=torch.uint8, pin_memory=cuda)
    pairs = list(zip(unique.values(), host.split([t.nbytes for t in unique.values()])))
    stream = torch.cuda.Stream(device) if cuda else None

    def timed_copies(d2h: bool) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.cuda.stream(stream):  # None on the CPU: a no-op
            for t, v in pairs:
                v.copy_(t, non_blocking=cuda) if d2h else t.copy_(v, non_blocking=cuda)
        if cuda:
            stream.synchronize()
        return time.perf_counter() - start

    return lambda: {"d2h_s": timed_copies(True), "h2d_s": timed_copies(False)}


def run_system(spec: SystemSpec, system: System, workload: TransformerWorkload, config: Config,
               floor_hook: Callable[[], dict]) -> dict:
    """An untimed warm-up snapshot, then ``core.paired_loops`` at K = 1 and K = every
    (``fenced``: ``fence`` before the optimizer's step, counted as blocking), then
    ``exactness``."""
    system.save(1)
    system.fence()
    system.wait()
    loops, step = paired_loops(system, workload, {1: config.steps_every_step,
                                                  config.every: config.steps_every_n}, 1,
                               fenced=True, settle=workload.synchronize)
    check = exactness(system, workload, step + 1, spec.ours)
    log(f"  {spec.name}: " + ", ".join(f"K={k} {x['step_s'] * 1e3:.0f} ms/step "
                                       f"({x['baseline']['step_s'] * 1e3:.0f} without)"
                                       for k, x in loops.items())
        + f"; restore {check['restore_s']:.2f} s, "
        + ("bit-exact" if check["bit_exact"] else "DIFFERS"))
    floor_hook()  # before run_guarded's close deletes the snapshots
    return {"loops": loops, "exactness": check, "details": system.details()}


def exactness(system: System, workload: TransformerWorkload, step: int, ours: bool) -> dict:
    """Snapshot, wait until durable, move the state and the RNGs on, restore (timed to a device
    synchronisation), compare bit for bit (async_ckpt's RNG states too: the peers save none)."""
    rng = _rng_states()  # a snapshot's: saving moves no generator
    to_durable_s, expected = snapshot_then_move_on(system, workload, step)
    torch.rand(8, device=workload.device)  # moves the device's generator (and the CPU's)
    torch.rand(8)
    workload.synchronize()
    restore_s = timed(lambda: (system.restore(), workload.synchronize()))
    differing = workload.differing_tensors(expected)
    check = {"to_durable_s": to_durable_s, "restore_s": restore_s, "step": step,
             "tensors": len(expected), "differing": differing, "bit_exact": differing == 0}
    if ours:
        check["rng_exact"] = all(torch.equal(a, b) for a, b in zip(rng, _rng_states()))
    return check


def _rng_states() -> list[torch.Tensor]:
    return [torch.get_rng_state(), *torch.cuda.get_rng_state_all()]  # [] without CUDA


def measure(config: Config, device: str, root: str) -> dict:
    """The raw results: ``run_rounds``, which ``--budget`` may end early."""
    workload = TransformerWorkload(config.params_gb, config.width, config.seq, config.batch,
                                   device)
    log(f"gpu bench on {device}: {workload.depth} blocks of width {config.width}, "
        f"{workload.param_bytes / 1e9:.3g} GB of parameters, {workload.nbytes / 1e9:.3g} GB of "
        f"state; up to {config.rounds} rounds")
    copy_floors = device_floors(state_tensors(workload.state), workload.device)
    disk = Floors(root, min(workload.nbytes, DISK_SAMPLE_BYTES))

    def run_slot(round_: int, spec: SystemSpec, floor_hook) -> dict:
        return run_guarded(spec, workload.state, os.path.join(root, "system"), lambda system:
                           run_system(spec, system, workload, config, floor_hook))

    try:
        record = run_rounds(GPU_SYSTEMS, config.rounds, 0,
                            lambda: {**copy_floors(), **disk.measure()}, run_slot,
                            settle_bytes=SETTLE_BYTES, budget_s=config.budget_s)
    finally:
        disk.close()
    return {"state_bytes": workload.nbytes, "param_bytes": workload.param_bytes,
            "depth": workload.depth, "disk_sample_bytes": disk.nbytes, **record,
            "rounds_run": len(record["floors"])}


def build_figures(raw: dict) -> dict:
    """Per system, each figure's spread over the rounds and its ratios, round by round, to its
    floor and (for the others) to the best DCP variant."""
    runs = {name: b["runs"] for name, b in raw["systems"].items() if b["available"]}
    dcp_runs = [runs[name] for name in DCP_NAMES if name in runs]
    scale = raw["state_bytes"] / raw["disk_sample_bytes"]
    d2h, h2d, disk = ([f[key] * x for f in raw["floors"]]
                      for key, x in (("d2h_s", 1), ("h2d_s", 1), ("durable_s", scale)))

    def figure(name: str, value: Callable[[dict], float], floor: Optional[list] = None) -> dict:
        values = [value(r) for r in runs[name]]  # one run per round, as every floor
        out = {"value": spread(values)}
        if floor is not None:
            out["x_floor"] = ratio_spread(values, floor)
        if dcp_runs and name not in DCP_NAMES:
            out["x_best_dcp"] = ratio_spread(values, [min(value(rs[i]) for rs in dcp_runs)
                                                      for i in range(len(values))])
        return out

    def per_k(name: str, k: str) -> dict:
        loops = [r["loops"][k] for r in runs[name]]
        return {"blocking_s": figure(name, lambda r: float(np.median(r["loops"][k]["blocking_s"])),
                                     d2h),
                "step_s": figure(name, lambda r: r["loops"][k]["step_s"]),
                "overhead": ratio_spread([x["step_s"] for x in loops],
                                         [x["baseline"]["step_s"] for x in loops])}

    return {name: {"ks": {k: per_k(name, k) for k in rs[0]["loops"]},
                   "to_durable_s": figure(name, lambda r: r["exactness"]["to_durable_s"], disk),
                   "restore_s": figure(name, lambda r: r["exactness"]["restore_s"], h2d)}
            for name, rs in runs.items()}


def gpu_info(device: str) -> dict:
    """The device, its driver, PCIe link and the CUDA build torch runs on."""
    if device != "cuda":
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(0)
    info = {"device": "cuda", "name": props.name, "count": torch.cuda.device_count(),
            "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    smi = shutil.which("nvidia-smi") and subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current",
         "--format=csv,noheader"], capture_output=True, text=True)
    if smi and smi.returncode == 0 and smi.stdout.strip():
        info.update(zip(("driver", "pcie_gen", "pcie_width"),
                        (f.strip() for f in smi.stdout.splitlines()[0].split(","))))
    return info


def run(args: argparse.Namespace) -> int:
    """Measure, write results.json and report.md, print the report; 1 if a restore differed."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (--device cpu runs the "
                         "same benchmark on the CPU)")
    config = config_for(args)
    started, start = time.time(), time.perf_counter()
    info = {**machine(), "gpu": gpu_info(args.device), "platform": platform.platform()}
    os.makedirs(args.out, exist_ok=True)
    with scratch("bench-gpu-", args.dir) as root:
        raw = measure(config, args.device, root)
    checks = [{"system": name, "round": r["round"], **r["exactness"]}
              for name, block in raw["systems"].items() if block["available"]
              for r in block["runs"]]
    results = {"kind": "gpu", "started_at": started, "runtime_s": time.perf_counter() - start,
               "machine": info, "config": {"command": args.command, "device": args.device,
                                           "quick": args.quick, **config._asdict()},
               "figures": build_figures(raw), "exactness": checks, "raw": raw}
    write_results(args.out, results, render)
    log(f"results in {args.out}")
    return 1 if any(not c["bit_exact"] or c.get("rng_exact") is False for c in checks) else 0


def render(results: dict) -> str:
    raw, config, info, figures = (results[k] for k in ("raw", "config", "machine", "figures"))
    gpu, floors, checks = info["gpu"], raw["floors"], results["exactness"]
    device = ("no GPU (--device cpu)" if gpu["device"] == "cpu" else
              f"{gpu['count']} x {gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB, "
              f"sm {gpu['capability']}, driver {gpu.get('driver', '?')}, CUDA {gpu['cuda']}, "
              f"PCIe gen {gpu.get('pcie_gen', '?')} x{gpu.get('pcie_width', '?')})")
    pinned = "pinned" if gpu["device"] == "cuda" else "plain copy on the CPU"
    floor_rows = [(f"device-to-host, {pinned}, the state's tensors", "d2h_s", "state_bytes"),
                  (f"host-to-device, {pinned}, the state's tensors", "h2d_s", "state_bytes"),
                  ("host memory copy (sample)", "copy_s", "disk_sample_bytes"),
                  ("disk: durable write (sample)", "durable_s", "disk_sample_bytes"),
                  ("disk: cached read (sample)", "read_cache_s", "disk_sample_bytes")]
    ks = next((list(f["ks"]) for f in figures.values()), [])
    rows, steps = [], []
    for name, block in raw["systems"].items():
        f = figures.get(name)
        na = [f"n/a ({block.get('reason')})"]
        rows.append([name] + (na * (len(ks) + 2) if f is None else
                              [_cell(f["ks"][k]["blocking_s"], 1e-3, "ms", "D2H") for k in ks]
                              + [_cell(f["to_durable_s"], 1, "s", "disk"),
                                 _cell(f["restore_s"], 1, "s", "H2D")]))
        steps.append([name] + (na * len(ks) if f is None else [
            spread_text(f["ks"][k]["overhead"], over_one) + ", "
            + _cell(f["ks"][k]["step_s"], 1e-3, "ms", vs=fixed(2, unit="×"))
            for k in ks]))
    return "\n\n".join([
        "# GPU path: staging, lazy overlap, restore onto the device, against DCP",
        f"`{config['command']}`: {device}; {info['nproc']} CPUs ({info['cpu_model']}), "
        f"{info['ram_bytes'] / 2**30:.0f} GiB RAM, Linux {info['kernel']}, Python "
        f"{info['python']}, torch {info['torch']}; {results['runtime_s']:.0f} s.",
        f"A bf16 transformer of {raw['depth']} blocks of width {config['width']} "
        f"({raw['param_bytes'] / 1e9:.3g} GB of parameters) with fused AdamW: "
        f"{raw['state_bytes'] / 1e9:.3g} GB of state, a batch of {config['batch']} x "
        f"{config['seq']} tokens. {raw['rounds_run']} of {config['rounds']} rounds"
        + ("" if raw["rounds_run"] == config["rounds"] else
           f" (the time budget of {config['budget_s']:.0f} s ended the rounds)")
        + "; every figure is the median (min–max) over the rounds, a ratio taken round by round.",
        *(["**--quick: a smoke test of the code path, not a measurement.**"]
          if config["quick"] else []),
        section("Floors", table(["floor", "seconds", "GB/s"], [
            [label, median_range(spread([f[key] for f in floors])),
             number(raw[nbytes] / np.median([f[key] for f in floors]) / 1e9)]
            for label, key, nbytes in floor_rows]),
            f"Disk floors measured on {raw['disk_sample_bytes'] / 1e9:.3g} GB and scaled to the "
            "state's bytes where a figure is compared with them.", level=2),
        section("Blocking, time to durable, restore",
                "Blocking: the `save` call plus the fence before the next optimizer step, per "
                "snapshot (× the device-to-host floor). Time to durable: a snapshot with nothing "
                "else running, from the call to durable (× the disk floor). Restore: the newest "
                "snapshot into the live model on the device, to a device synchronisation (× the "
                "host-to-device floor). `vs DCP`: × the best DCP variant in the same round.",
                table(["system"] + [f"blocking, K={k}" for k in ks]
                      + ["to durable", "restore onto the device"], rows), level=2),
        section("Training-step overhead",
                "Step time with a snapshot every K steps over the same loop without "
                "checkpointing just before it; `vs DCP`: step time × the best DCP variant's.",
                table(["system"] + [f"K={k}" for k in ks], steps), level=2),
        section("Exactness",
                f"{sum(c['bit_exact'] for c in checks)} of {len(checks)} restores bit-exact; RNG "
                "states (CPU and every CUDA device) restored exactly in "
                f"{sum(bool(c.get('rng_exact')) for c in checks)} of "
                f"{sum('rng_exact' in c for c in checks)} async_ckpt restores. Staging slots CUDA "
                "refused to page-lock (`stats()['pin_failures']`: their copies ran synchronously, "
                "from pageable memory): " + (", ".join(f"{name} {count}" for name, count in
                                                      _pin_failures(raw).items())
                                             or "none measured") + ".",
                table(["system", "round", "step", "tensors differing", "RNG"],
                      [[c["system"], str(c["round"]), str(c["step"]),
                        f"{c['differing']} of {c['tensors']}",
                        {True: "exact", False: "DIFFERS", None: "not saved"}[c.get("rng_exact")]]
                       for c in checks]), level=2)]) + "\n"


def _pin_failures(raw: dict) -> dict[str, int]:
    """Per engine of ours, the most slots any of its runs could not pin."""
    return {name: max(r["details"].get("pin_failures") or 0 for r in block["runs"])
            for name, block in raw["systems"].items() if block["available"] and block["runs"]
            and "pin_failures" in block["runs"][0]["details"]}


def _cell(entry: dict, scale: float, unit: str, floor: str = "",
          vs: Callable[[float], str] = factor) -> str:
    """``median (min–max) unit, N× floor, M× vs DCP``."""
    text = f"{median_range(entry['value'], scale)} {unit}"
    if floor:
        text += f", {factor(entry['x_floor']['median'])} {floor}"
    if "x_best_dcp" in entry:
        text += f", {vs(entry['x_best_dcp']['median'])} vs DCP"
    return text
