"""The benchmark report as markdown tables, rendered from results.json alone (so a report can be
re-rendered from any saved results: ``python -m bench --render results.json``).

Every cell that holds a measured figure is the median over the interleaved rounds with its min-max
spread, and its ratio to the figure's floor and to the best peer: ``value (min–max) · ×floor ·
×best peer``. ``render`` returns the whole report; the README's "Performance" section quotes its
headline (``overhead_headline``), its opening paragraph and its "Targets", "Saving and restoring",
"2 ranks", "Sharded state", and "Incremental snapshots" sections,
pasted as they are (images are linked from ``image_dir``, the plots' directory relative to the
repository root).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Optional, Sequence

from .harness import RECLAIM_KEYS, SETTLE_BELOW_BYTES, SETTLE_BYTES_PER_S, spread
from .markdown import factor, median_range, number, points, section, table, with_ratios
from .records import Cell, Consistency, FigureValues, NotAvailable, Targets, Value
from .systems import NONE, OURS_ASYNC, TORCH_SAVE

PERIODIC, ASYNC = TORCH_SAVE.name, OURS_ASYNC.name

FLOOR_LABELS = (("copy_s", "copy_"), ("durable_s", "disk (fastest durable write)"),
                ("read_cache_s", "warm read (fastest, page cache)"),
                ("read_cold_s", "cold read (fastest, from disk)"))


def render(results: dict, parts: Sequence, image_dir: str = "bench/results") -> str:
    """The report of results.json's ``results``: the summary sections around those of the
    ``parts`` (``parts.PARTS``: each renders "" where it did not run)."""
    results = _typed(results)
    sections = [_header(results), _legend(results), _targets(results), _floors(results),
                *(part.render(results, image_dir) for part in parts), _consistency(results),
                _per_size(results), _load(results)]
    return "\n\n".join(s for s in sections if s) + "\n"


def _typed(results: dict) -> dict:
    """A copy of ``results`` with its figures, targets, and consistency checks as records,
    where a system that never ran says "n/a (not run)" in every cell: its reason is given once,
    under the report's heading."""
    not_run = {s["name"] for s in results["systems"] if not s["ran"]}

    def ran(name: str, value):
        return NotAvailable("not run") if name in not_run else value

    typed = {**results, "targets": Targets.from_json(results["targets"]), "figures": {}}
    for key, figure in results["figures"].items():
        figure = FigureValues.from_json(figure)
        typed["figures"][key] = dataclasses.replace(figure, values={
            name: {case: ran(name, value) for case, value in cases.items()}
            for name, cases in figure.values.items()})
    if "consistency" in results:
        typed["consistency"] = {name: ran(name, Consistency.from_json(check))
                                for name, check in results["consistency"].items()}
    return typed


def _systems(results: dict) -> list[str]:
    """The names of the run's systems, in report order."""
    return [s["name"] for s in results["systems"]]


def _cell(entry: Value, scale: float = 1.0) -> str:
    """``median (min–max) · ×floor · ×best peer``, or why there is no value."""
    if isinstance(entry, NotAvailable):
        return str(entry)
    return with_ratios(entry, entry.x_floor, entry.x_best_peer, scale=scale)


def _figures(results: dict, names: list[str], columns: list[tuple[str, str, str]]) -> str:
    """A row per system of ``names``: its ``_cell`` of each column's ``(header, figure, case)``,
    bytes in MB."""
    f = results["figures"]
    return table(["system", *(header for header, _, _ in columns)],
                 [[name, *(_cell(f[key].values[name][case], 1e6 if f[key].unit == "B" else 1)
                           for _, key, case in columns)] for name in names])


def headline_case(results: dict) -> Optional[str]:
    """The fp32 sweep case nearest 1 GB: the state the design notes measured."""
    cases = [(abs(c["size_gb"] - 1.0), label) for label, c in results["raw"]["sweep"].items()
             if c["dtype"] == "fp32"]
    return min(cases)[1] if cases else None


# --- sections -----------------------------------------------------------------------------------


def _header(results: dict) -> str:
    m, config = results["machine"], results["config"]
    ran = [s["name"] for s in results["systems"] if s["ran"]]
    not_ran = [f"{s['name']}: {s['reason']}" for s in results["systems"] if not s["ran"]]
    when = datetime.datetime.fromtimestamp(results["started_at"]).strftime("%Y-%m-%d %H:%M")
    headline = overhead_headline(results)
    lines = [
        "## Performance",
        "",
        *([headline, ""] if headline else []),
        f"Measured {when} with `{config['command']}` in {results['runtime_s'] / 60:.1f} min on "
        f"{m['nproc']} CPUs ({m['cpu_model']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, no GPU, "
        f"Linux {m['kernel']}, Python {m['python']}, torch {m['torch']} ({m['torch_threads']} "
        f"threads); load average {_loads(m['loadavg_start'])} at the start, "
        f"{_loads(results['loadavg_end'])} at the end (the machine is shared: expect noise).",
        "",
        f"Systems that ran: {', '.join(ran)}.",
    ]
    if not_ran:
        lines += ["", "Not run: " + "; ".join(not_ran) + "."]
    return "\n".join(lines)


def overhead_headline(results: dict) -> str:
    """The README's headline in one sentence: async_ckpt async's per-step time overhead at every
    K against torch.save + fsync's and the best peer's, from the training loop."""
    figure = results["figures"].get("step_overhead_pct")
    ours = figure and figure.values.get(ASYNC)
    if not ours or not all(isinstance(e, Cell) for e in ours.values()):
        return ""
    ks, best = figure.cases, figure.best_peer

    def pct(name: Optional[str], k: str) -> str:
        e = figure.values.get(name, {}).get(k)
        return points(e.median) if isinstance(e, Cell) else "n/a"

    runs: list[tuple[str, list[str]]] = []  # consecutive intervals with the same best peer
    for k in (k for k in ks if best.get(k)):
        if runs and runs[-1][0] == best[k]:
            runs[-1][1].append(pct(best[k], k))
        else:
            runs.append((best[k], [pct(best[k], k)]))
    others = f"{_and([pct(PERIODIC, k) for k in ks])} for {PERIODIC}"
    if {name for name, _ in runs} == {PERIODIC}:
        others += ", the best other system"
    elif runs:
        others += "; the best other system: " + _and([f"{_and(cells)} for {name}"
                                                      for name, cells in runs])
    training = results["raw"]["training"]
    return (f"Per training step, a snapshot every {_and([k.split('=')[1] for k in ks])} steps "
            f"costs async_ckpt async {_and([median_range(ours[k], fmt=points) for k in ks])} "
            f"against the same loop without checkpointing, {others} (medians (min–max) of "
            f"{training['rounds']} interleaved rounds, {number(training['state_bytes'] / 1e6)} MB "
            "state).")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _loads(loads) -> str:
    return " ".join(f"{x:.2f}" for x in loads)


def _legend(results: dict) -> str:
    rounds = results["config"].get("rounds")
    return (f"Cells read `median (min–max) · ×floor · ×best peer`: the median of {rounds} "
            "interleaved rounds (every system once per round, in rotating order, reversed in odd "
            "rounds) and its range; "
            "the floor is the physical limit of this machine for the same bytes, measured in the "
            "same run, one sample per round, and ×floor is the median of each round's value over "
            "that round's floor; the best peer is the best (by median) of the systems other than "
            "async_ckpt for the same case. For times and bytes lower is better, for throughput "
            "and compression higher. `–`: no meaningful ratio (a best peer that uses no memory "
            "of its own).")


def _targets(results: dict) -> str:
    targets = results["targets"]
    if not targets.cases:
        return ""

    def verdict(e) -> str:
        return (str(e) if isinstance(e, NotAvailable) else
                f"{median_range(e, fmt=factor)} {'meets' if e.meets else 'MISSES'}")

    rows = [[row.title, f"≤ {row.limit:g}×", *(verdict(row.values[c]) for c in targets.cases)]
            for row in targets.rows]
    ratios = [e for row in targets.rows for e in row.values.values()
              if not isinstance(e, NotAvailable)]
    met, total = sum(e.meets for e in ratios), len(ratios)
    return section("Targets (\"At the storage floor\")",
                   "Each ratio is taken round by round (the system's value in round i over the "
                   "floor's or the peer's in round i), then the median (min–max) over the "
                   f"rounds; a target is met when the median is at or under it. Met: {met} of "
                   f"{total}.", table(["ratio", "target", *targets.cases], rows))


def _floors(results: dict) -> str:
    rows = [[label, *(f"{median_range(f)} s ({f['gbps']:.2f} GB/s)" if f else "–"
                      for f in (floors.get(key) for key, _ in FLOOR_LABELS))]
            for label, floors in results["floors"].items()]
    return section("Floors (median (min–max) of one sample per round, next to the systems)",
                   table(["state", *(name for _, name in FLOOR_LABELS)], rows),
                   *_floor_ways(results))


def _floor_ways(results: dict) -> list[str]:
    """Which way was each floor in each round, and what the other ways took."""
    kinds = [(key, name) for key, name in FLOOR_LABELS if key != "copy_s"]
    rows, not_run = [], {}
    for label, floors in results["floors"].items():
        for index in range(len(floors[kinds[0][0]].get("ways", []))):
            row = [label, str(index + 1)]
            for key, _ in kinds:
                fastest, ways = floors[key]["fastest"][index], floors[key]["ways"][index]
                not_run.update({w: s for w, s in ways.items() if isinstance(s, str)})
                others = ", ".join(f"{w} {number(s)}" for w, s in ways.items()
                                   if w != fastest and not isinstance(s, str))
                row.append(f"**{fastest}** {number(ways[fastest])} s ({others})")
            rows.append(row)
    if not rows:
        return []
    return ["Each floor is the fastest of several ways, measured in the same round "
            "(`bench/floors.py`): to make the bytes durable, `dd conv=fsync` with 1 MiB and 8 MiB "
            "blocks, a Python loop of 1 MiB `os.write` calls then `fsync`, and fio sequential "
            "1 MiB writes, direct (queue depth 8) and buffered, with an fsync at the end; to read "
            "them back, one `readinto` of the file and 1 MiB `readinto` calls, from the page cache "
            "(warm) or after `posix_fadvise(DONTNEED)` (cold). Per round the fastest way (bold, "
            "the floor) and the others' seconds:",
            table(["state", "round", *(name.split(" (")[0] for _, name in kinds)], rows),
            ("Not run: " + "; ".join(f"{w}: {s}" for w, s in not_run.items()) + ".") if not_run
            else ""]


def saving_and_restoring(results: dict, image_dir: str) -> str:
    """The sweep's section: every figure of the case nearest 1 GB."""
    case = headline_case(results)
    if case is None:
        return ""
    blocks = results["raw"]["sweep"][case]["systems"]
    names = [name for name in _systems(results) if not blocks[name].get("skipped")]
    skipped = [name for name in _systems(results) if blocks[name].get("skipped")]
    nbytes = results["raw"]["sweep"][case]["bytes"]
    rounds = results["raw"]["sweep"][case]["rounds"]
    note = (f" Not run at this size: {', '.join(skipped)} ({blocks[skipped[0]]['reason']}; see "
            "docs/performance.md).") if skipped else ""
    return section(f"Saving and restoring a {case} state ({nbytes / 1e9:.2f} GB: MLP + Adam)",
                   f"Medians (min–max) of {rounds} interleaved rounds.{note}",
                   _figures(results, names, [
                       ("blocking s (min–max) · ×copy · ×best peer", "blocking_s", case),
                       ("to durable s (min–max) · ×disk floor · ×best peer", "to_durable_s",
                        case)]),
                   _figures(results, names, [
                       ("warm restore s · ×warm read · ×best peer", "restore_s", case),
                       ("cold restore s · ×cold read · ×best peer", "restore_cold_s", case),
                       ("MB written · ×state · ×best peer", "stored_bytes", case),
                       ("compression ratio · ×raw · ×best peer", "compression_ratio", case)]),
                   "![blocking time and time to durable vs state size]"
                   f"({image_dir}/blocking_vs_size.png)")


def training_loop(results: dict, image_dir: str) -> str:
    """The training loop's sections: throughput, overhead and blocking, then memory."""
    if "training" not in results["raw"]:  # not in the --stall preset
        return ""
    return "\n\n".join([_training(results, image_dir), _memory(results)])


def _training(results: dict, image_dir: str) -> str:
    f = results["figures"]
    training = results["raw"]["training"]
    throughput, overhead = f["throughput_steps_s"], f["step_overhead_pct"]
    ks, names = throughput.cases, _systems(results)
    none = throughput.values[NONE.name]
    step_ms = 1000 / none[ks[-1]].median
    overhead_rows = [[name] + [median_range(e, fmt=points) if isinstance(e, Cell) else str(e)
                               for e in (overhead.values[name][k] for k in ks)]
                     for name in names]
    rows = [[NONE.name] + [median_range(none[k]) for k in ks]]
    rows += [[name] + [_cell(throughput.values[name][k]) for k in ks] for name in names]
    steps = ", ".join(f"{k}: {n} steps" for k, n in zip(ks, training["steps"].values()))
    return section(
        f"Training loop: {number(training['state_bytes'] / 1e6)} MB state (MLP + AdamW), "
        f"{step_ms:.0f} ms per step without checkpointing, a snapshot every K steps",
        f"Steps per loop: {steps}; {training['rounds']} interleaved rounds. Each system's loop is "
        "timed against a loop without checkpointing run just before it. "
        f"{_noise(training)}",
        "Per-step time overhead against that loop without checkpointing, median (min–max) over "
        "the rounds (lower is better):",
        table(["system", *(f"{k} step time overhead" for k in ks)], overhead_rows),
        "Throughput (steps/s; ×no ckpt: over the paired loop without checkpointing; the first "
        "row is every such loop together):",
        table(["system", *(f"{k} steps/s (min–max) · ×no ckpt · ×best peer" for k in ks)], rows),
        f"![training throughput vs K]({image_dir}/throughput_vs_k.png)",
        "Blocking time per snapshot in the loop (s; per round the median of its snapshots):",
        _figures(results, names, [(f"{k} (min–max) · ×copy · ×best peer", "loop_blocking_s", k)
                                  for k in ks]))


def _noise(training: dict) -> str:
    """How much the no-checkpoint loops alone varied: the yardstick for reading small overheads."""
    rates = [r["loops"][k]["baseline"]["steps_per_s"] for b in training["systems"].values()
             if b.get("available") for r in b["runs"] for k in r["loops"]]
    if len(rates) < 2:
        return ""
    return (f"The machine's speed drifted: loops without checkpointing ran at {min(rates):.3g} to "
            f"{max(rates):.3g} steps/s over the run ({(max(rates) / min(rates) - 1) * 100:.0f}% "
            "apart), hence the adjacent baselines; overheads of a few percent, and negative ones, "
            "are within noise.")


def _memory(results: dict) -> str:
    return section("Memory in the training loop (MB; ×floor = × the state's bytes)",
                   _figures(results, _systems(results), [
                       ("trainer peak above start · ×state · ×best peer",
                        "trainer_peak_extra_bytes", "loop"),
                       ("writer processes peak · ×state · ×best peer", "writer_peak_bytes",
                        "loop"),
                       ("growth per snapshot · ×state · ×best peer",
                        "rss_growth_per_snapshot_bytes", "loop")]))


def _consistency(results: dict) -> str:
    if "consistency" not in results:
        return ""
    rows = []
    for name in _systems(results):
        check = results["consistency"].get(name)
        if not isinstance(check, Consistency):
            rows.append([name, str(check), ""])
            continue
        exact = "yes" if check.bit_exact else f"no: {check.differing_tensors} tensors differ"
        rows.append([name, exact, f"{check.damage.outcome}: {check.damage.how}"])
    return section("Recovery consistency (training state, measured)",
                   "A snapshot, two more steps, a restore compared bit for bit with the state at "
                   "the snapshot; then one byte flipped in the middle of the snapshot's largest "
                   "file and another restore.",
                   table(["system", "restore bit-exact", "one flipped byte"], rows))


def _per_size(results: dict) -> str:
    f = results["figures"]
    parts = []
    for key in ("blocking_s", "to_durable_s", "restore_s", "restore_cold_s", "compression_ratio"):
        figure = f[key]
        parts += [f"{figure.title.capitalize()} ({figure.unit}; ×floor: {figure.floor}):",
                  _figures(results, _systems(results), [(c, key, c) for c in figure.cases])]
    return section("Every state size", *parts)


def _load(results: dict) -> str:
    """The machine's load while each part ran: the yardstick for how far to trust its spread."""
    loads = results.get("loads")
    if not loads:
        return ""
    rows = []
    for part, load in loads.items():
        rounds = ", ".join(f"{r['loadavg_start'][0]:.2f}→{r['loadavg_end'][0]:.2f}"
                           for r in load["rounds"])
        delta = load["vmstat_delta"]
        rows.append([part, rounds, "–" if delta is None else
                     " / ".join(f"{delta.get(k, 0):,}" for k in RECLAIM_KEYS),
                     _settled(load.get("settle"))])
    total = results["vmstat_delta"]
    return section(
        "Machine load",
        "The 1-minute load average at the start → end of each round (the machine has "
        f"{results['machine']['nproc']} CPUs and is shared), and how far the kernel's reclaim "
        f"counters ({', '.join(RECLAIM_KEYS)}) moved during each part; over the whole run: "
        + " / ".join(f"{total.get(k, 0):,}" for k in RECLAIM_KEYS)
        + ". Moving counters mean memory pressure slowed page-cache writes, the floors' and the "
        "systems' alike. Before each system the run waited for the kernel's dirty and writeback "
        f"pages to fall under {SETTLE_BELOW_BYTES >> 20} MiB, at most as long as the disk takes "
        f"to write the state at {SETTLE_BYTES_PER_S / 1e6:g} MB/s; a wait that ran out means "
        "other writes kept the disk busy.",
        table(["part", "load average per round", " / ".join(RECLAIM_KEYS),
               "disk settle before a system: median (max) s"], rows))


def _settled(rounds: Optional[list]) -> str:
    """The settle waits of a part's slots: median (max), and how many ran out."""
    slots = [slot for r in rounds or () for slot in r]
    if not slots:
        return "–"
    waits = spread([slot["waited_s"] for slot in slots])
    out = sum(slot["timed_out"] for slot in slots)
    return (f"{number(waits['median'])} ({number(waits['max'])})"
            + (f", {out} of {len(slots)} ran out" if out else ""))
