"""``python -m bench``: every benchmark in one run, from the repository root.

Presets, options and outputs: docs/performance.md, "Running it"; ``--device``: ``bench/gpu.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from . import gpu, plots, records, report
from .core import scratch, summaries
from .harness import load_between, load_now, log, machine, write_atomic, write_results
from .parts import BY_KEY, PARTS, SWEEP, TRAINING
from .systems import STALL_SYSTEMS, SYSTEMS, SystemSpec

SCHEMA = 3  # 2: interleaved rounds (min-max spreads, per-round floors), cold restores, targets;
# 3: floors as the fastest of several ways (durable_s), settle waits, step_overhead_pct


@dataclass(frozen=True)
class Preset:
    """A run's defaults (``name``): the sweep's fp32 and bf16 state sizes (GB), the interleaved
    rounds, the training loop's model (``workloads.TrainingWorkload``) and snapshot intervals, the
    systems, and the keys of the ``parts.PARTS`` it runs, in order."""

    name: str
    sizes: tuple[float, ...]
    bf16_sizes: tuple[float, ...]
    rounds: int
    workload: dict
    ks: tuple[int, ...]
    systems: tuple[SystemSpec, ...] = SYSTEMS
    parts: tuple[str, ...] = tuple(BY_KEY)


FULL = Preset("full", (0.256, 1.0, 2.0), (0.256,), 3, {"width": 768, "depth": 10, "batch": 16},
              (1, 10, 100))
QUICK = Preset("quick", (0.008,), (), 2, {"width": 128, "depth": 2, "batch": 8}, (1, 3),
               parts=tuple(p.key for p in PARTS if p.quick))
STALL = Preset("stall", (1.0,), (), 7, FULL.workload, (), systems=STALL_SYSTEMS,
               parts=(SWEEP.key,))
KS = FULL.ks
COMMITTED_RESULTS = os.path.join("bench", "results")  # the report the README quotes
PARTIAL = "raw.partial.json"  # the parts measured so far, under --out (measure_parts)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true",
                         help="a tiny run (about a minute) that checks everything works")
    presets.add_argument("--stall", action="store_true",
                         help="the focused stall benchmark: the sweep alone, async_ckpt's modes "
                              "against torch.save + fsync (default 1 GB, 7 rounds)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="run the GPU benchmark (bench/gpu.py) on this device instead: "
                             "at most 5 minutes on one GPU; --quick: a tiny model")
    parser.add_argument("--params-gb", type=float, default=None, metavar="GB",
                        help="--device: GB of bf16 parameters of its transformer (default 1 on "
                             "cuda, 0.02 on cpu; the state is three times that)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="--device: end the rounds early when the next would end past this "
                             "many seconds of rounds (default 270 on cuda, none on cpu)")
    parser.add_argument("--sizes", type=_floats, default=None, metavar="GB,GB,...",
                        help="fp32 state sizes of the sweep in GB (default 0.256,1,2; "
                             "--quick: 0.008; --stall: 1)")
    parser.add_argument("--bf16-sizes", type=_floats, default=None, metavar="GB,...",
                        help="bf16 state sizes of the sweep (default 0.256; --quick: none; "
                             "'' for none)")
    parser.add_argument("--ks", type=_ints, default=None, metavar="K,K,...",
                        help="snapshot intervals of the training loop (default 1,10,100; "
                             "--quick: 1,3)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of every part (default 3; --quick: 2, and 1 for "
                             "the torchrun parts; --stall: 7)")
    parser.add_argument("--out", default=None,
                        help="where results.json, the PNGs and report.md go (default: "
                             f"{COMMITTED_RESULTS} for a full run with the default sizes and "
                             "intervals; a new scratch directory for a --quick or partial run, "
                             "so that it never overwrites the committed report)")
    parser.add_argument("--dir", default=None,
                        help="where to make the scratch directory (default /tmp); it is removed")
    parser.add_argument("--part", choices=sorted(p.key for p in PARTS if not p.raw), default=None,
                        help="run this part alone (no sweep): its report section on stdout, "
                             "nothing written under --out")
    parser.add_argument("--resume", action="store_true",
                        help="go on from the parts a stopped run with the same settings and "
                             f"--out measured ({PARTIAL} there)")
    parser.add_argument("--render", metavar="RESULTS_JSON", default=None,
                        help="measure nothing: re-render report.md and the plots into --out from "
                             "a saved results.json")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    if args.device is not None:
        return _device_args(parser, args)
    if args.params_gb is not None or args.budget is not None:
        parser.error("--params-gb and --budget go with --device")
    if args.part and (args.stall or args.render):
        parser.error("--part goes with neither --stall nor --render")
    args.preset = preset = STALL if args.stall else QUICK if args.quick else FULL
    args.sizes = preset.sizes if args.sizes is None else args.sizes
    args.bf16_sizes = preset.bf16_sizes if args.bf16_sizes is None else args.bf16_sizes
    args.ks = preset.ks if args.ks is None else args.ks
    args.rounds_given = args.rounds is not None  # else --quick runs torchrun parts once
    args.rounds = preset.rounds if args.rounds is None else args.rounds
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.sizes or any(s <= 0 for s in args.sizes + args.bf16_sizes):
        parser.error("--sizes needs at least one size, and every size must be positive")
    if TRAINING.key in preset.parts and (not args.ks or any(k < 1 for k in args.ks)):
        parser.error("--ks needs at least one interval, each at least 1")
    args.ks = tuple(sorted(set(args.ks)))
    if args.part:  # its section on stdout: no outputs, no plots
        return args
    if args.out is None:
        full = (preset is FULL and args.sizes == FULL.sizes and args.ks == KS
                and args.bf16_sizes == FULL.bf16_sizes and args.rounds == FULL.rounds)
        args.out = COMMITTED_RESULTS if full else tempfile.mkdtemp(prefix="bench-results-")
    if importlib.util.find_spec("matplotlib") is None:  # the plots: checked before measuring
        parser.error("the benchmark's plots need matplotlib: pip install -e '.[bench]'")
    return args


def _device_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The GPU benchmark's options: its own presets (``gpu.PRESETS``), none of the sweep's."""
    other = [flag for flag, value in (("--stall", args.stall), ("--sizes", args.sizes),
                                      ("--bf16-sizes", args.bf16_sizes), ("--ks", args.ks),
                                      ("--render", args.render), ("--part", args.part))
             if value]
    if other:
        parser.error(f"{', '.join(other)} do not go with --device")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if (args.params_gb is not None and args.params_gb <= 0) or (
            args.budget is not None and args.budget <= 0):
        parser.error("--params-gb and --budget must be positive")
    if args.out is None:
        args.out = gpu.default_out(args)
    return args


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.device is not None:
        return gpu.run(args)
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            results = json.load(f)
        if results.get("schema") != SCHEMA:
            sys.exit(f"{args.render} has schema {results.get('schema')}; this version renders "
                     f"schema {SCHEMA} only: measure again")
        os.makedirs(args.out, exist_ok=True)
        write_outputs(results, args.out, write_json=False)
        return 0
    if args.part:
        return _run_part(BY_KEY[args.part], args)
    os.makedirs(args.out, exist_ok=True)
    with scratch("bench-", args.dir or "/tmp") as root:
        raw, first, runtime_s = measure_parts(args, root)
    results = assemble(args, raw, first, runtime_s)
    write_outputs(results, args.out)
    os.remove(os.path.join(args.out, PARTIAL))
    log(f"results in {args.out}")
    return 0


def _run_part(part, args: argparse.Namespace) -> int:
    """``--part``: one part alone, its section printed; its scratch directory removed."""
    with scratch(f"bench-{part.key}-", args.dir or "/tmp") as root:
        print(part.render({part.key: part.run(args, root)}, ""))
    return 0


def measure_parts(args: argparse.Namespace, root: str) -> tuple[dict, dict, float]:
    """Each part of the preset in turn: their raw results, by part, saved under
    ``--out`` after each (``PARTIAL``), so that a run stopped by a failing part goes on from
    there with ``--resume`` rather than measuring an hour again. With the raw results: the first
    of those runs' start (``started_at``, ``machine``, ``load_start``, ``command``: the report's
    header) and how long all of them measured the parts kept."""
    partial = os.path.join(args.out, PARTIAL)
    identity = {"preset": args.preset.name, "sizes": list(args.sizes), "ks": list(args.ks),
                "bf16_sizes": list(args.bf16_sizes), "rounds": args.rounds}
    saved = _resumed(partial, identity) if args.resume else {}
    raw, first = saved.get("raw", {}), saved.get("first") or {
        "started_at": time.time(), "machine": machine(), "load_start": load_now(),
        "command": args.command}
    earlier_s, start = saved.get("runtime_s", 0.0), time.perf_counter()
    for part in args.preset.parts:
        if part in raw:
            log(f"{part}: measured by the run resumed, kept")
            continue
        raw[part] = BY_KEY[part].run(args, root)
        write_atomic(partial, json.dumps(
            {"identity": identity, "first": first,
             "runtime_s": earlier_s + time.perf_counter() - start, "raw": raw},
            default=records.to_json))
        log(f"{part} done after {time.perf_counter() - start:.0f} s")
    return raw, first, earlier_s + time.perf_counter() - start


def _resumed(partial: str, identity: dict) -> dict:
    """What a stopped run of the same settings saved (``--resume``): its parts' raw results, its
    first start and how long it measured (a file from before these two lacks them)."""
    try:
        with open(partial, encoding="utf-8") as f:
            saved = json.load(f)
    except FileNotFoundError:
        sys.exit(f"--resume: no {partial}: nothing to resume")
    if saved.get("identity") != identity:
        sys.exit(f"--resume: {partial} was measured with other settings ({saved.get('identity')})")
    return saved


def assemble(args: argparse.Namespace, raw: dict, first: dict, runtime_s: float) -> dict:
    """results.json's content (with typed records, ``records.to_json`` writes them) from the
    parts' raw results; ``first``: the first run's start (``measure_parts``)."""
    load = load_between(first["load_start"], load_now())
    ran = [part for part in PARTS if part.key in raw]
    results = {
        "schema": SCHEMA, "started_at": first["started_at"], "runtime_s": runtime_s,
        "machine": first["machine"], "loadavg_end": load["loadavg_end"],
        "vmstat_delta": load["vmstat_delta"],
        "config": {"command": first["command"], "preset": args.preset.name,
                   "quick": args.quick, "sizes_gb": list(args.sizes),
                   "bf16_sizes_gb": list(args.bf16_sizes), "ks": list(args.ks),
                   "rounds": args.rounds},
        **summaries(args.preset.systems, raw[SWEEP.key], raw.get(TRAINING.key)),
        "loads": {label: record for part in ran
                  for label, record in part.loads(raw[part.key]).items()},
        "raw": {part.key: raw[part.key] for part in ran if part.raw},
    }
    results.update({part.key: raw[part.key] for part in ran if not part.raw})
    return results


def write_outputs(results: dict, out: str, write_json: bool = True) -> None:
    """``harness.write_results``, then the plots. The report links the plots relative to the
    working directory (the repository root), so that it can be pasted into the README as it is."""
    results = write_results(out, results, lambda r: report.render(r, PARTS, _image_dir(out)),
                            write_json)
    pngs = plots.write(results, out)
    log(f"wrote to {out}: {', '.join(['results.json'] * write_json + ['report.md'])}, "
        f"{', '.join(map(os.path.basename, pngs))}")


def _image_dir(out: str) -> str:
    relative = os.path.relpath(os.path.abspath(out))
    return os.path.abspath(out) if relative.startswith("..") else relative.replace(os.sep, "/")


if __name__ == "__main__":
    sys.exit(main())
