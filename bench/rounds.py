"""Interleaved rounds, how every part repeats its systems (docs/performance.md, "What runs")."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable, Optional, Sequence

from .measure import load_between, load_now, rotated, settle

FloorHook = Optional[Callable[[], dict]]


class FloorSlot:
    """The round's one floor sample: taken by the first system's hook, else right after it (n/a,
    failed), so that it never follows a large deletion."""

    def __init__(self, measure: Callable[[], dict]):
        self._measure, self.sample = measure, None

    def take(self) -> dict:
        if self.sample is None:
            self.sample = self._measure()
        return self.sample


def run_rounds(items: Sequence, rounds: int, shift: int, measure_floor: Callable[[], dict],
               run_slot: Callable[[int, object, FloorHook], dict],
               name: Callable[[object], str] = lambda item: item.name,
               settle_bytes: int = 0) -> dict:
    """``run_slot(round, item, hook)`` per item and round (``settle_bytes``: what a slot writes); an
    n/a run drops the item's earlier runs too, so every available item has one run per round."""
    blocks = {name(item): {"available": True, "runs": []} for item in items}
    record: dict = {"systems": blocks, "order": [], "settle": [], "floors": [], "loads": []}
    first = load_now()
    for index in range(rounds):
        order = [item for item in rotated(items, shift + index) if blocks[name(item)]["available"]]
        start = load_now()
        slot = FloorSlot(measure_floor)
        settled = []
        for position, item in enumerate(order):
            settled.append({"name": name(item), **asdict(settle(settle_bytes))})
            run = run_slot(index, item, slot.take if position == 0 else None)
            if run.get("available", True):
                blocks[name(item)]["runs"].append({"round": index, **run})
            else:
                blocks[name(item)] = {"available": False, "reason": run["reason"]}
            slot.take()
        slot.take()
        record["order"].append([name(item) for item in order])
        record["settle"].append(settled)
        record["floors"].append(slot.sample)
        record["loads"].append(load_between(start, load_now()))
    record["load"] = load_between(first, load_now())
    return record
