"""The benchmarks keep running: ``python -m bench --quick`` finishes and writes complete output.

This checks that every system and every figure is present (a peer that cannot run here is "n/a"
with a reason), that the runs are interleaved rounds with a floor sample each, that the PNGs are
valid images and that report.md has its tables (the targets, the min-max spreads, warm and cold
restores, the machine's load), and that async_ckpt restores bit for bit and catches a damaged
snapshot in the run. It checks no timing: ``--quick`` is far too small and short to measure
anything.
"""

import ast
import importlib
import importlib.util
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import pytest


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.core import FIGURES, MEMORY_FIGURES, SWEEP_FIGURES, TARGETS  # noqa: E402
from bench.core import TRAINING_FIGURES, case_label  # noqa: E402
from bench.systems import NONE, RANK_SYSTEMS, SHARDED_SYSTEMS, STALL_SYSTEMS  # noqa: E402
from bench.systems import SYSTEM_NAMES, SYSTEMS  # noqa: E402
from bench.__main__ import COMMITTED_RESULTS, KS, QUICK, STALL, assemble, parse_args  # noqa: E402
from bench import floors as floors_module  # noqa: E402
from bench.floors import FLOOR_KEYS, READ_WAYS, WRITE_WAYS, Fastest, Floors  # noqa: E402
from bench.harness import Settled, load_now, ratio_spread, rotated, run_rounds  # noqa: E402
from bench.harness import settle, spread  # noqa: E402
from bench.parts import BY_KEY, PARTS, loop_steps  # noqa: E402
from bench.distributed import OURS as SHARDED_OURS, PLAN as SHARDED_PLAN  # noqa: E402
from bench.distributed import QUICK as TORCHRUN_QUICK  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def no_process_group_left():
    """Tests here run DCP's peers in this process, which start a one-process gloo group and set
    MASTER_ADDR (bench/systems.py): both go with the module, so that the next test file in this
    worker (an Accelerator, say) does not find a process group and take itself for distributed."""
    saved = os.environ.get("MASTER_ADDR")
    yield
    from bench.systems import shutdown_dcp

    shutdown_dcp()
    if saved is None:
        os.environ.pop("MASTER_ADDR", None)
    else:
        os.environ["MASTER_ADDR"] = saved


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    scratch = tmp_path_factory.mktemp("bench-scratch")
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out),
                           "--dir", str(scratch)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "results.json") as f:
        results = json.load(f)
    return out, results, proc


def test_every_system_and_figure_is_reported(quick_run):
    _, results, _ = quick_run
    sweep_cases = [case_label("fp32", s) for s in QUICK.sizes] + \
        [case_label("bf16", s) for s in QUICK.bf16_sizes]
    expected_cases = {**{f.key: sweep_cases for f in SWEEP_FIGURES},
                      **{f.key: [f"K={k}" for k in QUICK.ks] for f in TRAINING_FIGURES},
                      **{f.key: ["loop"] for f in MEMORY_FIGURES}}
    assert set(results["figures"]) == {f.key for f in FIGURES}
    for key, figure in results["figures"].items():
        assert figure["cases"] == expected_cases[key], key
        assert set(SYSTEM_NAMES) <= set(figure["values"]), key
        for name in SYSTEM_NAMES:
            for case in expected_cases[key]:
                entry = figure["values"][name][case]
                if isinstance(entry, str):
                    assert entry.startswith("n/a (") and entry.endswith(")"), (key, name, entry)
                    continue
                assert isinstance(entry["median"], (int, float)), (key, name, case)
                assert "x_floor" in entry and "x_best_peer" in entry, (key, name, case)
        assert set(figure["best_peer"]) == set(expected_cases[key])
    for f in results["figures"]["throughput_steps_s"]["values"][NONE.name].values():
        assert f["median"] > 0


def test_our_systems_run_and_restore_bit_exact(quick_run):
    _, results, _ = quick_run
    ran = {s["name"]: s for s in results["systems"]}
    assert set(ran) == set(SYSTEM_NAMES)
    for spec in SYSTEMS:
        row = ran[spec.name]
        assert row["ran"] or row["reason"], spec.name
        if spec.ours:
            assert row["ran"] and row["failed_cases"] == 0, spec.name
            check = results["consistency"][spec.name]
            assert check["bit_exact"], spec.name
            assert check["damage"]["outcome"] == "detected", spec.name
            for key in ("blocking_s", "to_durable_s", "restore_s", "throughput_steps_s"):
                values = results["figures"][key]["values"][spec.name]
                assert all(isinstance(v, dict) for v in values.values()), (key, spec.name)


def test_floors_are_the_fastest_way(quick_run):
    _, results, _ = quick_run
    for label, floors in results["floors"].items():
        assert set(FLOOR_KEYS) <= set(floors), label
        for key in FLOOR_KEYS:
            assert floors[key]["min"] <= floors[key]["median"] <= floors[key]["max"], (label, key)
        for key in ("durable_s", "read_cache_s", "read_cold_s"):  # the fastest way, every round
            ways = {"durable_s": WRITE_WAYS}.get(key, READ_WAYS)
            for fastest, times in zip(floors[key]["fastest"], floors[key]["ways"], strict=True):
                assert set(times) == set(ways) and fastest in ways, (label, key)
                assert times[fastest] == min(t for t in times.values() if not isinstance(t, str))


def test_rounds_are_interleaved_with_a_floor_each(quick_run):
    _, results, _ = quick_run
    rounds = QUICK.rounds
    assert rounds >= 2 and results["config"]["rounds"] == rounds
    for shift, (label, case) in enumerate(results["raw"]["sweep"].items()):
        assert len(case["order"]) == len(case["floors"]) == len(case["loads"]) == rounds, label
        firsts = [order[0] for order in case["order"]]
        assert len(set(firsts)) == rounds, (label, firsts)  # the order rotates
        for index, order in enumerate(case["order"]):  # and walks backward in odd rounds
            assert order == [n for n in rotated(SYSTEM_NAMES, shift + index) if n in order], label
        for order, settled in zip(case["order"], case["settle"], strict=True):
            assert [slot["name"] for slot in settled] == order, label  # a settle before each
            assert all(slot["waited_s"] >= 0 for slot in settled), label
        for spec in SYSTEMS:
            block = case["systems"][spec.name]
            if spec.ours:
                assert [r["round"] for r in block["runs"]] == list(range(rounds)), spec.name
                for run in block["runs"]:
                    assert run["restore_s"] > 0 and run["restore_cold_s"] > 0, spec.name
    for spec in SYSTEMS:
        if spec.ours:
            entry = results["figures"]["restore_cold_s"]["values"][spec.name][case_label(
                "fp32", QUICK.sizes[0])]
            assert entry["n"] == rounds and entry["min"] <= entry["median"] <= entry["max"]
            assert len(results["raw"]["training"]["systems"][spec.name]["runs"]) == rounds
    assert len(results["ranks"]["raw"]["floors"]) == TORCHRUN_QUICK["rounds"]
    assert set(results["loads"]) >= {"training loop", "two ranks"}


def test_targets(quick_run):
    _, results, _ = quick_run
    targets = results["targets"]
    assert targets["cases"] == [case_label("fp32", s) for s in QUICK.sizes]
    assert [row["key"] for row in targets["rows"]] == [t.key for t in TARGETS]
    for row in targets["rows"]:
        for case, entry in row["values"].items():
            if isinstance(entry, str):
                assert entry.startswith("n/a (") and row["key"].startswith("zstd"), (row, case)
                continue
            assert entry["n"] == QUICK.rounds, row["key"]
            assert entry["min"] <= entry["median"] <= entry["max"], row["key"]
            assert entry["meets"] == (entry["median"] <= row["limit"]), row["key"]


def test_two_ranks_against_dcp(quick_run):
    _, results, _ = quick_run
    ranks = results["ranks"]
    assert ranks["ranks"] == 2 and set(ranks["floors"]) == {"copy_s", "durable_s"}
    assert len(ranks["floor_ways"]) == TORCHRUN_QUICK["rounds"]
    assert set(ranks["floor_ways"]) <= set(WRITE_WAYS)
    assert set(ranks["systems"]) == {spec.name for spec in RANK_SYSTEMS}
    for spec in RANK_SYSTEMS:
        name, s = spec.name, ranks["systems"][spec.name]
        if not spec.ours and not s["available"]:
            assert s["reason"], name
            continue
        assert s["available"], name
        for key in ("blocking", "to_commit"):
            assert s[f"{key}_s"]["median"] > 0 and s[f"{key}_x_floor"] > 0, (name, key)
            assert s[f"{key}_s"]["n"] == TORCHRUN_QUICK["rounds"], (name, key)
        assert len(s["bytes_per_rank"]) == 2 and s["stored_bytes"] >= sum(s["bytes_per_rank"])
    ours = ranks["systems"]["async_ckpt async, replicated written by rank 0"]
    # Replicated state is written once, by rank 0: rank 1 writes only its own small state.
    assert ours["bytes_per_rank"][1] < ours["bytes_per_rank"][0] / 20
    assert ours["stored_bytes"] < 1.2 * ranks["state_bytes"]


def test_sharded_state_against_dcp(quick_run):
    out, results, _ = quick_run
    block = results["sharded"]
    assert set(block["save"]) == {str(world) for world, _, save in SHARDED_PLAN if save} == {"2", "4"}
    for world, w in block["save"].items():
        assert w["ranks"] == int(world) == len(w["rank_bytes"])
        assert w["rounds"] == TORCHRUN_QUICK["rounds"]
        assert set(w["floors"]) == {"copy_s", "durable_s"}
        assert len(w["floor_ways"]) == TORCHRUN_QUICK["rounds"]
        assert set(w["systems"]) == {spec.name for spec in SHARDED_SYSTEMS}
        for spec in SHARDED_SYSTEMS:
            name, s = spec.name, w["systems"][spec.name]
            if not spec.ours and not s["available"]:
                assert s["reason"], (world, name)
                continue
            assert s["available"], (world, name)
            for key in ("blocking", "to_commit"):
                assert s[f"{key}_s"]["n"] == TORCHRUN_QUICK["rounds"]
                assert s[f"{key}_s"]["median"] > 0
                assert s[f"{key}_x_floor"]["median"] > 0, (world, name, key)
            assert len(s["bytes_per_rank"]) == int(world), (world, name)
        ours = w["systems"][SHARDED_OURS]
        # Every rank writes only its own pieces: about its share of the state, not all of it.
        assert max(ours["bytes_per_rank"]) < 1.5 * max(w["rank_bytes"])
        peers = {spec.name for spec in SHARDED_SYSTEMS
                 if not spec.ours and w["systems"][spec.name]["available"]}
        assert set(ours["blocking_x_dcp"]) == set(ours["to_commit_x_dcp"]) == peers
    assert set(block["restore"]) == {"2->4", "4->2"}
    for pair, r in block["restore"].items():
        assert f"{r['saved_at']}->{r['restored_at']}" == pair
        assert r["systems"][SHARDED_OURS]["restore_s"]["n"] == TORCHRUN_QUICK["rounds"], pair
        if r["systems"]["DCP load"]["available"]:
            assert r["x_dcp"]["n"] == TORCHRUN_QUICK["rounds"] and r["x_dcp"]["median"] > 0, pair
    assert {"sharded, 4 ranks saving", "sharded, restore 4->2"} <= set(results["loads"])
    report = (out / "report.md").read_text()
    assert "### Sharded state (FSDP2) under torchrun" in report
    assert "| 4 → 2 |" in report and "| 2 → 4 |" in report


def test_plots_are_pngs(quick_run):
    out, _, _ = quick_run
    for name in ("blocking_vs_size.png", "throughput_vs_k.png"):
        with open(out / name, "rb") as f:
            head = f.read(24)
        assert head[:8] == PNG_SIGNATURE, name
        assert head[12:16] == b"IHDR", name
        width, height = struct.unpack(">II", head[16:24])
        assert width > 200 and height > 200, name


def test_report_has_the_tables(quick_run):
    out, _, proc = quick_run
    with open(out / "report.md") as f:
        report = f.read()
    for heading in ("### Targets", "### Floors", "### Saving and restoring", "### Training loop",
                    "Per-step time overhead against that loop without checkpointing",
                    "Per round the fastest way (bold, the floor)",
                    "### Memory in the training loop", "### Recovery consistency",
                    "### Every state size", "### 2 ranks under torchrun", "### Machine load"):
        assert heading in report, heading
    for target in TARGETS:
        assert f"| {target.title} |" in report, target.key
    for column in ("blocking s (min–max)", "to durable s (min–max) · ×disk floor",
                   "warm restore s", "cold restore s · ×cold read",
                   "cold read (fastest, from disk)", "Cold restore time into the live model",
                   "step time overhead",
                   "disk settle before a system"):
        assert column in report, column
    assert "(p95" not in report
    for name in SYSTEM_NAMES:
        assert f"| {name} |" in report, name
    assert "blocking_vs_size.png" in report and "throughput_vs_k.png" in report
    assert "### Floors" in proc.stdout  # the tables are printed too
    assert "Per training step, a snapshot every 1 and 3 steps costs async_ckpt async" in report


def test_step_time_overhead_is_a_figure_of_every_system(quick_run):
    _, results, _ = quick_run
    figure = results["figures"]["step_overhead_pct"]
    assert figure["cases"] == [f"K={k}" for k in QUICK.ks] and figure["unit"] == "%"
    for name, block in results["raw"]["training"]["systems"].items():
        for k in QUICK.ks:
            entry = figure["values"][name][f"K={k}"]
            if not block["available"]:
                assert entry.startswith("n/a ("), (name, k)
                continue
            loops = [run["loops"][str(k)] for run in block["runs"]]
            paired = [(lp["step_s"] / lp["baseline"]["step_s"] - 1) * 100 for lp in loops]
            assert entry["n"] == QUICK.rounds and entry["median"] == spread(paired)["median"]
            assert entry["min"] == min(paired) and entry["max"] == max(paired), (name, k)


def test_the_stall_preset_reports_its_sweep_alone(quick_run, tmp_path):
    """``--stall`` is the sweep alone with its own systems: results and report hold that, the
    targets its systems can meet, no training loop. Built here from the quick run's sweep, cut to
    the stall's systems, as ``python -m bench --stall`` builds them from its own."""
    from bench.__main__ import write_outputs

    _, results, _ = quick_run
    names = [spec.name for spec in STALL_SYSTEMS]
    sweep = {label: {**case, "systems": {name: case["systems"][name] for name in names}}
             for label, case in results["raw"]["sweep"].items()}
    args = parse_args(["--stall", "--sizes", ",".join(map(str, QUICK.sizes)), "--rounds",
                       str(QUICK.rounds), "--out", str(tmp_path)])
    first = {"started_at": 0.0, "machine": results["machine"], "load_start": load_now(),
             "command": args.command}
    write_outputs(assemble(args, {"sweep": sweep}, first, 1.0),
                  str(tmp_path))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in saved["systems"]] == names and saved["config"]["preset"] == "stall"
    assert all(s["ran"] for s in saved["systems"])
    assert set(saved["figures"]) == {f.key for f in SWEEP_FIGURES} and "training" not in saved["raw"]
    keys = [row["key"] for row in saved["targets"]["rows"]]
    assert keys == [t.key for t in TARGETS if t.key != "async_restore_x_dcp"]  # no DCP here
    report = (tmp_path / "report.md").read_text()
    for heading in ("### Targets", "### Floors", "### Saving and restoring", "### Every state size",
                    "### Machine load", "| async_ckpt async blocking / copy floor"):
        assert heading in report, heading
    for absent in ("Training loop", "### Recovery consistency", "### 2 ranks", "| DCP"):
        assert absent not in report, absent
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["blocking_vs_size.png"]


def test_render_from_saved_results(quick_run, tmp_path):
    out, _, _ = quick_run
    proc = subprocess.run([sys.executable, "-m", "bench", "--render", str(out / "results.json"),
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "report.md") as a, open(tmp_path / "report.md") as b:
        before, after = ([ln for ln in f.read().splitlines() if "](" not in ln] for f in (a, b))
    assert before == after  # the same tables; only the plots' links differ
    assert (tmp_path / "throughput_vs_k.png").stat().st_size > 0
    assert not (tmp_path / "results.json").exists()


def test_the_committed_report_is_what_the_renderer_makes_of_the_committed_results():
    """The golden check of a refactoring of the report: rendering the committed results.json
    gives the committed report.md byte for byte (re-rendered whenever the renderer changes)."""
    from bench import report

    with open(os.path.join(REPO, COMMITTED_RESULTS, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    with open(os.path.join(REPO, COMMITTED_RESULTS, "report.md"), encoding="utf-8") as f:
        assert report.render(results, PARTS, image_dir=COMMITTED_RESULTS) == f.read()


def test_options():
    args = parse_args(["--quick", "--sizes", "0.01,0.02", "--bf16-sizes", "", "--ks", "10,1"])
    assert args.sizes == (0.01, 0.02) and args.bf16_sizes == () and args.ks == (1, 10)
    assert parse_args([]).sizes == (0.256, 1.0, 2.0) and parse_args([]).rounds >= 3
    assert parse_args(["--rounds", "5"]).rounds == 5
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--sizes", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--ks", "0"])
    assert [loop_steps(k, quick=False) for k in KS] == [8, 30, 100]
    assert all(loop_steps(k, quick=True) // k >= 2 for k in KS)
    stall = parse_args(["--stall"])
    assert stall.preset is STALL and (stall.sizes, stall.rounds, stall.ks) == ((1.0,), 7, ())
    assert os.path.abspath(stall.out) != os.path.abspath(COMMITTED_RESULTS)
    os.rmdir(stall.out)
    with pytest.raises(SystemExit):
        parse_args(["--stall", "--quick"])


@pytest.mark.parametrize("argv", [["--quick"], ["--sizes", "0.064"], ["--ks", "10"],
                                  ["--rounds", "1"]])
def test_a_quick_or_partial_run_never_writes_over_the_committed_report(argv):
    assert parse_args([]).out == COMMITTED_RESULTS
    out = parse_args(argv).out
    assert os.path.abspath(out) != os.path.abspath(COMMITTED_RESULTS) and os.path.isdir(out)
    os.rmdir(out)


def test_incremental_snapshots_are_measured_and_reported(quick_run):
    out, results, _ = quick_run
    block = results["incremental"]
    assert set(block["runs"]) == {"incremental", "trainable only"}
    for run in block["runs"].values():
        assert len(run["blocking_s"]["samples"]) >= 3
        assert run["blocking_s"]["min"] <= run["blocking_s"]["median"] <= run["blocking_s"]["max"]
    # The frozen base is written once, by the first (full) snapshot, and then only referred to.
    assert block["runs"]["incremental"]["first"]["written_bytes"] > block["base_bytes"]
    assert block["runs"]["incremental"]["written_bytes"]["max"] < block["base_bytes"]
    assert "## Incremental snapshots" in (out / "report.md").read_text()


def test_direct_writes_are_measured_against_the_buffered_writer_and_reported(quick_run):
    from bench import direct

    out, results, _ = quick_run
    (cell,) = results["direct"]["cells"]
    assert cell["floors"]["durable_s"]["median"] > 0 and cell["floors"]["read_cold_s"]["median"] > 0
    for writer in direct.WRITERS:
        for figure in direct.FIGURES + ("to_durable_over_floor", "cold_restore_over_floor"):
            assert cell[writer][figure]["median"] >= 0  # CPU time may round to 0 at 8 MB
        assert cell[writer]["to_durable_s"]["median"] > 0
    assert "### Direct writes against the buffered writer" in (out / "report.md").read_text()


def test_lazy_staging_is_measured_and_reported(quick_run):
    from bench import lazy
    from bench.systems import LAZY_SYSTEMS, OURS_ASYNC, OURS_LAZY, OURS_LAZY_NICED

    out, results, _ = quick_run
    figures = results["lazy"]["figures"]
    assert set(figures) == {spec.name for spec in LAZY_SYSTEMS}
    for name in (OURS_ASYNC.name, OURS_LAZY.name, OURS_LAZY_NICED.name, lazy.FEWER):
        for k in ("1", "10"):
            cell = figures[name]["ks"][k]
            assert cell["overhead"]["median"] > 0 and cell["blocking_x_copy"]["median"] > 0
    assert "overhead_vs_full_threads" in figures[lazy.FEWER]["ks"]["1"]
    report = (out / "report.md").read_text()
    assert "### Lazy staging in the training loop" in report and OURS_LAZY_NICED.name in report


def test_the_memory_tier_is_measured_and_reported(quick_run):
    out, results, _ = quick_run
    block = results["memory_tier"]  # its restores were checked bit for bit in the run
    figures = block["figures"]
    for staging in ("eager", "lazy"):
        assert figures[staging]["blocking_x_copy"]["median"] > 0
        assert figures[staging]["overhead"]["median"] > 0
    assert all(figures["restore"][f"{way}_x_copy"]["median"] > 0
               for way in ("memory", "warm", "cold"))
    assert figures["kills"]["advised_every"] >= 1 and figures["kills"]["memory_redone"] is None
    assert "### Memory tier (`memory_every=1`)" in (out / "report.md").read_text()


def test_every_framework_adapter_is_measured_and_reported(quick_run):
    out, results, _ = quick_run
    report = (out / "report.md").read_text()
    for key, heading in (("integrations_lightning", "Lightning"),
                         ("integrations_transformers", "Hugging Face Trainer"),
                         ("integrations_accelerate", "Accelerate")):
        assert results[key]["figures"], key
        assert heading in report, heading


def test_the_torchtitan_part_is_measured_where_torchtitan_is_installed(tmp_path, monkeypatch):
    from bench import frameworks

    assert BY_KEY["integrations_torchtitan"].render({"integrations_torchtitan": {}}, "") == ""
    monkeypatch.setattr(frameworks.importlib.util, "find_spec", lambda name: None)
    skipped = frameworks.TORCHTITAN.run(str(tmp_path), quick=True)
    assert "Not measured: torchtitan is not installed" in BY_KEY["integrations_torchtitan"].render(
        {"integrations_torchtitan": skipped}, "")


@pytest.mark.parametrize("key, setup", [
    ("integrations_deepspeed", "ZeRO stage 2 on 2 ranks (CPU, gloo), 270 MB of fp32 parameters"),
    ("integrations_lightning_sharded", "FSDP2 on 2 ranks (CPU, gloo), 270 MB of parameters")])
def test_the_two_rank_framework_parts_run_in_full_runs_only_and_report_after_the_warm_up(key,
                                                                                          setup):
    """Their torchruns of two framework ranks cost a minute each: measured by full runs only."""
    from bench.__main__ import FULL
    from bench.frameworks import DEEPSPEED, KINDS, LIGHTNING_SHARDED, pair_block

    part = BY_KEY[key]
    assert key in set(FULL.parts) - set(QUICK.parts)
    framework = {f.key: f for f in (DEEPSPEED, LIGHTNING_SHARDED)}[key]
    ours, theirs = framework.sides
    rounds_of_pairs = ((9.0, 1.0), (0.1, 0.2), (0.3, 0.6))  # the first: a warm-up
    rounds = [{f"{system}_{kind}_s": seconds for kind in (*KINDS, "restore")
               for system, seconds in ((ours, a), (theirs, b))} for a, b in rounds_of_pairs]
    raw = {"state_bytes": 2.7e8, "rounds": rounds}  # the restores: the same figures
    block = pair_block(framework, framework.configs[1], raw, raw)
    text = part.render({key: block}, "")
    assert "| training blocked | 200 ms (100–300) | 400 ms (200–600) | ×0.500 (0.500–0.500) |" \
        in text
    if key == "integrations_lightning_sharded":
        assert ("| restore of the last 2-rank checkpoint on 4 ranks (resharded) | 200 ms "
                "(100–300) | 400 ms (200–600) (DCP's load) | ×0.500 (0.500–0.500) |") in text
    assert setup in text and "median of 2 interleaved rounds after a warm-up" in text
    assert part.render({}, "") == ""


def test_typed_records_travel_through_results_json_unchanged():
    from bench.records import (Cell, Consistency, Damage, FigureValues, NotAvailable, TargetRatio,
                               TargetRow, Targets, to_json)

    cell = Cell(2.0, 1.0, 3.0, 3, floor=1.0, x_floor=2.0, extra={"drain_s": 0.5})
    figure = FigureValues("t", "s", "f", True, ["a"], {"a": None},
                          {"x": {"a": cell}, "y": {"a": NotAvailable("absent (here)")}})
    saved = json.loads(json.dumps(figure, default=to_json))
    assert saved["values"] == {"x": {"a": {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3,
                                           "floor": 1.0, "x_floor": 2.0, "x_best_peer": None,
                                           "drain_s": 0.5}},
                               "y": {"a": "n/a (absent (here))"}}
    assert FigureValues.from_json(saved) == figure
    targets = Targets(["a"], [TargetRow("k", "t", 1.0, {"a": TargetRatio(1.0, 1.0, 1.0, 1, True)})])
    assert Targets.from_json(json.loads(json.dumps(targets, default=to_json))) == targets
    check = Consistency(3, 0.5, 3, True, 0, 8, Damage("detected", "fell back to step 1"))
    assert Consistency.from_json(json.loads(json.dumps(check, default=to_json))) == check
    assert Consistency.from_json("n/a (did not run)") == NotAvailable("did not run")


def test_spread_and_pairwise_ratios():
    assert spread([3, 1, 2]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    # round by round: 2/1, 4/4, 9/3, not the ratio of the medians (4/3)
    assert ratio_spread([2, 4, 9], [1, 4, 3]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    with pytest.raises(ValueError):
        ratio_spread([1, 2], [1])
    assert [rotated("abc", shift) for shift in range(4)] == [
        list("abc"), list("bac"), list("cab"), list("acb")]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_the_order_rule_starts_each_round_elsewhere_and_reverses_odd_rounds(n):
    items = list(range(n))
    for index in range(2 * n):
        order = rotated(items, index)
        assert sorted(order) == items and order[0] == items[index % n]  # all, from a new first
        step = -1 if index % 2 else 1
        assert all(b == (a + step) % n for a, b in zip(order, order[1:]))  # forward or backward
    if n >= 3:  # every item follows one neighbour in even rounds and the other in odd rounds
        orders = [rotated(items, parity) for parity in (0, 1)]
        before = [{b: a for a, b in zip(order, order[1:])} for order in orders]
        assert all(before[0].get(i) != before[1].get(i) for i in items)


class FakeDisk:
    """/proc/meminfo's unwritten bytes, a reading per call, on a clock that only ``sleep`` moves."""

    def __init__(self, readings):
        self.readings, self.now, self.sleeps = list(readings), 0.0, 0

    def unwritten(self) -> int:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1


def test_settle_waits_until_the_kernel_has_written_back(monkeypatch):
    from bench import harness

    disk = FakeDisk([500 << 20, 200 << 20, 40 << 20, 1 << 20])
    monkeypatch.setattr(harness, "unwritten_bytes", disk.unwritten)
    settled = settle(10**9, below=32 << 20, clock=lambda: disk.now, sleep=disk.sleep)
    assert settled == Settled(disk.now, 500 << 20, 1 << 20, False) and disk.sleeps == 3


def test_settle_gives_up_after_the_time_the_disk_needs_for_the_bytes(monkeypatch):
    from bench import harness

    disk = FakeDisk([500 << 20])  # another job keeps the disk busy
    monkeypatch.setattr(harness, "unwritten_bytes", disk.unwritten)
    settled = settle(50 * 10**6, below=32 << 20, clock=lambda: disk.now, sleep=disk.sleep)
    limit = 50 * 10**6 / harness.SETTLE_BYTES_PER_S
    assert settled.timed_out and settled.unwritten_after == 500 << 20
    assert limit <= settled.waited_s < limit + harness.SETTLE_POLL_S * 1.5
    clean = FakeDisk([0])
    monkeypatch.setattr(harness, "unwritten_bytes", clean.unwritten)
    assert settle(10**9, clock=lambda: clean.now, sleep=clean.sleep) == Settled(0.0, 0, 0, False)
    assert clean.sleeps == 0  # a settled disk costs one reading


def test_a_floor_is_the_fastest_of_its_ways(tmp_path, monkeypatch):
    assert Fastest.of({"a": 2.0, "b": 1.0, "c": "n/a (absent)"}).fields("durable_s") == {
        "durable_s": 1.0, "durable_way": "b",
        "durable_ways": {"a": 2.0, "b": 1.0, "c": "n/a (absent)"}}
    monkeypatch.setattr(floors_module, "FIO_MIN_BYTES", 0)  # fio too, where it is installed
    floors = Floors(str(tmp_path), 3 << 20)
    try:
        first, second = floors.measure(), floors.measure()
    finally:
        floors.close()
    assert list(first["durable_ways"]) == list(WRITE_WAYS)  # the ways' order rotates by sample
    assert list(second["durable_ways"]) == [WRITE_WAYS[1], WRITE_WAYS[0], *WRITE_WAYS[:1:-1]]
    for key, ways in (("durable", WRITE_WAYS), ("read_cache", READ_WAYS),
                      ("read_cold", READ_WAYS)):
        times = first[f"{key}_ways"]
        ran = {w: t for w, t in times.items() if not isinstance(t, str)}
        assert set(times) == set(ways) and first[f"{key}_s"] == min(ran.values()) > 0, key
        assert ran[first[f"{key}_way"]] == first[f"{key}_s"], key
    for way in ("fio direct", "fio buffered"):
        t = first["durable_ways"][way]
        if shutil.which("fio") is None:
            assert t == "n/a (fio is not installed: apt-get install fio)"
        else:  # only O_DIRECT on a file system without it may fail, and says so
            assert isinstance(t, float) and t > 0 or t.startswith("n/a (fio failed here"), way
    assert os.listdir(tmp_path) == []  # every way's file is gone


def test_run_rounds_follows_the_order_rule_and_takes_the_floor_before_the_first_cleanup():
    events = []

    def run_slot(index, item, floor_hook):
        events.append(("run", index, item))
        if item == "b" and index == 1:  # fails before it can call the hook: n/a from now on
            events.append(("cleanup", index, item))
            return {"available": False, "reason": "failed"}
        floor_hook()  # the first call of a round measures; later calls return that sample
        events.append(("cleanup", index, item))
        return {"value": index}

    def measure_floor():
        events.append(("floor",))
        return {"dd_s": len(events)}

    record = run_rounds(["a", "b", "c"], 3, 0, measure_floor, run_slot, name=str)
    assert record["order"] == [["a", "b", "c"], ["b", "a", "c"], ["c", "a"]]
    assert [[slot["name"] for slot in r] for r in record["settle"]] == record["order"]
    assert len(record["floors"]) == len(record["loads"]) == 3 and "load" in record
    assert events[:3] == [("run", 0, "a"), ("floor",), ("cleanup", 0, "a")]  # before cleanup
    second = events[events.index(("run", 1, "b")):]
    assert second[:3] == [("run", 1, "b"), ("cleanup", 1, "b"), ("floor",)]  # right after
    assert events.count(("floor",)) == 3
    assert record["systems"]["b"] == {"available": False, "reason": "failed"}
    assert record["systems"]["a"]["runs"] == [{"round": i, "value": i} for i in range(3)]
    budgeted = run_rounds(["a"], 3, 0, dict, lambda *_: {}, name=str, budget_s=1e-9)
    assert len(budgeted["floors"]) == 1  # the next round would end past the budget


def test_big_states_run_the_big_systems_only(monkeypatch, tmp_path):
    from bench import core
    from bench.systems import BIG_SYSTEMS, TORCH_SAVE, by_name

    monkeypatch.setattr(core, "BIG_GB", 0.001)  # 2 MB counts as big
    small = by_name("DCP async_save (default stager)")
    assert TORCH_SAVE.name in BIG_SYSTEMS and small.name not in BIG_SYSTEMS
    case = core.run_case([TORCH_SAVE, small], "fp32", 0.002, str(tmp_path), rounds=2, shift=0)
    assert case["systems"][small.name] == {"available": False, "skipped": True,
                                           "reason": core.SKIPPED}
    assert case["order"] == [[TORCH_SAVE.name]] * 2 and len(case["floors"]) == 2
    runs = case["systems"][TORCH_SAVE.name]["runs"]
    assert [r["round"] for r in runs] == [0, 1]
    assert all(r["restore_cold_s"] > 0 and r["restore_s"] > 0 for r in runs)
    assert os.listdir(tmp_path) == []  # the dd file and the systems' directories are gone


def test_a_zstd_restore_is_measured_on_one_core_and_on_all(quick_run):
    out, results, _ = quick_run
    block = results["decode"]
    every = len(os.sched_getaffinity(0))
    assert block["cores"] == sorted({1, every})
    for cores in block["cores"]:
        samples = block["restore_s"][str(cores)]["samples"]
        assert len(samples) == block["config"]["rounds"] and all(s > 0 for s in samples)
    assert block["speedup"]["n"] == block["config"]["rounds"]
    assert "### zstd restore across cores" in (out / "report.md").read_text()


def _imports(path: pathlib.Path) -> set[str]:
    """What a module of bench/ imports, at the top or inside functions, by absolute name (a
    module, or a name in one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = ".".join(filter(None, ["bench" if node.level else "", node.module]))
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_bench_has_no_import_cycle_and_imports_only_public_names_of_async_ckpt():
    paths = {f"bench.{path.stem}": path for path in pathlib.Path(REPO, "bench").glob("*.py")}
    imports = {name: _imports(path) for name, path in paths.items()}
    for name in paths:  # nothing reaches itself through bench's imports
        seen, todo = set(), [m for m in imports[name] if m in paths]
        while todo:
            module = todo.pop()
            assert module != name, f"{name} is in an import cycle"
            if module not in seen:
                seen.add(module)
                todo += [m for m in imports[module] if m in paths]
    private = {(name, imported) for name, found in imports.items() for imported in found
               if imported.startswith("async_ckpt.") and any(
                   part.startswith("_") and not part.startswith("__")
                   for part in imported.split(".")[1:])}
    assert not private



def test_every_name_bench_imports_from_async_ckpt_exists():
    """The parts only full runs start (torchrun workers) import inside functions, so a name the
    library renamed failed there alone, in the middle of a 50-minute run. Read from the sources:
    importing the adapters would import their frameworks."""
    for path in pathlib.Path(REPO, "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and not node.level
                    and node.module.split(".")[0] == "async_ckpt"):
                continue
            spec = importlib.util.find_spec(node.module)
            assert spec is not None, (path.name, node.module)
            defined = _module_names(spec.origin)
            lazy = "__getattr__" in defined  # names it makes on first use: ask the module
            for alias in node.names:
                assert alias.name in defined or importlib.util.find_spec(
                    f"{node.module}.{alias.name}") or (lazy and hasattr(
                        importlib.import_module(node.module), alias.name)), (
                    path.name, node.module, alias.name)


def _module_names(source: str) -> set[str]:
    """The names a module defines or imports at its top level (inside a top-level if or try
    too)."""
    names, body = set(), list(ast.parse(pathlib.Path(source).read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "handlers", []) + getattr(
                node, "finalbody", [])
        elif isinstance(node, ast.ExceptHandler):
            body += node.body
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_resume_takes_only_parts_a_run_of_the_same_settings_measured(tmp_path, monkeypatch):
    """``--resume`` keeps the parts saved under ``--out`` by a stopped run with the same settings
    and measures only the others; another run's parts, or none, are refused."""
    import dataclasses
    import json

    import bench.__main__ as bench_main
    from bench.parts import SWEEP, TRAINING

    args = bench_main.parse_args(["--quick", "--out", str(tmp_path), "--resume"])
    args.preset = dataclasses.replace(args.preset, parts=("sweep", TRAINING.key))
    with pytest.raises(SystemExit, match="nothing to resume"):
        bench_main.measure_parts(args, str(tmp_path))
    identity = {"preset": "quick", "sizes": list(args.sizes), "ks": list(args.ks),
                "bf16_sizes": list(args.bf16_sizes), "rounds": args.rounds}
    partial = tmp_path / bench_main.PARTIAL
    partial.write_text(json.dumps({"identity": {**identity, "rounds": 7}, "raw": {}}))
    with pytest.raises(SystemExit, match="other settings"):
        bench_main.measure_parts(args, str(tmp_path))
    first = {"started_at": 1.7e9, "machine": {"nproc": 2}, "load_start": {"loadavg": [2.0]},
             "command": "python -m bench"}
    partial.write_text(json.dumps({"identity": identity, "first": first, "runtime_s": 3600.0,
                                   "raw": {"sweep": {"kept": 1}}}))
    monkeypatch.setitem(bench_main.BY_KEY, SWEEP.key, dataclasses.replace(
        SWEEP, run=lambda *a: pytest.fail("measured again")))
    monkeypatch.setitem(bench_main.BY_KEY, TRAINING.key, dataclasses.replace(
        TRAINING, run=lambda *a: {"measured": 2}))
    raw, kept_first, runtime_s = bench_main.measure_parts(args, str(tmp_path))
    assert raw == {"sweep": {"kept": 1}, TRAINING.key: {"measured": 2}}
    assert kept_first == first and runtime_s >= 3600.0  # the report's header: the first run's
    # start, machine, load and command, and the time of both runs, not the resumed run's alone
    saved = json.loads(partial.read_text())
    assert saved["raw"][TRAINING.key] == {"measured": 2} and saved["first"] == first
