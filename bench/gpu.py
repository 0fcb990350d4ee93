"""``python -m bench --device cuda``: the GPU path measured in one run, against DCP (issue 42).

A bf16 transformer (``workloads.TransformerWorkload``: ``--params-gb`` of parameters plus fused
AdamW's moments, three times that in all) trains on the device. The systems (``GPU_SYSTEMS``:
async_ckpt with eager and with lazy staging, DCP ``async_save`` with its default stager and with
a cached pinned-memory stager, ``torch.save`` + fsync) are opened once and take one untimed
warm-up snapshot each (their first-snapshot allocations and pinning); then, in interleaved rounds
(``measure.rotated``: each system once per round, the order rotated and reversed in odd rounds),
each system runs:

* for K = 1 and K = ``every``: a loop without checkpointing, then the same loop snapshotting after
  step ``i`` when ``i % K == 0``. Each step is forward, backward, the system's ``fence()`` (where a
  save whose copy runs on after it returned must end: lazy staging, DCP's asynchronous staging),
  the optimizer's step, and a device synchronisation (a loop that logs its loss each step). Step
  overhead: each loop over the loop without checkpointing just before it. Blocking per snapshot:
  the ``save`` call plus the fence of the step after it.
* the exactness check: a snapshot, waited for until durable (time to durable), a copy of the state
  and of the RNG states, two more steps, then a restore into the live model (timed up to a device
  synchronisation) and a bit-for-bit comparison of every tensor (and, for async_ckpt, which
  restores them, of the CPU and CUDA RNG states).

Each round starts with the floors: the state's own tensors copied device-to-host into a
page-locked buffer and back host-to-device (on a side stream, non-blocking; the copy back puts the
same bytes back) and, on the disk, ``floors.Floors`` on ``min(state, DISK_SAMPLE_BYTES)`` (the
fastest way to make bytes durable and to read them back), scaled to the state's bytes. Every
figure is the median over the rounds with its min-max spread; a ratio is taken round by round.
A time budget (``--budget``) ends the rounds early when the next one would overrun it (at least
one round runs); the report says so.

``--device cpu`` runs the same code on the CPU (no pinning: the "device-to-host" floor is a plain
copy, DCP's pinned stager runs without pinned memory); ``--quick`` is a tiny model, for the test
that keeps this runnable (tests/test_bench.py), not a measurement. A full CUDA run writes
``bench/results/gpu/``; every other run writes a scratch directory unless ``--out`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

import numpy as np
import torch

from . import dcp, records
from .floors import Floors
from .markdown import factor, hundredths, median_range, table
from .measure import (load_between, load_now, log, machine, ratio_spread, remove, rotated,
                      settle, spread, timed)
from .registry import DCP_DEFAULT, DCP_PINNED, GPU_SYSTEMS, SystemSpec
from .systems import NoCheckpoint, System, Unavailable
from .workloads import TransformerWorkload, state_tensors

COMMITTED_RESULTS = os.path.join("bench", "results", "gpu")
DISK_SAMPLE_BYTES = 10**9
SETTLE_BYTES = 200 * 10**6  # before each system: wait at most ~2 s for the disk to settle
DCP_NAMES = (DCP_DEFAULT.name, DCP_PINNED.name)


@dataclass(frozen=True)
class Config:
    """One run's model and loops: ``params_gb`` of bf16 parameters in blocks of ``width``, a
    batch of ``batch`` x ``seq`` tokens; ``rounds``; the K = 1 loop's ``steps_every_step`` and
    the K = ``every`` loop's ``steps_every_n``; ``budget_s`` (None: no budget)."""

    params_gb: float
    width: int
    seq: int
    batch: int
    rounds: int
    every: int
    steps_every_step: int
    steps_every_n: int
    budget_s: Optional[float]


PRESETS = {  # (device, quick) -> Config
    ("cuda", False): Config(1.0, 2048, 1024, 8, 3, 10, 2, 10, 270.0),
    ("cpu", False): Config(0.02, 256, 64, 4, 3, 10, 2, 10, None),
    ("cuda", True): Config(0.01, 256, 64, 4, 2, 2, 2, 2, None),
    ("cpu", True): Config(0.0001, 64, 8, 2, 2, 2, 2, 2, None),
}


def config_for(args: argparse.Namespace) -> Config:
    """The preset of ``args.device`` (and ``--quick``), with ``--params-gb``, ``--rounds`` and
    ``--budget`` where given."""
    config = PRESETS[args.device, args.quick]
    given = {"params_gb": args.params_gb, "rounds": args.rounds, "budget_s": args.budget}
    return replace(config, **{k: v for k, v in given.items() if v is not None})


def default_out(args: argparse.Namespace) -> str:
    """``COMMITTED_RESULTS`` for a full CUDA run with the preset's sizes; else a new scratch
    directory, so that a partial, CPU or quick run never overwrites the committed report."""
    full = (args.device == "cuda" and not args.quick and args.params_gb is None
            and args.rounds is None and args.budget is None)
    return COMMITTED_RESULTS if full else tempfile.mkdtemp(prefix="bench-gpu-results-")


# --- the floors ---------------------------------------------------------------------------------

class DeviceFloors:
    """Device-to-host and host-to-device copies of the state's own tensors (each contiguous
    tensor, in state order) into and out of one page-locked buffer, on a side stream; on the CPU
    a plain buffer and plain copies."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        self.cuda = device.type == "cuda"
        seen, self.tensors = set(), []
        for t in tensors:
            if t.is_contiguous() and t.nbytes and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                self.tensors.append(t)
        self.nbytes = sum(t.nbytes for t in self.tensors)
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.host.fill_(1)  # faulted in
        offsets = np.cumsum([0] + [t.nbytes for t in self.tensors])
        self.views = [self.host[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def measure(self) -> dict:
        return {"d2h_s": self._timed(lambda: [v.copy_(_bytes(t), non_blocking=self.cuda)
                                              for t, v in zip(self.tensors, self.views)]),
                "h2d_s": self._timed(lambda: [_bytes(t).copy_(v, non_blocking=self.cuda)
                                              for t, v in zip(self.tensors, self.views)])}

    def _timed(self, copies: Callable[[], object]) -> float:
        if not self.cuda:
            with torch.no_grad():
                return timed(copies)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.cuda.stream(self.stream):
            copies()
        self.stream.synchronize()
        return time.perf_counter() - start


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes (a view: a copy into it writes the tensor)."""
    return t.detach().reshape(-1).view(torch.uint8)


# --- one system's round -------------------------------------------------------------------------

def run_loop(system: System, workload: TransformerWorkload, k: int, n_steps: int,
             step: int) -> tuple[dict, int]:
    """``n_steps`` steps with a save after step ``i`` when ``i % k == 0`` (see the module
    docstring); the loop's figures and the global step reached."""
    blocking: list[float] = []
    fenced = [True]

    def fence() -> None:  # right before the optimizer's step: the last save's copy must end
        if not fenced[0]:
            blocking[-1] += timed(system.fence)
            fenced[0] = True

    workload.synchronize()
    start = time.perf_counter()
    for i in range(n_steps):
        workload.step(fence)
        step += 1
        if i % k == 0:
            blocking.append(timed(lambda: system.save(step)))
            fenced[0] = False
    fence()
    loop_s = time.perf_counter() - start
    drain_s = timed(system.wait)
    return {"steps": n_steps, "loop_s": loop_s, "step_s": loop_s / n_steps, "drain_s": drain_s,
            "blocking_s": blocking}, step


def exactness(system: System, workload: TransformerWorkload, step: int, ours: bool) -> dict:
    """Snapshot, wait until durable, change the state and the RNG, restore into the live model
    (timed to a device synchronisation), compare bit for bit."""
    system.save(step)
    system.wait()
    to_durable_s = system.to_commit_s()
    expected, rng = workload.clone_tensors(), _rng_states()
    workload.step()
    workload.step()
    torch.rand(8, device=workload.device)  # moves the device's generator (and the CPU's)
    torch.rand(8)
    workload.synchronize()
    start = time.perf_counter()
    system.restore()
    workload.synchronize()
    restore_s = time.perf_counter() - start
    differing = workload.differing_tensors(expected)
    check = {"to_durable_s": to_durable_s, "restore_s": restore_s, "step": step,
             "tensors": len(expected), "differing": differing, "bit_exact": differing == 0}
    if ours:  # the engine restores the RNG states (rng=True); the peers save none
        check["rng_exact"] = all(torch.equal(a, b) for a, b in zip(rng, _rng_states()))
    return check


def _rng_states() -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all()
                                     if torch.cuda.is_available() else [])]


def run_system(spec: SystemSpec, system: System, baseline: System,
               workload: TransformerWorkload, config: Config, step: int) -> tuple[dict, int]:
    loops = {}
    for k, n in ((1, config.steps_every_step), (config.every, config.steps_every_n)):
        base, step = run_loop(baseline, workload, k, n, step)
        loops[str(k)], step = run_loop(system, workload, k, n, step)
        loops[str(k)]["baseline"] = base
    check = exactness(system, workload, step + 1, spec.ours)
    log(f"  {spec.name}: " + ", ".join(
        f"K={k} {loop['step_s'] * 1e3:.0f} ms/step ({loop['baseline']['step_s'] * 1e3:.0f} "
        f"without)" for k, loop in loops.items())
        + f"; restore {check['restore_s']:.2f} s, {'bit-exact' if check['bit_exact'] else 'DIFFERS'}")
    return {"loops": loops, "exactness": check, "details": system.details()}, step + 1


# --- the run ------------------------------------------------------------------------------------

def measure(config: Config, device: str, root: str) -> dict:
    """Every round's floors and runs, by system (the raw results)."""
    workload = TransformerWorkload(config.params_gb, config.width, config.seq, config.batch,
                                   device)
    state_bytes = workload.nbytes
    log(f"gpu bench on {device}: {workload.depth} blocks of width {config.width}, "
        f"{workload.param_bytes / 1e9:.3g} GB of parameters, {state_bytes / 1e9:.3g} GB of state; "
        f"up to {config.rounds} rounds")
    device_floors = DeviceFloors(state_tensors(workload.state), workload.device)
    disk = Floors(root, min(state_bytes, DISK_SAMPLE_BYTES))
    baseline = NoCheckpoint(workload.state, os.path.join(root, "none"))
    systems: dict[str, object] = {}
    raw: dict = {"state_bytes": state_bytes, "param_bytes": workload.param_bytes,
                 "depth": workload.depth, "disk_sample_bytes": disk.nbytes, "floors": [],
                 "systems": {}, "order": [], "loads": [], "rounds_run": 0}
    step = 0
    try:
        for spec in GPU_SYSTEMS:
            systems[spec.name], step = _open(spec, workload, root, step)
            raw["systems"][spec.name] = ({"available": True, "runs": []}
                                         if isinstance(systems[spec.name], System)
                                         else {"available": False,
                                               "reason": systems[spec.name]})
        started = time.perf_counter()
        for index in range(config.rounds):
            order = [s for s in rotated(GPU_SYSTEMS, index) if raw["systems"][s.name]["available"]]
            start = load_now()
            raw["floors"].append({**device_floors.measure(), **disk.measure()})
            for spec in order:
                settle(SETTLE_BYTES)
                try:
                    run, step = run_system(spec, systems[spec.name], baseline, workload, config,
                                           step)
                except Exception as e:  # noqa: BLE001 - a peer's failure is a result, ours a bug
                    if spec.ours:
                        raise
                    log(f"  {spec.name}: failed: {type(e).__name__}: {e}")
                    raw["systems"][spec.name] = {"available": False,
                                                 "reason": f"failed here: {type(e).__name__}: {e}"}
                    _close(systems.pop(spec.name))
                    continue
                raw["systems"][spec.name]["runs"].append({"round": index, **run})
            raw["order"].append([s.name for s in order])
            raw["loads"].append(load_between(start, load_now()))
            raw["rounds_run"] = index + 1
            elapsed = time.perf_counter() - started
            log(f"round {index + 1} done after {elapsed:.0f} s")
            if config.budget_s is not None and elapsed * (index + 2) / (index + 1) > config.budget_s:
                break
    finally:
        for system in systems.values():
            _close(system)
        disk.close()
    return raw


def _open(spec: SystemSpec, workload: TransformerWorkload, root: str, step: int):
    """The open system after its warm-up snapshot, or the reason it cannot run here."""
    try:
        system = spec.open(workload.state, os.path.join(root, _dirname(spec.name)))
    except Unavailable as e:
        log(f"  {spec.name}: n/a ({e})")
        return str(e), step
    try:
        step += 1
        system.save(step)
        system.fence()
        system.wait()
    except Exception as e:  # noqa: BLE001
        if spec.ours:
            raise
        _close(system)
        log(f"  {spec.name}: failed: {type(e).__name__}: {e}")
        return f"failed here: {type(e).__name__}: {e}", step
    return system, step


def _close(system: object) -> None:
    if isinstance(system, System):
        try:
            system.close()
        finally:
            remove(system.directory, settle=True)


def _dirname(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


# --- figures ------------------------------------------------------------------------------------

def build_figures(raw: dict) -> dict:
    """Per system: the figures the report shows, each a spread over the rounds, with its ratios
    (round by round) to its floor and to the best DCP variant."""
    floors = raw["floors"]
    scale = raw["state_bytes"] / raw["disk_sample_bytes"]
    d2h = {i: f["d2h_s"] for i, f in enumerate(floors)}
    h2d = {i: f["h2d_s"] for i, f in enumerate(floors)}
    disk = {i: f["durable_s"] * scale for i, f in enumerate(floors)}
    runs = {name: {r["round"]: r for r in block["runs"]}
            for name, block in raw["systems"].items() if block["available"]}
    ks = next((list(r["loops"]) for rs in runs.values() for r in rs.values()), [])

    def best_dcp(round_: int, value: Callable[[dict], float]) -> Optional[float]:
        found = [value(runs[n][round_]) for n in DCP_NAMES if n in runs and round_ in runs[n]]
        return min(found) if found else None

    def figure(name: str, value: Callable[[dict], float], floor: Optional[dict]) -> dict:
        rounds = sorted(runs[name])
        values = [value(runs[name][i]) for i in rounds]
        out = {"value": spread(values)}
        if floor is not None:
            out["x_floor"] = ratio_spread(values, [floor[i] for i in rounds])
        paired = [(v, best_dcp(i, value)) for v, i in zip(values, rounds)]
        paired = [(v, b) for v, b in paired if b is not None]
        if paired and name not in DCP_NAMES:
            out["x_best_dcp"] = ratio_spread(*zip(*paired))
        return out

    figures = {}
    for name in runs:
        per_k = {}
        for k in ks:
            per_k[k] = {
                "blocking_s": figure(name, lambda r: float(np.median(r["loops"][k]["blocking_s"])),
                                     d2h),
                "step_s": figure(name, lambda r: r["loops"][k]["step_s"], None),
                "overhead": spread([r["loops"][k]["step_s"] / r["loops"][k]["baseline"]["step_s"]
                                    for r in runs[name].values()])}
        figures[name] = {
            "ks": per_k,
            "to_durable_s": figure(name, lambda r: r["exactness"]["to_durable_s"], disk),
            "restore_s": figure(name, lambda r: r["exactness"]["restore_s"], h2d)}
    return figures


def exactness_checks(raw: dict) -> list[dict]:
    """Every exactness check of the run, one row per system and round."""
    return [{"system": name, "round": r["round"], **r["exactness"]}
            for name, block in raw["systems"].items() if block["available"]
            for r in block["runs"]]


def gpu_info(device: str) -> dict:
    """The device, its driver and the CUDA build torch runs on (nvidia-smi where installed)."""
    if device != "cuda":
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(0)
    info = {"device": "cuda", "name": props.name, "count": torch.cuda.device_count(),
            "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
                               "pcie.link.width.current", "--format=csv,noheader"],
                              capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            fields = [f.strip() for f in done.stdout.splitlines()[0].split(",")]
            info.update(zip(("driver", "pcie_gen", "pcie_width"), fields))
    return info


def run(args: argparse.Namespace) -> int:
    """``python -m bench --device ...``: measure, then write results.json and report.md."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (--device cpu runs the "
                         "same benchmark on the CPU)")
    config = config_for(args)
    started, start = time.time(), time.perf_counter()
    info = {**machine(), "gpu": gpu_info(args.device), "platform": platform.platform()}
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir or None)
    try:
        raw = measure(config, args.device, root)
    finally:
        dcp.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    results = {"kind": "gpu", "started_at": started, "runtime_s": time.perf_counter() - start,
               "machine": info, "config": {"command": args.command, "device": args.device,
                                           "quick": args.quick, **asdict(config)},
               "figures": build_figures(raw), "exactness": exactness_checks(raw), "raw": raw}
    saved = json.dumps(results, indent=1, default=records.to_json)
    text = render(json.loads(saved))
    for name, content in (("results.json", saved), ("report.md", text)):
        with open(os.path.join(args.out, name + ".tmp"), "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(os.path.join(args.out, name + ".tmp"), os.path.join(args.out, name))
    print(text)
    log(f"results in {args.out}")
    failed = [c for c in results["exactness"] if not c["bit_exact"] or c.get("rng_exact") is False]
    return 1 if failed else 0


# --- the report ---------------------------------------------------------------------------------

def render(results: dict) -> str:
    raw, config, info = results["raw"], results["config"], results["machine"]
    gpu, floors = info["gpu"], raw["floors"]
    figures = results["figures"]
    lines = ["# GPU path: staging, lazy overlap, restore onto the device, against DCP", "",
             f"`{config['command']}`: {_machine_line(info)}; {results['runtime_s']:.0f} s.", "",
             f"A bf16 transformer of {raw['depth']} blocks of width {config['width']} "
             f"({raw['param_bytes'] / 1e9:.3g} GB of parameters) with fused AdamW: "
             f"{raw['state_bytes'] / 1e9:.3g} GB of state, a batch of {config['batch']} x "
             f"{config['seq']} tokens. {raw['rounds_run']} of {config['rounds']} rounds"
             + ("" if raw["rounds_run"] == config["rounds"] else
                f" (the time budget of {config['budget_s']:.0f} s ended the rounds)")
             + "; every figure is the median (min–max) over the rounds, a ratio taken round by "
             "round.", ""]
    if config["quick"]:
        lines += ["**--quick: a smoke test of the code path, not a measurement.**", ""]
    pinned = "pinned" if gpu["device"] == "cuda" else "plain copy on the CPU"
    lines += ["## Floors", "", table(["floor", "seconds", "GB/s"], [
        [name, median_range(spread(values)), f"{raw[nbytes_key] / np.median(values) / 1e9:.3g}"]
        for name, values, nbytes_key in (
            (f"device-to-host, {pinned}, the state's tensors", [f["d2h_s"] for f in floors],
             "state_bytes"),
            (f"host-to-device, {pinned}, the state's tensors", [f["h2d_s"] for f in floors],
             "state_bytes"),
            ("host memory copy (sample)", [f["copy_s"] for f in floors], "disk_sample_bytes"),
            ("disk: durable write (sample)", [f["durable_s"] for f in floors],
             "disk_sample_bytes"),
            ("disk: cached read (sample)", [f["read_cache_s"] for f in floors],
             "disk_sample_bytes"))]),
              "", f"Disk floors measured on {raw['disk_sample_bytes'] / 1e9:.3g} GB and scaled "
              "to the state's bytes where a figure is compared with them.", ""]
    ks = next((list(f["ks"]) for f in figures.values()), [])
    rows, steps = [], []
    for name, block in raw["systems"].items():
        if not block["available"]:
            rows.append([name] + [f"n/a ({block['reason']})"] * (len(ks) + 2))
            steps.append([name] + [f"n/a ({block['reason']})"] * len(ks))
            continue
        f = figures[name]
        rows.append([name] + [_ms_x(f["ks"][k]["blocking_s"], "D2H") for k in ks]
                    + [_s_x(f["to_durable_s"], "disk"), _s_x(f["restore_s"], "H2D")])
        steps.append([name] + [_overhead(f["ks"][k]) for k in ks])
    lines += ["## Blocking, time to durable, restore", "",
              "Blocking: the `save` call plus the fence before the next optimizer step, per "
              "snapshot (× the device-to-host floor). Time to durable: a snapshot with nothing "
              "else running, from the call to durable (× the disk floor). Restore: the newest "
              "snapshot into the live model on the device, to a device synchronisation "
              "(× the host-to-device floor). `vs DCP`: × the best DCP variant in the same round.",
              "", table(["system"] + [f"blocking, K={k}" for k in ks]
                        + ["to durable", "restore onto the device"], rows), "",
              "## Training-step overhead", "",
              "Step time with a snapshot every K steps over the same loop without "
              "checkpointing just before it; `vs DCP`: step time × the best DCP variant's.", "",
              table(["system"] + [f"K={k}" for k in ks], steps), ""]
    checks = results["exactness"]
    lines += ["## Exactness", "",
              f"{sum(c['bit_exact'] for c in checks)} of {len(checks)} restores bit-exact; "
              f"RNG states (CPU and every CUDA device) restored exactly in "
              f"{sum(bool(c.get('rng_exact')) for c in checks)} of "
              f"{sum('rng_exact' in c for c in checks)} async_ckpt restores.", "",
              table(["system", "round", "step", "tensors differing", "RNG"],
                    [[c["system"], str(c["round"]), str(c["step"]),
                      f"{c['differing']} of {c['tensors']}",
                      {True: "exact", False: "DIFFERS", None: "not saved"}[c.get("rng_exact")]]
                     for c in checks]), ""]
    return "\n".join(lines)


def _machine_line(info: dict) -> str:
    gpu = info["gpu"]
    device = ("no GPU (--device cpu)" if gpu["device"] == "cpu" else
              f"{gpu['count']} x {gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB, "
              f"sm {gpu['capability']}, driver {gpu.get('driver', '?')}, CUDA {gpu['cuda']}, "
              f"PCIe gen {gpu.get('pcie_gen', '?')} x{gpu.get('pcie_width', '?')})")
    return (f"{device}; {info['nproc']} CPUs ({info['cpu_model']}), "
            f"{info['ram_bytes'] / 2**30:.0f} GiB RAM, Linux {info['kernel']}, Python "
            f"{info['python']}, torch {info['torch']}")


def _ms_x(entry: dict, floor: str) -> str:
    text = f"{median_range(entry['value'], 1e-3)} ms, {factor(entry['x_floor']['median'])} {floor}"
    return text + _vs_dcp(entry)


def _s_x(entry: dict, floor: str) -> str:
    text = f"{median_range(entry['value'])} s, {factor(entry['x_floor']['median'])} {floor}"
    return text + _vs_dcp(entry)


def _vs_dcp(entry: dict) -> str:
    return f", {factor(entry['x_best_dcp']['median'])} vs DCP" if "x_best_dcp" in entry else ""


def _overhead(per_k: dict) -> str:
    o = per_k["overhead"]
    text = (f"{(o['median'] - 1) * 100:+.1f}% ({(o['min'] - 1) * 100:+.1f}%–"
            f"{(o['max'] - 1) * 100:+.1f}%), {median_range(per_k['step_s']['value'], 1e-3)} ms")
    return text + (f", {hundredths(per_k['step_s']['x_best_dcp']['median'])}× vs DCP"
                   if "x_best_dcp" in per_k["step_s"] else "")
