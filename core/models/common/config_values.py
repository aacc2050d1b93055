"""Type and range checks of config.json values, shared by every family's config parser.

A `Range` describes one numeric setting; `range_problems` checks a dict of them and `report` joins
the problems into one message prefixed with the file (one problem: one line; several: a list).
bool is never a number here, integers must be JSON integers and floats finite numbers.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """The type and bounds of one numeric setting. Bounds are inclusive except a `low` with
    `open_low`; float settings must also be finite. bool is never a number here."""

    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    open_low: bool = False

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        lo, hi = plain_number(self.low), plain_number(self.high)
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.open_low else '['}{lo}, {hi}]"
        if self.low is not None:
            return f"{what} {'>' if self.open_low else '>='} {lo}"
        return what if self.high is None else f"{what} <= {hi}"

    def problem(self, key: str, value: Any) -> str | None:
        """None when `value` is valid, else a sentence naming the key, the value and the range."""
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not number or (self.kind is int and not isinstance(value, numbers.Integral)):
            return f"{key} = {show_value(value)} has the wrong type ({type_name(value)}): must be {self.describe()}"
        below = self.low is not None and (value < self.low or (self.open_low and value == self.low))
        above = self.high is not None and value > self.high
        if below or above or (self.kind is float and not math.isfinite(value)):
            return f"{key} = {show_value(value)} is out of range: must be {self.describe()}"
        return None


def plain_number(x: float | None) -> str:
    return "" if x is None else str(int(x)) if float(x).is_integer() else repr(x)


def show_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def type_name(value: Any) -> str:
    """How a JSON value is called in messages: "a list", "a string", "null", ..."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a bool"), (str, "a string"), (dict, "an object"), ((list, tuple), "a list"),
                       (numbers.Integral, "an integer"), (numbers.Real, "a float")):
        if isinstance(value, kind):
            return name
    return f"a {type(value).__name__}"


def range_problems(data: dict[str, Any], ranges: dict[str, Range]) -> list[str]:
    """One sentence per key of `ranges` present in `data` whose value is invalid."""
    return [p for k, r in ranges.items() if k in data and (p := r.problem(k, data[k])) is not None]


def report(source: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return f"{source} has {len(problems)} invalid settings:\n" + "\n".join(f"  {p}" for p in problems)
