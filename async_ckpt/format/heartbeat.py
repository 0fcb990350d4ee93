"""A heartbeat file's record (``DIR/heartbeat.rankNNNNN.json``, docs/operations.md): what the
engine writes from the training loop (``train/heartbeat.py``) and a supervisor reads to tell a
hung job from a slow one (``tools/supervisor.py``), its fields named here only."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from ..checks import is_int, is_number


@dataclass(frozen=True)
class HeartbeatRecord:
    """Rank ``rank`` called ``snapshot(step)`` at Unix ``time``, from process ``pid`` on
    ``host``, beating at most every ``interval`` seconds; ``closed``: its engine has closed, so it
    is past its checkpointing (a supervisor stops timing it). ``pid``, ``host`` and ``interval``
    may be None in a file another program wrote: only the first three decide anything."""

    rank: int
    step: int
    time: float
    pid: Optional[int] = None
    host: Optional[str] = None
    interval: Optional[float] = None
    closed: bool = False

    def to_bytes(self) -> bytes:
        fields = {"rank": self.rank, "step": self.step, "time": self.time, "pid": self.pid,
                  "host": self.host, "interval": self.interval}
        return json.dumps({**fields, "closed": True} if self.closed else fields).encode()

    @classmethod
    def parse(cls, data: bytes) -> Optional["HeartbeatRecord"]:
        """The record ``data`` holds; None for what is not a heartbeat (not JSON, half
        replaced, no integer ``rank`` and ``step``, no finite ``time``): the next beat replaces
        it."""
        try:
            d = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not (isinstance(d, dict) and is_int(d.get("rank")) and is_int(d.get("step"))
                and is_number(d.get("time")) and math.isfinite(d["time"])):
            return None
        pid, host, interval = d.get("pid"), d.get("host"), d.get("interval")
        return cls(d["rank"], d["step"], d["time"], pid if is_int(pid) else None,
                   host if isinstance(host, str) else None,
                   interval if is_number(interval) else None, d.get("closed") is True)
