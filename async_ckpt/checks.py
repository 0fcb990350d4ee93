"""How every layer checks a value it did not make, and names a bad one in a message.

Shared by the readers of untrusted files (a shard's index, the manifest, saved RNG states,
heartbeats) and the checks of what users pass (``EngineOptions``, the commands' arguments): one
rule for what counts as a number (never a bool, which Python counts as an int) and one bound on
how much of a bad value a message repeats (a crafted value must not flood a log). Imports nothing
of the library, so that any module may use it.
"""

from __future__ import annotations

from typing import Any, Optional


def is_int(value: Any, lo: int = 0, hi: Optional[int] = None) -> bool:
    """An int (not a bool, not a NumPy integer) in [lo, hi]; no upper bound when ``hi`` is None."""
    return type(value) is int and lo <= value and (hi is None or value <= hi)


def is_number(value: Any) -> bool:
    """An int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters; a ``__repr__`` that fails does not hide the
    error being reported."""
    try:
        text = repr(value)
    except Exception:  # a user object's __repr__ may raise anything
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
