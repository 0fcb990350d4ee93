"""``async-ckpt compare-loss``: two JSON-lines training logs, compared bit for bit."""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
from typing import Optional, Sequence

from ..checks import is_number
from .common import EXIT_DAMAGE, EXIT_OK, UsageError, add_command


HELP = "compare two JSON-lines loss logs bit for bit"
DESCRIPTION = """\
Compare two training logs with one JSON object per line holding at least "step" and "loss" ("lr"
too, optionally). When a step appears more than once in a log (a resumed run replays steps), its
last occurrence counts. Prints the first step whose losses differ, the largest absolute
difference over the common steps, and the steps present in only one log. Exit 0 only when both
logs have the same steps with bit-identical losses (and, with --lr, learning rates).
"""


def add(commands) -> None:
    sub = add_command(commands, "compare-loss", cmd_compare_loss, HELP, DESCRIPTION)
    sub.add_argument("a", metavar="A.jsonl", help="first log")
    sub.add_argument("b", metavar="B.jsonl", help="second log")
    sub.add_argument("--lr", action="store_true",
                     help='also require bit-identical "lr" where both logs have it (without it, '
                          "a differing lr is only noted)")


def cmd_compare_loss(args: argparse.Namespace) -> int:
    a, a_lines = _read_loss_log(args.a)
    b, b_lines = _read_loss_log(args.b)
    common = sorted(a.keys() & b.keys())
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    for label, path, log, lines in (("A", args.a, a, a_lines), ("B", args.b, b, b_lines)):
        replays = (f", {lines - len(log)} replayed lines (the last of each step counts)"
                   if lines > len(log) else "")
        print(f"{label}: {path}: {len(log)} steps ({_steps_text(sorted(log), 3)}){replays}")
    print(f"common steps: {len(common)}")
    first = None
    largest: Optional[tuple[float, int]] = None
    for step in common:
        x, y = a[step]["loss"], b[step]["loss"]
        if _same_number(x, y):
            continue
        first = step if first is None else first
        diff = _abs_difference(x, y)
        if largest is None or _rank_difference(diff) > _rank_difference(largest[0]):
            largest = (diff, step)
    if first is None:
        print("losses: bit-identical on every common step")
    else:
        x, y = a[first]["loss"], b[first]["loss"]
        print(f"first difference: step {first}: A loss {x!r}, B loss {y!r}")
        print(f"largest absolute difference: {largest[0]!r} at step {largest[1]}")
    lr_differs = [s for s in common if "lr" in a[s] and "lr" in b[s]
                  and not _same_number(a[s]["lr"], b[s]["lr"])]
    if lr_differs:
        print(f"{'lr' if args.lr else 'note: lr'} differs first at step {lr_differs[0]}: "
              f"A {a[lr_differs[0]]['lr']!r}, B {b[lr_differs[0]]['lr']!r}")
    print(f"only in A: {_steps_text(only_a)}")
    print(f"only in B: {_steps_text(only_b)}")
    same = first is None and not only_a and not only_b and not (args.lr and lr_differs)
    print("result: IDENTICAL" if same else "result: DIFFERENT")
    return EXIT_OK if same else EXIT_DAMAGE


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


def _read_loss_log(path: str) -> tuple[dict[int, dict], int]:
    """``{step: record}`` (the last record of each step) and the number of records read."""
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory; pass a JSON-lines loss log")
    log: dict[int, dict] = {}
    count = 0
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist; pass two JSON-lines loss logs") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = _loss_record(line, path, lineno)
                log[record["step"]] = record
                count += 1
        except UnicodeDecodeError:
            raise UsageError(f"{path} line {lineno + 1}: not UTF-8 text; pass a JSON-lines loss "
                             "log") from None
    if not log:
        raise UsageError(f"{path} holds no loss records; pass a JSON-lines log with one "
                         '{"step": ..., "loss": ...} object per line')
    return log, count


def _loss_record(line: str, path: str, lineno: int) -> dict:
    where = f"{path} line {lineno}"
    fix = 'each line must be one JSON object like {"step": 3, "loss": 2.5}'
    try:
        record = json.loads(line)
    except ValueError as e:
        raise UsageError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}); {fix}") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: not a JSON object; {fix}")
    step, loss = record.get("step"), record.get("loss")
    if type(step) is not int or step < 0:
        raise UsageError(f"{where}: \"step\" must be a non-negative integer, got {step!r}; {fix}")
    if not is_number(loss):
        raise UsageError(f"{where}: \"loss\" must be a number, got {loss!r}; {fix}")
    if "lr" in record and not is_number(record["lr"]):
        raise UsageError(f"{where}: \"lr\" must be a number, got {record['lr']!r}; {fix}")
    return record


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
