"""The targets of the issue "At the storage floor", checked on the sweep's paired ratios; method:
docs/performance.md, "Reading the numbers" ("Targets")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from .harness import ratio_spread
from .records import NotAvailable, TargetRatio, TargetRow, Targets
from .systems import DCP_SAVE, OURS_ASYNC, OURS_ASYNC_ZSTD, OURS_SYNC, TORCH_SAVE, SystemSpec

MAX_ZSTD_STORED = 0.8  # the zstd target applies where zstd stores at most this fraction of raw


@dataclass(frozen=True)
class Target:
    """``value`` of ``system`` over ``reference_value`` of ``reference`` (None: the floor)."""

    key: str
    title: str
    system: str
    value: str
    reference: Optional[str]
    reference_value: str
    limit: float


TARGETS = (
    Target("async_blocking_x_copy", "async_ckpt async blocking / copy floor (one copy_ of the "
           "state)", OURS_ASYNC.name, "blocking_s", None, "copy_s", 1.5),
    Target("async_durable_x_disk", "async_ckpt async time to durable / disk floor (fastest way "
           "to make the bytes durable)", OURS_ASYNC.name, "to_commit_s", None, "durable_s", 1.1),
    Target("async_durable_x_torch_save", "async_ckpt async time to durable / torch.save + fsync "
           "time to durable", OURS_ASYNC.name, "to_commit_s", TORCH_SAVE.name, "to_commit_s", 0.8),
    Target("zstd_durable_x_async", "async_ckpt async zstd time to durable / async_ckpt async time "
           f"to durable (where zstd stores ≤ {MAX_ZSTD_STORED:g}× raw)", OURS_ASYNC_ZSTD.name,
           "to_commit_s", OURS_ASYNC.name, "to_commit_s", 1.0),
    Target("sync_blocking_x_torch_save", "async_ckpt sync blocking / torch.save + fsync blocking",
           OURS_SYNC.name, "blocking_s", TORCH_SAVE.name, "blocking_s", 1.0),
    Target("async_restore_x_dcp", "async_ckpt async warm restore / DCP save's restore (DCP load)",
           OURS_ASYNC.name, "restore_s", DCP_SAVE.name, "restore_s", 0.5),
    Target("async_restore_x_read", "async_ckpt async warm restore / warm read floor (fastest "
           "read from the page cache)", OURS_ASYNC.name, "restore_s", None, "read_cache_s", 1.2),
    Target("async_cold_restore_x_cold_read", "async_ckpt async cold restore / cold read floor "
           "(fastest read from the disk)", OURS_ASYNC.name, "restore_cold_s", None, "read_cold_s",
           1.1),
)


def build(sweep: dict, specs: Sequence[SystemSpec]) -> Targets:
    """Each target whose systems all ran in this preset, in each fp32 case."""
    ran = {spec.name for spec in specs}
    cases = [label for label, case in sweep.items() if case["dtype"] == "fp32"]
    rows = [TargetRow(t.key, t.title, t.limit, {label: _ratio(t, sweep[label]) for label in cases})
            for t in TARGETS if {t.system, t.reference} - {None} <= ran]
    return Targets(cases, rows)


def _runs(case: dict, name: str) -> Optional[dict]:
    """``{round: run}`` of a system that ran in this case, else None."""
    block = case["systems"].get(name)
    if not block or not block.get("available"):
        return None
    return {run["round"]: run for run in block["runs"]}


def _ratio(target: Target, case: dict) -> Union[TargetRatio, NotAvailable]:
    runs = _runs(case, target.system)
    if runs is None:
        return NotAvailable(f"{target.system} did not run")
    if target.reference is None:
        references = dict(enumerate(case["floors"]))
    else:
        references = _runs(case, target.reference)
        if references is None:
            return NotAvailable(f"{target.reference} did not run")
    if target.system == OURS_ASYNC_ZSTD.name:
        stored = max(run["stored_bytes"] for run in runs.values()) / case["bytes"]
        if stored > MAX_ZSTD_STORED:
            return NotAvailable(f"zstd stored {stored:.2f}× raw")
    rounds = sorted(set(runs) & set(references))
    entry = ratio_spread([runs[i][target.value] for i in rounds],
                         [references[i][target.reference_value] for i in rounds])
    return TargetRatio(**entry, meets=entry["median"] <= target.limit)
