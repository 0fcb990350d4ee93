"""The article's comparison of periodic blocking saves and asynchronous side-path saves, with the
words in its cells replaced by what this run measured.

"The article" (``SOURCE``) is the project's starting point: a Chinese article on fault-tolerant
restarts of distributed training, cited by its first line.

The periodic column is ``torch.save`` + fsync, the save most training scripts do; the asynchronous
column is async_ckpt in async mode. Rows, as in the article: implementation difficulty, loss on
interruption, I/O pressure, fit, recovery consistency.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Optional

from .records import Cell, Consistency
from .registry import OURS_ASYNC, TORCH_SAVE
from .systems import TorchSave

PERIODIC, ASYNC = TORCH_SAVE.name, OURS_ASYNC.name
SOURCE = ("a Chinese article on fault-tolerant restarts of distributed training, whose first line "
          "reads \"分布式训练容错重启的断点续训设计，核心答案只有一句话：把模型参数、优化器状态、数据加载器位置和随机数"
          "状态完整保存下来\" (resume by saving parameters, optimizer state, data-loader position and "
          "RNG state, and aligning them exactly on restore)")
ARTICLE = {  # the article's words, translated
    "implementation difficulty": ("low", "high"),
    "loss on interruption": ("at most one save interval",
                             "may lose close to one interval, but training does not stop"),
    "I/O pressure": ("concentrated at the save points", "spread over each asynchronous save"),
    "fit": ("small and mid-size models, idle I/O", "large-scale training, ample storage"),
    "recovery consistency": ("high: the state is complete and aligned",
                             "medium: the step at save time must be recorded too"),
}
OVERHEAD_BUDGET_PCT = 5.0  # the top of the article's "1-5% of training time" rule


def compare(results: dict) -> dict:
    """``{aspect: {"article": [periodic, async], "measured": [periodic, async]}}`` from the
    results being assembled (typed figures and consistency checks)."""
    figures, training = results["figures"], results["raw"]["training"]
    ks = [f"K={k}" for k in training["steps"]]
    step_s = 1 / figures["throughput_steps_s"].values["no checkpointing"][ks[-1]].median
    case = headline_case(results)
    measured = {
        "implementation difficulty": (_difficulty_periodic(), _difficulty_async()),
        "loss on interruption": tuple(_loss(results, name, ks, step_s)
                                      for name in (PERIODIC, ASYNC)),
        "I/O pressure": tuple(_io(results, name, case) for name in (PERIODIC, ASYNC)),
        "fit": tuple(_fit(results, name, ks, case, step_s) for name in (PERIODIC, ASYNC)),
        "recovery consistency": tuple(_consistency(results, name) for name in (PERIODIC, ASYNC)),
    }
    return {"columns": [PERIODIC, ASYNC], "case": case,
            "rows": {aspect: {"article": list(ARTICLE[aspect]), "measured": list(measured[aspect])}
                     for aspect in ARTICLE}}


def headline_case(results: dict) -> Optional[str]:
    """The fp32 sweep case nearest 1 GB: the state the design notes measured."""
    cases = [(abs(c["size_gb"] - 1.0), label) for label, c in results["raw"]["sweep"].items()
             if c["dtype"] == "fp32"]
    return min(cases)[1] if cases else None


def _value(results: dict, figure: str, name: str, case: str) -> Optional[Cell]:
    entry = results["figures"][figure].values.get(name, {}).get(case)
    return entry if isinstance(entry, Cell) else None


def _difficulty_periodic() -> str:
    lines = [ln for ln in inspect.getsource(TorchSave._save).splitlines()[1:] if ln.strip()
             and "_durable" not in ln]
    return (f"{len(lines)} lines in the loop (torch.save, flush, fsync of the file and of the "
            "directory); retention and the step are left to the user")


def _difficulty_async() -> str:
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    py = _code_lines(os.path.join(root, "async_ckpt"), ".py")
    c = _code_lines(os.path.join(root, "csrc"), ".c")
    return (f"1 call in the loop (`engine.snapshot(step)`); behind it {py} lines of Python and {c} "
            "of C (staging pool, writer process, format, manifest, restore)")


def _code_lines(directory: str, suffix: str) -> int:
    """Non-blank lines of the files ending in ``suffix`` directly in ``directory``."""
    if not os.path.isdir(directory):
        return 0
    total = 0
    for name in os.listdir(directory):
        if name.endswith(suffix):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                total += sum(1 for line in f if line.strip())
    return total


def _overheads(results: dict, name: str, ks: list) -> dict:
    return {k: e.median for k in ks
            if (e := _value(results, "step_overhead_pct", name, k)) is not None}


def _loss(results: dict, name: str, ks: list, step_s: float) -> str:
    k = ks[-1]
    steps = int(k.split("=")[1])
    overheads = _overheads(results, name, ks)
    if not overheads:
        return "n/a (did not run)"
    check = results["consistency"].get(name)
    blocking = _value(results, "loop_blocking_s", name, k)
    lag = 0.0
    if isinstance(check, Consistency) and blocking is not None:
        lag = max(0.0, check.to_commit_s - blocking.median)
    worst = steps * step_s + lag
    lost = (f"≤ {steps} steps + {lag:.3g} s still being written = {worst:.3g} s of training"
            if lag > 0 else f"≤ {steps} steps = {worst:.3g} s of training (durable when the save "
            "returns)")
    slower = ", ".join(f"{v:+.0f}% at {kk}" if abs(v) >= 10 else f"{v:+.1f}% at {kk}"
                       for kk, v in overheads.items())
    return f"at {k}: {lost}; training time vs no checkpointing: {slower}"


def _io(results: dict, name: str, case: Optional[str]) -> str:
    blocking = _value(results, "blocking_s", name, case) if case else None
    durable = _value(results, "to_durable_s", name, case) if case else None
    stored = _value(results, "stored_bytes", name, case) if case else None
    if blocking is None or durable is None or stored is None:
        return "n/a (did not run)"
    gbps = stored.median / durable.median / 1e9
    if name == PERIODIC:
        return (f"{case} state: training stops {blocking.median:.2f} s per snapshot "
                f"({blocking.x_floor:.0f}x the copy floor) while {stored.median / 1e9:.2f} "
                f"GB are written and fsynced at {gbps:.2f} GB/s")
    return (f"{case} state: training stops {blocking.median:.3f} s per snapshot "
            f"({blocking.x_floor:.1f}x the copy floor); the {stored.median / 1e9:.2f} GB "
            f"write and fsync ({durable.median:.2f} s, {gbps:.2f} GB/s, "
            f"{durable.x_floor:.1f}x the disk floor) overlap training")


def _fit(results: dict, name: str, ks: list, case: Optional[str], step_s: float) -> str:
    """Where each save fits: how often it may run within the article's 5% budget, from its
    blocking time (a background writer's CPU use comes on top), and what the loop measured."""
    overheads = _overheads(results, name, ks)
    if not overheads:
        return "n/a (did not run)"
    measured = ", ".join(f"{v:+.0f}% at {k}" for k, v in overheads.items())
    state_mb = results["raw"]["training"]["state_bytes"] / 1e6
    blocking = _value(results, "blocking_s", name, case) if case else None
    if blocking is None:
        return f"measured ({state_mb:.3g} MB state): {measured}"
    budget = OVERHEAD_BUDGET_PCT / 100
    every = max(1, math.ceil(blocking.median * (1 - budget) / budget / step_s))
    return (f"a {case} state blocks {blocking.median:.3g} s per snapshot, so it stays within "
            f"{OVERHEAD_BUDGET_PCT:.0f}% of training time only with snapshots ≥ {every} steps of "
            f"{step_s * 1000:.0f} ms apart; the {state_mb:.3g} MB loop measured {measured}")


def _consistency(results: dict, name: str) -> str:
    check = results["consistency"].get(name)
    if not isinstance(check, Consistency):
        return str(check) if check else "n/a (did not run)"
    exact = ("bit-exact" if check.bit_exact
             else f"NOT bit-exact ({check.differing_tensors} tensors differ)")
    damage = check.damage
    if name == ASYNC:
        return (f"restore {exact}; the step is committed with the snapshot (restore() returned "
                f"{check.restored_step}); one flipped byte: {damage.outcome} "
                f"({damage.how}): XXH3 checksum per 8 MiB chunk")
    return (f"restore {exact}; the step only in the file name; one flipped byte: "
            f"{damage.outcome} ({damage.how}): no checksums")
