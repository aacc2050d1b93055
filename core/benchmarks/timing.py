"""The one timing loop of the benchmarks: sides measured in turn, round by round, the side that goes
first alternating every round (A B, then B A, then A B, ...).

A CPU's speed drifts within a run: it throttles after tens of seconds of load, and a shared machine's
neighbours move its memory bandwidth. Figures taken in separate runs, or all of one side first, compare
those phases, not the sides. Taking the sides in turn, in alternating order, lets every phase hit both
alike; a comparison is then the median (and min-max) of the per-round ratios (`ratios`, `Spread`),
never a ratio of separately taken medians.

Used by `examples/benchmark.py --ab`, the races in `examples/compare_llamacpp.py` and
`examples/compare_transformers.py`, and the measuring scripts in `scripts/`.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K")
T = TypeVar("T")


def side_order(sides: Sequence[str], round_index: int) -> list[str]:
    """The order in which round `round_index` (from 0) measures `sides`: as given in even rounds,
    reversed in odd ones."""
    return list(sides) if round_index % 2 == 0 else list(sides)[::-1]


def alternating_rounds(sides: Mapping[str, Callable[[K], T]], rounds: int, cases: Sequence[K] = (None,),
                       on_sample: Callable[[int, K, str, T], None] | None = None) -> dict[K, dict[str, list[T]]]:
    """Per case and side, one value per round: round r measures every case in turn, each case's
    sides in `side_order(sides, r)` (`sides[name](case)` returns the value); `on_sample(r, case,
    side, value)` is called after each measurement (e.g. to print it)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if not sides:
        raise ValueError("nothing to compare: no sides given")
    samples: dict[K, dict[str, list[T]]] = {case: {name: [] for name in sides} for case in cases}
    for r in range(rounds):
        for case in cases:
            for name in side_order(list(sides), r):
                value = sides[name](case)
                samples[case][name].append(value)
                if on_sample is not None:
                    on_sample(r, case, name, value)
    return samples


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """The per-round ratios numerator / denominator (a round whose denominator is not positive is
    left out: it measured nothing)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"per-round ratios need as many rounds on both sides ({len(numerators)} and "
                         f"{len(denominators)})")
    return [a / b for a, b in zip(numerators, denominators) if b > 0]


@dataclass(frozen=True)
class Spread:
    """The median of some values and their range."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Spread":
        values = list(values)
        if not values:
            raise ValueError("no values: every round failed or measured nothing")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, fmt: str = ".2f", unit: str = "x") -> str:
        """e.g. `1.23x (1.10-1.40)`; one value alone without its range."""
        median = f"{self.median:{fmt}}{unit}"
        return median if self.n == 1 else f"{median} ({self.low:{fmt}}-{self.high:{fmt}})"


def timed(fn: Callable[[], T], clock: Callable[[], float] = time.perf_counter) -> tuple[T, float]:
    """`fn()`'s value and the seconds it took on `clock`."""
    start = clock()
    value = fn()
    return value, clock() - start

