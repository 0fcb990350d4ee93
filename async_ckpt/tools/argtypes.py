"""The argument types the command line's options share, so that every command reads a number or a
duration by the same rules (``async-ckpt advise --mtbf 24h`` and ``supervise --grace 30s`` alike).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable, Optional

__all__ = ["DURATION_FORMS", "duration_arg", "int_arg", "is_number", "parse_duration"]

# What every DURATION option accepts, said once: in the --help of each command that has one (advise,
# supervise) and in docs/cli.md.
DURATION_FORMS = ("a number with a unit: 350ms, 2.5s, 10min (or 10m), 24h, 7d; a plain number is "
                  "seconds")

_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0,
          "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(.*?)\s*([a-z]*)\s*")  # a number as float() reads it, then a unit


def is_number(value: Any) -> bool:
    """An int or a float, and not a bool (which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
