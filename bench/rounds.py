"""Interleaved rounds: how every part of ``python -m bench`` (the sweep, the training loop, the
ranks, the incremental snapshots) repeats its systems.

A round runs every system once, in an order rotated from round to round and reversed in odd rounds
(``measure.rotated``), so that a drift of the machine's speed during the run hits every system
alike, no system always runs first (or last) and none always follows the same neighbour. Before
each system the disk settles (``measure.settle``: the kernel's dirty and writeback pages drained,
a bounded wait, recorded per slot), so that a cell measures the system, not the write-back of the
one before it. Each round also takes one floor sample next to its
first system: after that system's measurements, before its cleanup (``FloorSlot``), so that the
floor never runs right after a large deletion, and a figure of round ``i`` is paired with the
floor of round ``i``. The machine's load is recorded at the start and end of every round.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable, Optional, Sequence

from .measure import load_between, load_now, rotated, settle

FloorHook = Optional[Callable[[], dict]]


class FloorSlot:
    """One floor sample per round, taken once: by the system it runs next to (``take`` handed to
    it as its hook), or right after that system when it could not call the hook (n/a, failed)."""

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
    """``rounds`` rounds of ``run = run_slot(round, item, hook)`` over the items in the order of
    ``measure.rotated`` (the first of a round gets its floor hook), each after the disk settled
    (waiting at most as long as the disk takes for ``settle_bytes``, the bytes a slot writes). A
    run ``{"available": False, "reason": ...}`` makes its item n/a for the rest: it is skipped in
    later rounds and its earlier runs dropped, so that every item that is available has one run
    per round. Returns ``{"systems": {name: {"available": True, "runs": [{"round": i, **run},
    ...]} or the n/a run}, "order": [[name, ...] per round], "settle": [[{"name", **Settled} per
    slot] per round], "floors": [sample per round], "loads": [load_between per round], "load":
    load_between over all rounds}``."""
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
