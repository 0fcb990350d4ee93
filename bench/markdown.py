"""How the report writes numbers and tables, for every section of it (``report.py`` and each
benchmark's ``render``): one place, so that a figure reads the same wherever it appears."""

from __future__ import annotations

from typing import Callable, Mapping, Optional


def number(x: Optional[float]) -> str:
    """Three significant digits; from 1000 whole numbers with thousands separators; "–": none."""
    if x is None:
        return "–"
    if x == 0:
        return "0"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def factor(x: Optional[float]) -> str:
    """A ratio: ``0.62×``, ``14×``; "–" for none."""
    if x is None:
        return "–"
    return f"{x:.0f}×" if abs(x) >= 10 else f"{x:.2g}×"


def median_range(entry, scale: float = 1.0, fmt: Callable[[float], str] = number) -> str:
    """``median (min–max)`` of a spread (a ``measure.spread`` dict or a ``records.Spread``); the
    range only where there are two values or more and they differ."""
    if isinstance(entry, Mapping):
        median, low, high, n = entry["median"], entry["min"], entry["max"], entry.get("n", 1)
    else:
        median, low, high, n = entry.median, entry.min, entry.max, entry.n
    text = fmt(median / scale)
    if n > 1 and low != high:
        text += f" ({fmt(low / scale)}–{fmt(high / scale)})"
    return text


def spread_text(entry: Mapping, fmt: Callable[[float], str], unit: str = "") -> str:
    """``median{unit} (min–max)`` of a spread, each number written by ``fmt``, the range always:
    ``10.9 ms (10.5–20.4)``."""
    return f"{fmt(entry['median'])}{unit} ({fmt(entry['min'])}–{fmt(entry['max'])})"


def hundredths(x: float) -> str:
    return f"{x:.2f}"


def thousandths(x: float) -> str:
    return f"{x:.3f}"


def milliseconds(x: float) -> str:
    """Seconds as whole milliseconds."""
    return f"{x * 1e3:.0f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)
