"""Typed records of the benchmark's conclusions (``NotAvailable``, never a string, where a number
is missing); ``to_json``/``from_json``: results.json stays plain JSON, which ``--render`` reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union


@dataclass(frozen=True)
class NotAvailable:
    """No value here, and why; ``"n/a (reason)"`` in results.json."""

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
    """``harness.spread`` of one value per round."""

    median: float
    min: float
    max: float
    n: int


@dataclass(frozen=True)
class Cell(Spread):
    """One figure of one system in one case; ``x_floor`` is the median of per-round ratios, not a
    ratio of medians; ``extra``: what the figure adds (``drain_s``, ...)."""

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
    """``values[system][case]``, and each case's best peer (None where no peer has a value)."""

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
    """A target's ratio in one case, and whether its median meets the target."""

    meets: bool = False


@dataclass(frozen=True)
class TargetRow:
    key: str
    title: str
    limit: float
    values: dict[str, Union[TargetRatio, NotAvailable]]


@dataclass(frozen=True)
class Targets:
    """Every target in every fp32 case of the sweep."""

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
    """A restore of a snapshot with one flipped byte: "detected", "not detected" or "no effect"."""

    outcome: str
    how: str


@dataclass(frozen=True)
class Consistency:
    """``core.check_consistency``'s result."""

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
    """``json.dumps(results, default=to_json)``."""
    if isinstance(record, NotAvailable):
        return str(record)
    if not dataclasses.is_dataclass(record):
        raise TypeError(f"{type(record).__name__} is not a benchmark record")
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    if isinstance(record, Cell):
        extra = fields.pop("extra")
        return {**fields, **extra}
    return fields
