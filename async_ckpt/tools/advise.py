"""How often to snapshot: an interval from the step time, the snapshot's cost and the failure rate.

Snapshotting more often costs more time in snapshots; less often, more recomputation after a
failure. With failures arriving at random at a mean time between failures ``M``, a snapshot that
stops training for ``b`` seconds, and ``tau`` seconds of training between snapshots (one cycle
lasts ``T = tau + b``), the fraction of wall time lost is to first order::

    lost = b / T                    # stopped for snapshots
         + (T / 2 + lag + R) / M    # rework: per failure, on average half a cycle is recomputed,
                                    # plus the snapshot's durability lag, plus the restart time R

Minimising it gives Young's interval (1974) ``tau = sqrt(2 b M)``, where the loss is about
``sqrt(2 b / M)``. Daly's higher-order estimate (2006), better when ``b`` is not small against
``M``, is::

    tau = sqrt(2 b M) * (1 + sqrt(b / (2 M)) / 3 + (b / (2 M)) / 9) - b     if b < 2 M
    tau = M                                                                 otherwise

and Daly's model without the first-order approximation (exponentially distributed failures) gives
the lost fraction ``1 - tau / (M * exp((R + lag) / M) * (exp(T / M) - 1))``; both are reported.

The subtlety with asynchronous snapshots: ``snapshot()`` returns once the state is copied into
staging memory, ``b`` = the *blocking* time, and the write goes on while training continues. So the
per-snapshot cost that slows training, and that goes into Young's and Daly's formulas, is the
blocking time, not the time to durable. The time to durable still matters: a failure while a
snapshot is in flight falls back to the previous one, so the snapshot's durability lag
(``lag`` = time to durable - blocking time) adds to the expected rework of every failure, and
snapshots must not come faster than the writer commits them (the interval is at least ``lag``,
or they queue). For a periodic blocking save both times are the same: ``b`` = time to durable and
``lag`` = 0.

The article this project started from (a Chinese article on fault-tolerant restarts of
distributed training, whose first line begins "分布式训练容错重启的断点续训设计") advises an interval of 1-5% of the total training time (a 10-day
run: every 2.4-12 hours), or every 1000-2000 steps on a GPU cluster; ``advise`` prices those
intervals with the same model so they can be compared with the computed one.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Optional

from .argtypes import DURATION_FORMS, duration_arg, duration_text, int_arg
from ..checks import is_int, is_number

__all__ = ["advise", "expected_loss", "format_advice", "add_arguments", "advise_from_args",
           "render", "CLI_HELP", "CLI_DESCRIPTION"]

RULE_OF_THUMB_FRACTIONS = (0.01, 0.05)  # the article: the interval is 1-5% of the training time
CLUSTER_RULE_STEPS = (1000, 2000)  # the article: "every 1000-2000 steps" on a GPU cluster


def advise(step_time_s: float, snapshot_cost_s: float, mtbf_s: float,
           blocking_s: Optional[float] = None, total_steps: Optional[int] = None, *,
           restart_s: float = 0.0) -> dict:
    """Recommend a snapshot interval (Young/Daly) and price it, next to the article's rules.

    Args:
        step_time_s: seconds per training step without snapshots.
        snapshot_cost_s: seconds from ``snapshot()`` to the durable commit (``stats()``
            ``to_commit_s``); for a blocking save, its whole duration.
        mtbf_s: mean time between failures of the job, in seconds.
        blocking_s: seconds ``snapshot()`` stops training (``stats()`` ``blocking_s``); None means
            a blocking save, where it equals ``snapshot_cost_s``.
        total_steps: steps of the whole run; needed for the article's 1-5% rule and the totals.
        restart_s: seconds from a failure to training again (restart, restore), charged per failure.

    Returns a dict: the inputs; ``young_interval_s`` and ``daly_interval_s`` (training time between
    snapshots); the recommendation ``interval_steps`` / ``interval_s`` (Daly's, at least one step
    and at least the durability lag; ``limited_by`` says when a bound applied); its expected
    ``fraction_checkpointing``, ``fraction_rework``, ``fraction_lost`` (first order) and
    ``fraction_lost_exponential`` (Daly's model); ``rule_of_thumb`` (1-5% of the run; None without
    ``total_steps``) and ``cluster_rule`` (1000-2000 steps), each priced the same way; ``totals``
    over the run when ``total_steps`` is given.

    Raises ValueError for non-finite or negative inputs, a blocking time above the snapshot cost,
    or an MTBF not longer than the snapshot cost (the job would fail before a snapshot commits).
    """
    blocking = snapshot_cost_s if blocking_s is None else blocking_s
    _check(step_time_s, snapshot_cost_s, mtbf_s, blocking, total_steps, restart_s)
    lag = snapshot_cost_s - blocking
    young = math.sqrt(2 * blocking * mtbf_s)
    daly = _daly(blocking, mtbf_s)
    steps_for_daly = max(1, round(daly / step_time_s))
    steps_for_lag = math.ceil(lag / step_time_s - 1e-9) if lag > 0 else 1
    interval_steps = max(steps_for_daly, steps_for_lag)
    limited_by = None
    if interval_steps > steps_for_daly:
        limited_by = "time to durable"
    elif daly < step_time_s / 2:
        limited_by = "one step"
    model = _Model(step_time_s, blocking, lag, mtbf_s, restart_s)
    result = {
        "step_time_s": step_time_s, "snapshot_cost_s": snapshot_cost_s, "blocking_s": blocking,
        "durability_lag_s": lag, "mtbf_s": mtbf_s, "restart_s": restart_s,
        "total_steps": total_steps,
        "young_interval_s": young, "daly_interval_s": daly,
        "interval_steps": interval_steps, "interval_s": interval_steps * step_time_s,
        "limited_by": limited_by, **model.price(interval_steps),
        "rule_of_thumb": None, "cluster_rule": model.price_range(CLUSTER_RULE_STEPS),
        "totals": None,
    }
    if total_steps is not None:
        run_s = total_steps * step_time_s
        steps = tuple(max(1, round(f * run_s / step_time_s)) for f in RULE_OF_THUMB_FRACTIONS)
        result["rule_of_thumb"] = {"run_s": run_s, "fractions": RULE_OF_THUMB_FRACTIONS,
                                   **model.price_range(steps)}
        wall_s = run_s / max(1e-12, 1 - result["fraction_lost"])
        result["totals"] = {"run_s": run_s, "snapshots": total_steps // interval_steps,
                            "wall_s": wall_s, "failures": wall_s / mtbf_s,
                            "lost_s": wall_s - run_s}
    return result


def expected_loss(step_time_s: float, snapshot_cost_s: float, mtbf_s: float, interval_steps: int,
                  blocking_s: Optional[float] = None, *, restart_s: float = 0.0) -> dict:
    """The expected fractions of time lost when snapshotting every ``interval_steps`` steps (same
    arguments and model as ``advise``): ``fraction_checkpointing``, ``fraction_rework``,
    ``fraction_lost`` and ``fraction_lost_exponential``."""
    blocking = snapshot_cost_s if blocking_s is None else blocking_s
    _check(step_time_s, snapshot_cost_s, mtbf_s, blocking, None, restart_s)
    if not is_int(interval_steps, 1):
        raise ValueError(f"interval_steps must be a positive int, not {interval_steps!r}")
    model = _Model(step_time_s, blocking, snapshot_cost_s - blocking, mtbf_s, restart_s)
    return model.price(interval_steps)


def _check(step_time_s, snapshot_cost_s, mtbf_s, blocking, total_steps, restart_s) -> None:
    for name, value in (("step_time_s", step_time_s), ("snapshot_cost_s", snapshot_cost_s),
                        ("mtbf_s", mtbf_s), ("blocking_s", blocking), ("restart_s", restart_s)):
        if not is_number(value) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
        if value < 0:
            raise ValueError(f"{name} must not be negative, not {value!r}")
    if step_time_s == 0:
        raise ValueError("step_time_s must be positive: the time of one training step")
    if blocking > snapshot_cost_s:
        raise ValueError(f"blocking_s ({blocking} s) cannot exceed snapshot_cost_s "
                         f"({snapshot_cost_s} s): a snapshot is durable no sooner than snapshot() "
                         "returns; pass the time from snapshot() to the durable commit")
    if mtbf_s <= snapshot_cost_s:
        raise ValueError(f"the mean time between failures ({mtbf_s} s) must be longer than the "
                         f"snapshot cost ({snapshot_cost_s} s): the job would fail before a "
                         "snapshot commits; make snapshots cheaper or the job more reliable")
    if total_steps is not None and not is_int(total_steps, 1):
        raise ValueError(f"total_steps must be a positive int, not {total_steps!r}")


def _daly(blocking: float, mtbf: float) -> float:
    if blocking >= 2 * mtbf:
        return mtbf
    x = blocking / (2 * mtbf)
    return max(0.0, math.sqrt(2 * blocking * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - blocking)


class _Model:
    """The expected losses of an interval (see the module docstring)."""

    def __init__(self, step_time: float, blocking: float, lag: float, mtbf: float, restart: float):
        self.step_time, self.blocking, self.lag = step_time, blocking, lag
        self.mtbf, self.restart = mtbf, restart

    def price(self, interval_steps: int) -> dict:
        tau = interval_steps * self.step_time
        cycle = tau + self.blocking
        checkpointing = self.blocking / cycle
        rework = (cycle / 2 + self.lag + self.restart) / self.mtbf
        exponential = 1 - tau / (self.mtbf * math.exp((self.restart + self.lag) / self.mtbf)
                                 * math.expm1(cycle / self.mtbf))
        return {"fraction_checkpointing": checkpointing, "fraction_rework": rework,
                "fraction_lost": checkpointing + rework,
                "fraction_lost_exponential": min(1.0, max(0.0, exponential))}

    def price_range(self, steps: tuple[int, int]) -> dict:
        low, high = (self.price(s) for s in steps)
        return {"interval_steps": list(steps),
                "interval_s": [s * self.step_time for s in steps],
                **{k: [low[k], high[k]] for k in low}}


# --- text -----------------------------------------------------------------------------------


def format_advice(result: dict) -> str:
    """The advice as a few lines of text (what ``async-ckpt advise`` prints)."""
    r, t = result, duration_text
    b, c, lag = r["blocking_s"], r["snapshot_cost_s"], r["durability_lag_s"]
    lines = [f"step time {t(r['step_time_s'])}; MTBF {t(r['mtbf_s'])}"
             + (f"; restart {t(r['restart_s'])}" if r["restart_s"] else "")]
    if lag > 0:
        lines.append(f"snapshot: blocks training {t(b)}, durable after {t(c)} "
                     f"({t(lag)} in flight while training goes on)")
    else:
        lines.append(f"snapshot: blocks training {t(b)} until durable")
    lines.append(f"Young: sqrt(2 x {t(b)} x {t(r['mtbf_s'])}) = "
                 f"{t(r['young_interval_s'])}; Daly: {t(r['daly_interval_s'])} "
                 "of training between snapshots")
    bound = {"one step": " (at least one step)",
             "time to durable": " (no sooner than the previous snapshot is durable)"}.get(
                 r["limited_by"], "")
    every = "every step" if r["interval_steps"] == 1 else f"every {r['interval_steps']} steps"
    lines.append(f"recommended: {every} ({t(r['interval_s'])}){bound}")
    lines.append("  expected time lost: " + _losses(r))
    rule = r["rule_of_thumb"]
    if rule is None:
        lines.append("article's rule of thumb (interval = 1-5% of the run): give the total steps "
                     "to compare")
    else:
        lines.append(f"article's rule of thumb, interval = 1-5% of the {t(rule['run_s'])} "
                     f"run: every {rule['interval_steps'][0]}-{rule['interval_steps'][1]} steps "
                     f"({t(rule['interval_s'][0])}-{t(rule['interval_s'][1])})")
        lines.append("  expected time lost: " + _losses(rule))
    cluster = r["cluster_rule"]
    lines.append(f"article's cluster habit, every {cluster['interval_steps'][0]}-"
                 f"{cluster['interval_steps'][1]} steps ({t(cluster['interval_s'][0])}-"
                 f"{t(cluster['interval_s'][1])})")
    lines.append("  expected time lost: " + _losses(cluster))
    totals = r["totals"]
    if totals is not None:
        lines.append(f"over the run at the recommended interval: {totals['snapshots']} snapshots, "
                     f"{totals['failures']:.1f} expected failures, {t(totals['lost_s'])} "
                     f"lost of {t(totals['wall_s'])} wall time")
    return "\n".join(lines)


def _losses(priced: dict) -> str:
    """"a% snapshots + b% rework = c%" for one interval or a low-high range of two."""
    def pct(key: str) -> str:
        value = priced[key]
        if isinstance(value, list):
            return f"{_percent(value[0])}-{_percent(value[1])}"
        return _percent(value)
    return (f"{pct('fraction_checkpointing')} to snapshots + {pct('fraction_rework')} to rework "
            f"= {pct('fraction_lost')} (Daly's model: {pct('fraction_lost_exponential')})")


def _percent(x: float) -> str:
    x *= 100
    if x >= 10:
        return f"{x:.0f}%"
    if x >= 0.1:
        return f"{x:.2g}%" if x < 1 else f"{x:.1f}%"
    if x >= 0.001:
        return f"{x:.1g}%"
    return "<0.001%" if x > 0 else "0%"


# --- command line -----------------------------------------------------------------------------

CLI_HELP = "recommend a snapshot interval from step time, snapshot cost and MTBF"
CLI_DESCRIPTION = (
    "Recommend how often to snapshot (Young's and Daly's optimum interval) from the step time, "
    "the snapshot's cost and the mean time between failures, and show the expected fraction of "
    "time lost to snapshots and to recomputation after failures, next to the article's rule of "
    "thumb (an interval of 1-5% of the training time). For asynchronous snapshots give both "
    "--blocking (stats() blocking_s) and --snapshot-cost (stats() to_commit_s): only the blocking "
    "time slows training; the rest adds to the rework after a failure. A DURATION is "
    f"{DURATION_FORMS}.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``advise`` options on ``parser``."""
    parser.add_argument("--step-time", required=True, type=duration_arg(), metavar="DURATION",
                        help="time of one training step without snapshots")
    parser.add_argument("--mtbf", required=True, type=duration_arg(), metavar="DURATION",
                        help="mean time between failures of the whole job")
    parser.add_argument("--snapshot-cost", required=True, type=duration_arg(), metavar="DURATION",
                        help="time from snapshot() to the durable commit (stats() to_commit_s; "
                             "for a blocking save, its duration)")
    parser.add_argument("--blocking", type=duration_arg(), metavar="DURATION", default=None,
                        help="time snapshot() stops training (stats() blocking_s); default: the "
                             "snapshot cost, as for a blocking save")
    parser.add_argument("--total-steps", type=int_arg(1), metavar="N", default=None,
                        help="steps of the whole run (for the article's 1-5%% rule and totals)")
    parser.add_argument("--restart-time", type=duration_arg(), metavar="DURATION", default=0.0,
                        help="time from a failure to training again (default 0)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")


def advise_from_args(args: argparse.Namespace) -> dict:
    """``advise`` on parsed ``add_arguments`` options; raises ValueError like ``advise``."""
    return advise(args.step_time, args.snapshot_cost, args.mtbf, blocking_s=args.blocking,
                  total_steps=args.total_steps, restart_s=args.restart_time)


def render(args: argparse.Namespace, result: dict) -> str:
    """What the command prints: text, or JSON with ``--json``."""
    return json.dumps(result, indent=1) if args.json else format_advice(result)

