"""From raw runs to figures: each value with its ratios to the floor and the best peer, or why
there is none; method: docs/performance.md, "Reading the numbers"."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from .harness import ratio_spread, spread
from .records import Cell, FigureValues, NotAvailable, Value
from .systems import NONE, SystemSpec
from .training import GROWTH_SKIP


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
FIGURE_KEYS = tuple(f.key for f in FIGURES)


SWEEP_SOURCES = {  # figure: (the key of a sweep run, the floor key it is paired with)
    "blocking_s": ("blocking_s", "copy_s"), "to_durable_s": ("to_commit_s", "durable_s"),
    "restore_s": ("restore_s", "read_cache_s"), "restore_cold_s": ("restore_cold_s", "read_cold_s"),
}


def build(sweep: dict, training: Optional[dict],
          specs: Sequence[SystemSpec]) -> dict[str, FigureValues]:
    """Every figure of the preset's ``specs`` from the sweep's and the training loop's runs."""
    names = [spec.name for spec in specs]
    peers = {spec.name for spec in specs if not spec.ours}
    figures = {}
    for figure in SWEEP_FIGURES:
        figures[figure.key] = _figure(figure, {case: {name: _sweep_entry(figure.key, data, name)
                                                      for name in names}
                                               for case, data in sweep.items()}, peers)
    if training is None:
        return figures
    none_rates = _none_rates(training)
    ks = list(training["steps"])
    for figure in TRAINING_FIGURES:
        loop_names = [NONE.name, *names] if figure.key == "throughput_steps_s" else names
        figures[figure.key] = _figure(figure, {
            f"K={k}": {name: _training_entry(figure.key, name, training["systems"].get(name), k,
                                             none_rates, training["floors"])
                       for name in loop_names}
            for k in ks}, peers)
    for figure in MEMORY_FIGURES:
        figures[figure.key] = _figure(figure, {"loop": {
            name: _memory_entry(figure.key, training["systems"].get(name), training["state_bytes"])
            for name in names}}, peers)
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


def _entry(values: list, floors, **extra) -> Cell:
    """``floors``: one per value (the same round's) or one for all (bytes)."""
    floors = list(floors) if isinstance(floors, (list, tuple)) else [floors] * len(values)
    paired = ratio_spread(values, floors)["median"] if all(floors) else None
    return Cell(**spread(values), floor=spread(floors)["median"] if all(floors) else None,
                x_floor=paired, extra=extra)


def _na(block: Optional[dict], default: str = "did not run") -> Optional[NotAvailable]:
    if block is None:
        return NotAvailable(default)
    if not block.get("available", True):
        return NotAvailable(block["reason"])
    return None


def _sweep_entry(key: str, case: dict, name: str):
    block = case["systems"].get(name)
    missing = _na(block)
    if missing:
        return missing
    runs, nbytes = block["runs"], case["bytes"]
    if key in SWEEP_SOURCES:
        run_key, floor_key = SWEEP_SOURCES[key]
        return _entry([r[run_key] for r in runs],
                      [case["floors"][r["round"]][floor_key] for r in runs])
    stored = [r["stored_bytes"] for r in runs]
    if key == "stored_bytes":
        return _entry(stored, nbytes)
    return _entry([nbytes / s for s in stored], 1.0)  # compression_ratio


def _none_rates(training: dict) -> dict:
    """Every no-checkpoint loop's steps/s per K: the report's reference row (each system's ratios
    use its own paired loops)."""
    return {k: [r["loops"][k]["baseline"]["steps_per_s"] for b in training["systems"].values()
                if b.get("available") for r in b["runs"]] for k in training["steps"]}


def _training_entry(key: str, name: str, block: Optional[dict], k: str, none_rates: dict,
                    floors: list):
    if name == NONE.name:
        if key != "throughput_steps_s" or not none_rates[k]:
            return NotAvailable("no snapshots")
        return _entry(none_rates[k], none_rates[k], drain_s=0.0)
    missing = _na(block)
    if missing:
        return missing
    rounds = block["runs"]
    loops = [r["loops"][k] for r in rounds]
    if key == "throughput_steps_s":
        return _entry([lp["steps_per_s"] for lp in loops],
                      [lp["baseline"]["steps_per_s"] for lp in loops],
                      drain_s=spread([lp["drain_s"] for lp in loops])["median"])
    if key == "step_overhead_pct":  # no floor to divide by: the loop's own baseline is its 0
        return _entry([(lp["step_s"] / lp["baseline"]["step_s"] - 1) * 100 for lp in loops], 0.0,
                      step_s=spread([lp["step_s"] for lp in loops]),
                      baseline_step_s=spread([lp["baseline"]["step_s"] for lp in loops]))
    return _entry([spread(lp["blocking_s"])["median"] for lp in loops],
                  [floors[r["round"]]["copy_s"] for r in rounds],
                  snapshots=sum(len(lp["blocking_s"]) for lp in loops))


def _memory_entry(key: str, block: Optional[dict], state_bytes: int):
    missing = _na(block)
    if missing:
        return missing
    rounds = block["runs"]
    if key == "trainer_peak_extra_bytes":
        values = [r["trainer_peak_extra_bytes"] for r in rounds]
    elif key == "writer_peak_bytes":
        values = [r["writer_peak_bytes"] for r in rounds]
        if not any(values):
            return NotAvailable("writes in the training process: counted in the trainer's RSS")
    else:
        if any(r["trainer_growth_per_snapshot_bytes"] is None for r in rounds):
            return NotAvailable(f"fewer than 3 snapshots after the first {GROWTH_SKIP} of a round")
        # whole bytes: the fit's float noise is not growth
        values = [round(r["trainer_growth_per_snapshot_bytes"]
                        + (r["writer_growth_per_snapshot_bytes"] or 0.0)) for r in rounds]
    return _entry(values, state_bytes)
