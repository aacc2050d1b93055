"""Shared rules for a model family's op table (the ops a back end may replace).

A family defines a base class of plain-torch ops; a back end returns an instance of a subclass of
it from `Accelerator.model_ops(family)`. The two checks here are what every family enforces."""

from __future__ import annotations

import inspect
from typing import TypeVar

T = TypeVar("T")


def check_op_signatures(base: type, cls: type, names: tuple[str, ...]) -> None:
    """Refuse (TypeError) a subclass `cls` of `base` whose override of one of `names` takes other
    parameters: the model calls the ops by keyword, so a renamed parameter would fail at run time."""
    for name in names:
        want = [(p.name, p.kind) for p in inspect.signature(getattr(base, name)).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(cls, name)).parameters.values()]
        if want != got:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{name} has signature "
                            f"({', '.join(n for n, _ in got)}) but {base.__qualname__}.{name} requires "
                            f"({', '.join(n for n, _ in want)})")


def resolve_op_table(accelerator: object, family: str, base: type[T]) -> T:
    """The back end's op table for `family` if it declares one (`model_ops(family)`), else the defaults
    `base(accelerator)` over its generic ops (`base()`, plain torch, for an object that has none)."""
    from deepinfer.accelerator.interface import SmallOps

    declare = getattr(accelerator, "model_ops", None)
    table = declare(family) if callable(declare) else None
    if table is None:
        return base(accelerator) if isinstance(accelerator, SmallOps) else base()
    if not isinstance(table, base):
        name = getattr(accelerator, "name", type(accelerator).__name__)
        raise TypeError(f"back end {name!r} returned a {type(table).__name__} from model_ops({family!r}); it must "
                        f"be an instance of a subclass of {base.__module__}.{base.__qualname__}")
    return table
