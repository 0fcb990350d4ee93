"""The argument types the command line's options share, so that every command reads a number or a
duration by the same rules (``async-ckpt advise --mtbf 24h`` and ``supervise --grace 30s`` alike),
and shows a duration in the units it reads.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable, Optional

__all__ = ["DURATION_FORMS", "duration_arg", "duration_text", "int_arg", "parse_duration"]

# What every DURATION option accepts, said once: in the --help of each command that has one (advise,
# supervise) and in docs/cli.md.
DURATION_FORMS = ("a number with a unit: 350ms, 2.5s, 10min (or 10m), 24h, 7d; a plain number is "
                  "seconds")

_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0,
          "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(.*?)\s*([a-z]*)\s*")  # a number as float() reads it, then a unit


def parse_duration(text: str) -> float:
    """Seconds from ``"0.35"``, ``"350ms"``, ``"2.5s"``, ``"10min"`` (or ``"10m"``), ``"24h"``,
    ``"7d"``; ValueError otherwise (negative and non-finite durations included)."""
    number, unit = _DURATION.fullmatch(text.lower()).groups()
    try:
        seconds = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        seconds = math.nan
    if not seconds >= 0:  # also NaN: no number, an unknown unit, or "nan" itself
        raise ValueError(f"not a duration: {text!r}; write e.g. 0.35, 350ms, 2.5s, 10min, 24h, 7d")
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {text!r} is too long")
    return seconds


def duration_text(seconds: float) -> str:
    """``seconds`` for people, in the largest unit it reaches: ``350 ms``, ``2.5 s``, ``10 min``,
    ``24 h``, ``7 d`` (three significant digits)."""
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.3g} s"
    return f"{seconds * 1000:.3g} ms"


def duration_arg(positive: bool = False) -> Callable[[str], float]:
    """An argparse type: a duration in seconds (:func:`parse_duration`), above 0 if ``positive``."""
    def parse(text: str) -> float:
        try:
            seconds = parse_duration(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if positive and seconds == 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return seconds
    return parse


def int_arg(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f"in {minimum}..{maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {value}")
        return value
    return parse
