"""Typed records of what the benchmark concludes: a figure's value for a system and a case
(``Cell``), a target's ratio (``TargetRatio``), a recovery-consistency check (``Consistency``),
and, wherever one of them has no value, ``NotAvailable`` with the reason, never a string in a
number's place.

results.json keeps its plain-JSON schema (``__main__.SCHEMA``): ``to_json`` is the
``json.dumps`` hook that writes a record (a ``NotAvailable`` as ``"n/a (reason)"``), and each
``from_json`` reads one back, so a fresh run and ``--render`` of a saved one are reported from the
same records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union


@dataclass(frozen=True)
class NotAvailable:
    """No value here, and why: a system that did not run, a ratio without its reference."""

    reason: str

    def __str__(self) -> str:
        return f"n/a ({self.reason})"

    @classmethod
    def parse(cls, text: str) -> "NotAvailable":
        if not (text.startswith("n/a (") and text.endswith(")")):
            raise ValueError(f"not an n/a value: {text!r}")
        return cls(text[len("n/a ("):-1])


@dataclass(frozen=True)
class Spread:
    """Repeated measurements (one per interleaved round) summarised: ``measure.spread``."""

    median: float
    min: float
    max: float
    n: int


@dataclass(frozen=True)
class Cell(Spread):
    """One figure of one system in one case (``figures.py``): the spread of its values over the
    rounds; ``floor``, the median of the rounds' floors; ``x_floor``, the median of the per-round
    ratios to them; ``x_best_peer``, its median over the best peer's (None where that means
    nothing); ``extra``, what the figure adds (``drain_s``, ``step_s``, ...)."""

    floor: Optional[float] = None
    x_floor: Optional[float] = None
    x_best_peer: Optional[float] = None
    extra: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def from_json(cls, value: dict) -> "Cell":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in value.items() if k in names},
                   extra={k: v for k, v in value.items() if k not in names})


Value = Union[Cell, NotAvailable]


def value_from_json(value: Union[dict, str]) -> Value:
    return NotAvailable.parse(value) if isinstance(value, str) else Cell.from_json(value)


@dataclass(frozen=True)
class FigureValues:
    """One figure (``figures.Figure``) measured: ``values[system][case]``, and each case's best
    peer (None where no peer has a value)."""

    title: str
    unit: str
    floor: str
    lower_is_better: bool
    cases: list[str]
    best_peer: dict[str, Optional[str]]
    values: dict[str, dict[str, Value]]

    @classmethod
    def from_json(cls, value: dict) -> "FigureValues":
        values = {name: {case: value_from_json(v) for case, v in cases.items()}
                  for name, cases in value["values"].items()}
        return cls(**{**value, "values": values})


@dataclass(frozen=True)
class TargetRatio(Spread):
    """A target's ratio in one case (``targets.py``), and whether its median meets the target."""

    meets: bool = False


@dataclass(frozen=True)
class TargetRow:
    key: str
    title: str
    limit: float
    values: dict[str, Union[TargetRatio, NotAvailable]]


@dataclass(frozen=True)
class Targets:
    """Every target (``rows``) in every fp32 case of the sweep (``cases``)."""

    cases: list[str]
    rows: list[TargetRow]

    @classmethod
    def from_json(cls, value: dict) -> "Targets":
        rows = [TargetRow(**{**row, "values": {
            case: NotAvailable.parse(v) if isinstance(v, str) else TargetRatio(**v)
            for case, v in row["values"].items()}}) for row in value["rows"]]
        return cls(value["cases"], rows)


@dataclass(frozen=True)
class Damage:
    """What a restore made of a snapshot with one flipped byte: ``outcome`` ("detected", "not
    detected", "no effect") and ``how``."""

    outcome: str
    how: str


@dataclass(frozen=True)
class Consistency:
    """``consistency.check``: whether a restore gave the snapshot back bit for bit, and what a
    damaged snapshot did."""

    step: int
    to_commit_s: float
    restored_step: Optional[int]
    bit_exact: bool
    differing_tensors: int
    tensors: int
    damage: Damage

    @classmethod
    def from_json(cls, value: Union[dict, str]) -> Union["Consistency", NotAvailable]:
        if isinstance(value, str):
            return NotAvailable.parse(value)
        return cls(**{**value, "damage": Damage(**value["damage"])})


def to_json(record) -> Union[dict, str]:
    """The results.json form of a record: ``json.dumps(results, default=to_json)``."""
    if isinstance(record, NotAvailable):
        return str(record)
    if not dataclasses.is_dataclass(record):
        raise TypeError(f"{type(record).__name__} is not a benchmark record")
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    if isinstance(record, Cell):
        extra = fields.pop("extra")
        return {**fields, **extra}
    return fields
