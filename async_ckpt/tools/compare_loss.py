"""``async-ckpt compare-loss``: JSON-lines training logs, compared bit for bit, telling a resume
that differs from a training run that is not reproducible from process to process."""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

from ..checks import is_number
from .argtypes import int_arg
from .common import EXIT_DAMAGE, EXIT_NOT_REPRODUCIBLE, EXIT_OK, UsageError, add_command


HELP = "compare JSON-lines loss logs bit for bit: did a resumed run train as an uninterrupted one"
DESCRIPTION = """\
Compare the log of an uninterrupted run (A) with the log of a resumed run (B), one JSON object per
line holding at least "step" and "loss" ("lr" too, optionally). When a step appears more than once
in a log (a resumed run replays steps), its last occurrence counts. Prints the first step whose
losses differ (with the relative size of the difference), the largest absolute difference over the
common steps, and the steps present in only one log. Exit 0 only when both logs have the same steps
with bit-identical losses (and, with --lr, learning rates). A difference is only the resume's when
training is reproducible from process to process: where B resumed (its step from a
{"resumed_from": N} line, --resumed-from N, or the first step B logs again) and the runs already
differ before that, or when C, a second uninterrupted run, differs from A, the result is NOT
REPRODUCIBLE (exit 3), not a resume that differs (exit 1).
"""

RESUMED_FROM = "resumed_from"  # the key of the line a resumed run writes after restore()


def add(commands) -> None:
    sub = add_command(commands, "compare-loss", cmd_compare_loss, HELP, DESCRIPTION)
    sub.add_argument("a", metavar="A.jsonl", help="the uninterrupted run's log")
    sub.add_argument("b", metavar="B.jsonl", help="the resumed run's log")
    sub.add_argument("c", metavar="C.jsonl", nargs="?",
                     help="optional: a second uninterrupted run's log, to check that two "
                          "uninterrupted runs agree at all")
    sub.add_argument("--lr", action="store_true",
                     help='also require bit-identical "lr" where both logs have it (without it, '
                          "a differing lr is only noted)")
    sub.add_argument("--resumed-from", type=int_arg(0), metavar="N",
                     help="the step B's first resume restored (what restore() returned); "
                          f'default: B\'s first {{"{RESUMED_FROM}": N}} line, else one before the '
                          "first step B logs again")


@dataclass(frozen=True)
class LossLog:
    """A log as read: the last and the first record of each step, and where it says it resumed."""
    path: str
    last: dict[int, dict]
    first: dict[int, dict]
    records: int
    resumed_from: Optional[int]  # the step its first resume restored, when the log tells
    resume_evidence: str  # how the log tells it ("" when it does not)


@dataclass(frozen=True)
class Difference:
    """How log Y differs from log X over their common steps."""
    common: list[int]
    only_x: list[int]
    only_y: list[int]
    first: Optional[int]  # the first common step whose losses differ
    largest: Optional[tuple[float, int]]  # the largest absolute loss difference, and its step
    lr_first: Optional[int]  # the first common step whose lrs differ (where both have one)

    def losses_same(self, lr: bool) -> bool:
        return self.first is None and not (lr and self.lr_first is not None)

    def first_step(self, lr: bool) -> int:
        """The first differing step, counting lr when ``lr``."""
        return min(s for s in (self.first, self.lr_first if lr else None) if s is not None)


def cmd_compare_loss(args: argparse.Namespace) -> int:
    a, b = read_loss_log(args.a), read_loss_log(args.b)
    c = read_loss_log(args.c) if args.c else None
    resumed_from = b.resumed_from if args.resumed_from is None else args.resumed_from
    evidence = "--resumed-from" if args.resumed_from is not None else b.resume_evidence
    for label, log in (("A", a), ("B", b), ("C", c)):
        if log is not None:
            replays = (f", {log.records - len(log.last)} replayed lines (the last of each step "
                       "counts)" if log.records > len(log.last) else "")
            print(f"{label}: {log.path}: {len(log.last)} steps ({_steps_text(sorted(log.last), 3)})"
                  f"{replays}")
    if resumed_from is not None:
        print(f"B resumed from step {resumed_from} ({evidence})")
    d = compare(a.last, b.last)
    _print_difference(d, a, b, args.lr)
    uninterrupted = None  # how A and C compare, when C is given
    if c is not None:
        uninterrupted = compare(a.last, c.last)
        if not uninterrupted.common:
            raise UsageError(f"{args.a} and {args.c} have no step in common; pass two logs of the "
                             "same uninterrupted training as A and C")
        print("A and C (both uninterrupted): " + _agreement_text(uninterrupted, a.last, c.last,
                                                                 "C", args.lr))
    before = None  # how B, as it trained before its first resume, compares with A
    if resumed_from is not None:
        before = compare(a.last, {s: r for s, r in b.first.items() if s <= resumed_from})
        if before.common:
            print(f"before the resume (B's steps up to {resumed_from}, as first logged): "
                  + _agreement_text(before, a.last, b.first, "B", args.lr))
        else:
            before = None
    result, code = _verdict(d, uninterrupted, before, resumed_from, args.lr)
    print(result)
    return code


def _print_difference(d: "Difference", a: LossLog, b: LossLog, lr: bool) -> None:
    print(f"common steps: {len(d.common)}")
    if d.first is None:
        print("losses: bit-identical on every common step")
    else:
        print(f"first difference: {_difference_text(d.first, a.last, b.last, 'A', 'B')}")
        print(f"largest absolute difference: {d.largest[0]!r} at step {d.largest[1]}")
    if d.lr_first is not None:
        s = d.lr_first
        print(f"{'lr' if lr else 'note: lr'} differs first at step {s}: "
              f"A {a.last[s]['lr']!r}, B {b.last[s]['lr']!r}")
    print(f"only in A: {_steps_text(d.only_x)}")
    print(f"only in B: {_steps_text(d.only_y)}")


def _agreement_text(d: "Difference", a: dict[int, dict], y: dict[int, dict], yn: str,
                    lr: bool) -> str:
    if d.losses_same(lr):
        return "bit-identical on every common step"
    return "differ first at " + _difference_text(d.first_step(lr), a, y, "A", yn, lr)


_MAKE_REPRODUCIBLE = ('make the runs reproducible (docs/data.md, "Reproducible runs") and compare '
                      "again")


def _verdict(d: "Difference", uninterrupted: Optional["Difference"],
             before: Optional["Difference"], resumed_from: Optional[int],
             lr: bool) -> tuple[str, int]:
    """The result line and the exit code: A and B the same, runs that are not reproducible (A
    and C differ, or B differs from A before its resume), a resume that differs, or just
    different (nothing tells where B resumed)."""
    if d.losses_same(lr) and not d.only_x and not d.only_y:
        note = ("note: A and C differ, so this set-up is not reproducible from process to "
                "process; B matched A all the same\n"
                if uninterrupted is not None and not uninterrupted.losses_same(lr) else "")
        return f"{note}result: IDENTICAL", EXIT_OK
    if uninterrupted is not None and not uninterrupted.losses_same(lr):
        return ("result: NOT REPRODUCIBLE: the two uninterrupted runs differ from each other, so "
                "a difference from the resumed run says nothing about the resume; "
                f"{_MAKE_REPRODUCIBLE}", EXIT_NOT_REPRODUCIBLE)
    if before is not None and not before.losses_same(lr):
        return (f"result: NOT REPRODUCIBLE: B differs from A at step {before.first_step(lr)}, "
                f"before it resumed from step {resumed_from}, so the difference is not the "
                f"resume's; {_MAKE_REPRODUCIBLE}", EXIT_NOT_REPRODUCIBLE)
    if before is not None and not d.losses_same(lr):
        unsure = ("" if uninterrupted is not None else "; a run that is not reproducible can also "
                  "first differ after the resume: pass a second uninterrupted run as C to rule "
                  "that out")
        return (f"result: RESUME DIFFERS: identical to A up to step {resumed_from}, where B "
                f"resumed, different from step {d.first_step(lr)} on{unsure}", EXIT_DAMAGE)
    note = ""
    if resumed_from is None and not d.losses_same(lr):
        note = (f"note: B tells no step it resumed from (a \"{RESUMED_FROM}\" line, or a step "
                "logged again after a resume from a snapshot), so this cannot tell a resume that "
                "differs from a run that is not reproducible; pass --resumed-from N, or a second "
                "uninterrupted run as C\n")
    return f"{note}result: DIFFERENT", EXIT_DAMAGE


def compare(x: dict[int, dict], y: dict[int, dict]) -> Difference:
    """How the records of ``y`` differ from those of ``x`` (both ``{step: record}``)."""
    common = sorted(x.keys() & y.keys())
    first = lr_first = None
    largest: Optional[tuple[float, int]] = None
    for step in common:
        if "lr" in x[step] and "lr" in y[step] and lr_first is None \
                and not _same_number(x[step]["lr"], y[step]["lr"]):
            lr_first = step
        u, v = x[step]["loss"], y[step]["loss"]
        if _same_number(u, v):
            continue
        first = step if first is None else first
        diff = _abs_difference(u, v)
        if largest is None or _rank_difference(diff) > _rank_difference(largest[0]):
            largest = (diff, step)
    return Difference(common, sorted(x.keys() - y.keys()), sorted(y.keys() - x.keys()), first,
                      largest, lr_first)


def _difference_text(step: int, x: dict[int, dict], y: dict[int, dict], xn: str, yn: str,
                     lr: bool = False) -> str:
    """``step 7: A loss 0.5, B loss 0.50000001 (relative difference 2e-08)``, of the loss unless
    only the lr differs there."""
    key = "lr" if lr and _same_number(x[step]["loss"], y[step]["loss"]) else "loss"
    u, v = x[step][key], y[step][key]
    return (f"step {step}: {xn} {key} {u!r}, {yn} {key} {v!r} "
            f"(relative difference {_relative_difference(u, v):.2g})")


def _relative_difference(x, y) -> float:
    """|x - y| / max(|x|, |y|): 0 for equal numbers (and for 0.0 and -0.0), nan with a nan."""
    diff = _abs_difference(x, y)
    if diff == 0 or math.isnan(diff) or math.isinf(diff):
        return diff
    return diff / max(abs(float(x)), abs(float(y)))


def _steps_text(steps: Sequence[int], limit: int = 12) -> str:
    """``1-4, 7, 9-10``: sorted steps with runs collapsed, cut after ``limit`` runs."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) > limit:
        parts = parts[:limit] + [f"... ({len(steps)} steps)"]
    return ", ".join(parts) if parts else "none"


def read_loss_log(path: str) -> LossLog:
    """The log at ``path``, checked line by line (a ``UsageError`` names the first bad line)."""
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory; pass a JSON-lines loss log")
    last: dict[int, dict] = {}
    first: dict[int, dict] = {}
    count, previous = 0, None
    resumed, resumed_from, evidence = False, None, ""
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist; pass JSON-lines loss logs") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = _loss_record(line, path, lineno)
                if RESUMED_FROM in record:
                    if not resumed:
                        resumed, resumed_from = True, record[RESUMED_FROM]
                        evidence = f'its "{RESUMED_FROM}" line {lineno}'
                    continue
                step = record["step"]
                if not resumed and previous is not None and step <= previous:
                    # the first resume: it restored the step before the first one logged again
                    # (none when it started over from step 0)
                    resumed, evidence = True, f"step {step} logged again"
                    resumed_from = step - 1 if step > 0 else None
                previous = step
                last[step] = record
                first.setdefault(step, record)
                count += 1
        except UnicodeDecodeError:
            raise UsageError(f"{path} line {lineno + 1}: not UTF-8 text; pass a JSON-lines loss "
                             "log") from None
    if not last:
        raise UsageError(f"{path} holds no loss records; pass a JSON-lines log with one "
                         '{"step": ..., "loss": ...} object per line')
    return LossLog(path, last, first, count, resumed_from,
                   evidence if resumed_from is not None else "")


def _loss_record(line: str, path: str, lineno: int) -> dict:
    where = f"{path} line {lineno}"
    fix = (f'each line must be one JSON object like {{"step": 3, "loss": 2.5}}, or '
           f'{{"{RESUMED_FROM}": 2}}')
    try:
        record = json.loads(line)
    except ValueError as e:
        raise UsageError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}); {fix}") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: not a JSON object; {fix}")
    if RESUMED_FROM in record and "step" not in record:
        value = record[RESUMED_FROM]
        if type(value) is not int or value < 0:
            raise UsageError(f"{where}: \"{RESUMED_FROM}\" must be a non-negative integer (the "
                             f"step restore() returned), got {value!r}; {fix}")
        return record
    step, loss = record.get("step"), record.get("loss")
    if type(step) is not int or step < 0:
        raise UsageError(f"{where}: \"step\" must be a non-negative integer, got {step!r}; {fix}")
    if not is_number(loss):
        raise UsageError(f"{where}: \"loss\" must be a number, got {loss!r}; {fix}")
    if "lr" in record and not is_number(record["lr"]):
        raise UsageError(f"{where}: \"lr\" must be a number, got {record['lr']!r}; {fix}")
    return {k: v for k, v in record.items() if k != RESUMED_FROM}


def _same_number(x, y) -> bool:
    """Bit-identical as float64 (so -0.0 differs from 0.0 and a NaN equals the same NaN)."""
    try:
        return struct.pack("<d", x) == struct.pack("<d", y)
    except OverflowError:  # an int beyond float64
        return x == y


def _abs_difference(x, y) -> float:
    try:
        return abs(float(x) - float(y))
    except OverflowError:
        return math.inf


def _rank_difference(d: float) -> float:
    return math.inf if math.isnan(d) else d
