"""How the report writes numbers, tables and sections, for every section of it (``report.py``
and each part's ``render``): one place, so that a figure reads the same wherever it appears.

A spread is a ``measure.spread`` dict or a ``records.Spread``; a ``scale`` is the unit's size in
the value's own (1e-3: milliseconds of seconds; 1e6: MB of bytes)."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Sequence

Format = Callable[[float], str]


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


def fixed(places: int, scale: float = 1.0, unit: str = "") -> Format:
    """``x / scale`` with ``places`` decimals, then ``unit``: ``fixed(2, unit="×")(1.5)`` is
    ``1.50×``."""
    return lambda x: f"{x / scale:.{places}f}{unit}"


def digits(significant: int, unit: str = "") -> Format:
    """``significant`` digits, then ``unit``."""
    return lambda x: f"{x:.{significant}g}{unit}"


def over_one(x: float) -> str:
    """A ratio as the percent it adds: 1.034 is ``+3.4%``."""
    return f"{(x - 1) * 100:+.1f}%"


def points(x: float) -> str:
    """A percentage, signed: ``+3.4%``, ``-12%``."""
    return f"{x:+.2g}%" if abs(x) < 10 else f"{x:+.0f}%"


def median_range(entry, scale: float = 1.0, fmt: Format = number) -> str:
    """``median (min–max)`` of a spread, "–" for none; the range only where there are two values
    or more and they differ."""
    if entry is None:
        return "–"
    if isinstance(entry, Mapping):
        median, low, high, n = entry["median"], entry["min"], entry["max"], entry.get("n", 1)
    else:
        median, low, high, n = entry.median, entry.min, entry.max, entry.n
    text = fmt(median / scale)
    if n > 1 and low != high:
        text += f" ({fmt(low / scale)}–{fmt(high / scale)})"
    return text


def with_ratios(entry, *ratios: Optional[float], scale: float = 1.0) -> str:
    """``median (min–max) · ×floor · ×best peer``: a spread and its ratios."""
    return " · ".join([median_range(entry, scale), *map(factor, ratios)])


def spread_text(entry: Mapping, fmt: Format, unit: str = "") -> str:
    """``median{unit} (min–max)`` of a spread, the range always: ``10.9 ms (10.5–20.4)``."""
    return f"{fmt(entry['median'])}{unit} ({fmt(entry['min'])}–{fmt(entry['max'])})"


def ms(entry: Mapping, places: int = 0) -> str:
    """A spread of seconds in milliseconds: ``12 ms (10–20)``."""
    return spread_text(entry, fixed(places, 1e-3), " ms")


def seconds(entry: Mapping, places: int = 3) -> str:
    """A spread of seconds: ``0.123 s (0.101–0.150)``."""
    return spread_text(entry, fixed(places), " s")


def ratio(entry: Mapping, places: int = 2) -> str:
    """A spread of ratios taken round by round: ``×1.23 (1.10–1.40)``."""
    return "×" + spread_text(entry, fixed(places))


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table; a row may stop short of the header (an "n/a" row), an empty cell is
    ``| |``."""
    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(" " + c.replace("|", "\\|") + " " if c else " " for c in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def section(title: str, *blocks: str, level: int = 3) -> str:
    """``### title`` and its paragraphs and tables, a blank line apart; empty ones left out."""
    return "\n\n".join(["#" * level + " " + title, *(b for b in blocks if b)])
