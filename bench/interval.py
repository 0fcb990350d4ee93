"""The report's snapshot-interval advice: ``async_ckpt.tools.advise`` fed with this run's measurements.

For each system that ran the training loop: the step time is the loop's without checkpointing (at
the largest K), the blocking time the median ``save`` time in the loop at the largest K (where no
save waits for an earlier one), and the time to durable the one measured by the consistency check
on the same state. A periodic blocking save is priced with its blocking time as its whole cost. The
mean time between failures and the run's length are the benchmark's ``--mtbf`` and
``--run-length`` (defaults: a failure a day, the article's 10-day run; the article is
``article.SOURCE``).
"""

from __future__ import annotations

from typing import Sequence

from async_ckpt.tools.advise import advise, expected_loss

from .records import Cell, Consistency, NotAvailable
from .registry import SystemSpec


def advice(results: dict, specs: Sequence[SystemSpec], mtbf_s: float, run_length_s: float) -> dict:
    """For each of ``specs``: ``advise``'s dict, or ``NotAvailable``."""
    figures = results["figures"]
    throughput = figures["throughput_steps_s"]
    k_last = throughput.cases[-1]
    step_s = 1 / throughput.values["no checkpointing"][k_last].median
    total_steps = max(1, round(run_length_s / step_s))
    rows = {}
    for spec in specs:
        blocking = figures["loop_blocking_s"].values[spec.name][k_last]
        check = results["consistency"].get(spec.name)
        if not isinstance(blocking, Cell) or not isinstance(check, Consistency):
            rows[spec.name] = blocking if isinstance(blocking, NotAvailable) else \
                NotAvailable("did not run")
            continue
        b = blocking.median
        cost = b if spec.blocking else max(b, check.to_commit_s)
        result = advise(step_s, cost, mtbf_s, blocking_s=b, total_steps=total_steps)
        result["at_measured_k"] = {case: expected_loss(step_s, cost, mtbf_s, int(case[2:]), b)
                                   for case in throughput.cases}
        rows[spec.name] = result
    return {"mtbf_s": mtbf_s, "run_length_s": run_length_s, "step_time_s": step_s,
            "total_steps": total_steps, "systems": rows}
