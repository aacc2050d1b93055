"""Step programs: the seam between a model's hot step and a back end's fast paths.

The model lowers, the back end prepares. A model family describes a step it runs again and again
(a decode step of T tokens) as a `Program`: an ordered list of `Call`s over named values, built
once by the model's own modules (`Builder`). The engine's default runs it eagerly, call by call
(`Program.run`: the same op calls, on the same tensors, as the modules make one by one, so the
same bits). A back end may prepare it instead (`Accelerator.prepare_program`): bind each call it
has a fast version of once, with its outputs in buffers it owns, and replay the whole list every
step, touching only the values that change (the step's inputs). The cpu back end binds its C
calls this way; a GPU back end would capture the calls into a graph per batch-size bucket.

A call is one of:
- an op of a table, named `"<table>.<op>"` (`"ops.hc_pre_norm"`: the family's op table;
  `"kernels.moe_sublayer"`: the accelerator's generic ops). These are what a back end binds: it
  knows their signatures, and the tables are the contract;
- any other callable (a module's own torch code: pooling when a window completes, the indexer's
  selection, an expert-parallel exchange). It runs as is, in its place, under every back end.

Values are `Ref`s: a program input, read from the step before each run (`Builder.input`, with a
function of the step), or an output of an earlier call. Anything else in a call's arguments is a
constant of the program (weights, cache tensors, shapes, epsilons): a prepared program may keep
its address. So a program is valid for one binding of the model's weights and cache; the model
builds a new one after `bind_cache` or `load_weights`.

Rules a model keeps so that a back end may prepare its programs:
- a call's results depend only on its arguments (and the constants' contents); a call may write
  into a constant it is given (a cache tensor) but into no Ref it did not produce;
- every input is read by the step function alone, and has the same shape, dtype and layout on
  every step, except where the op's own signature says a dimension may vary (rows of attention
  keys, say); a back end checks what it relies on and falls back to the eager call otherwise;
- a call marked `view=True` returns views of its Ref arguments (it reads no values), so a back
  end that owns those arguments' storage may make the views once.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Ref:
    """A named value of a program: an input, or an output of one of its calls."""

    name: str


@dataclass(frozen=True)
class Call:
    """One call of a program: `op` ("<table>.<op>" or a callable) with keyword `args` (Refs, tuples of
    them, or constants); its results are bound to `outs` (one name per element when it returns a
    tuple; one name for a single value; none for a call run for its side effects)."""

    op: str | Callable[..., Any]
    args: Mapping[str, Any]
    outs: tuple[str, ...] = ()
    view: bool = False

    @property
    def name(self) -> str:
        """The op's name, for errors and listings."""
        return self.op if isinstance(self.op, str) else getattr(self.op, "__qualname__", repr(self.op))

    def refs(self) -> list[str]:
        """The names this call reads, in argument order."""
        return [r.name for value in self.args.values() for r in _refs(value)]


def _refs(value: Any) -> Iterable[Ref]:
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, tuple):
        for v in value:
            yield from _refs(v)


def resolve(value: Any, env: Mapping[str, Any]) -> Any:
    """`value` with every Ref replaced by its value in `env` (tuples element by element)."""
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, tuple):
        return tuple(resolve(v, env) for v in value)
    return value


@dataclass(frozen=True)
class Program:
    """A step as calls over named values; see the module doc."""

    tables: Mapping[str, object]  # table name -> the object whose methods the "table.op" calls name
    inputs: Mapping[str, Callable[[Any], Any] | None]  # input name -> its value of a step (None: given to run)
    calls: tuple[Call, ...]
    outputs: tuple[str, ...]
    key: Any = None  # what the model built it for (e.g. ("decode", tokens)), for listings and caches

    def op(self, call: Call) -> Callable[..., Any]:
        """The function a call runs."""
        if not isinstance(call.op, str):
            return call.op
        table, _, name = call.op.partition(".")
        return getattr(self.tables[table], name)

    def feed(self, step: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        """The inputs' values: read from `step`, or `given` for those declared without a function."""
        return {name: given[name] if get is None else get(step) for name, get in self.inputs.items()}

    def run(self, step: Any, **given: Any) -> tuple[Any, ...]:
        """Every call in order, eagerly: the engine's default, and the spec of any prepared form."""
        env = self.feed(step, given)
        for call in self.calls:
            bind_outputs(call, self.op(call)(**{k: resolve(v, env) for k, v in call.args.items()}), env)
        return tuple(env[name] for name in self.outputs)


def bind_outputs(call: Call, result: Any, env: dict[str, Any]) -> None:
    """Store a call's result under its output names."""
    if len(call.outs) == 1:
        env[call.outs[0]] = result
    elif call.outs:
        if not isinstance(result, tuple) or len(result) != len(call.outs):
            raise TypeError(f"{call.name} returned {type(result).__name__}, not the {len(call.outs)} values "
                            f"{call.outs} its program expects")
        env.update(zip(call.outs, result))


class Runnable(Protocol):
    """What `Accelerator.prepare_program` returns: the program's results for a step, the same
    values (and, for the calls it binds, the same bits) as `Program.run`."""

    def run(self, step: Any, **given: Any) -> tuple[Any, ...]: ...


class Programs:
    """A model's programs, each built on first use (`get`) and prepared by its back end
    (`Accelerator.prepare_program`, else run eagerly); `clear` drops them all when the model's weights
    or cache change (their calls hold those tensors)."""

    def __init__(self, accelerator: object):
        self.accelerator = accelerator
        self._by_key: dict[Any, Program | Runnable] = {}

    def get(self, key: Any, build: Callable[[], Program]) -> Program | Runnable:
        runnable = self._by_key.get(key)
        if runnable is None:
            program = build()
            prepare = getattr(self.accelerator, "prepare_program", None)
            runnable = self._by_key[key] = (prepare(program) if callable(prepare) else None) or program
        return runnable

    def clear(self) -> None:
        self._by_key.clear()


class Builder:
    """Builds a program: `input` declares a value read from the step, `call` appends a call and
    returns Refs to its results; names are made unique with a running number."""

    def __init__(self, tables: Mapping[str, object]):
        self.tables = dict(tables)
        self.inputs: dict[str, Callable[[Any], Any] | None] = {}
        self.calls: list[Call] = []
        self._count = 0

    def input(self, name: str, get: Callable[[Any], Any] | None = None) -> Ref:
        """The step's value `get(step)`, read once per run under `name` (the same name, the same input);
        without `get`, a value the caller gives to `run` under that name."""
        if name not in self.inputs:
            self.inputs[name] = get
        return Ref(name)

    def call(self, op: str | Callable[..., Any], outs: int | tuple[str, ...] = 1, view: bool = False,
             **args: Any) -> Any:
        """Append `op(**args)`; `outs`: how many results it returns (or their names). Returns a Ref to
        its one result, a tuple of Refs to several, or None (`outs` = 0)."""
        if isinstance(op, str):
            table, _, name = op.partition(".")
            if table not in self.tables or not callable(getattr(self.tables[table], name, None)):
                raise ValueError(f"program call {op!r}: no op {name!r} in table {table!r} "
                                 f"(tables: {', '.join(self.tables)})")
        label = op.rpartition(".")[2] if isinstance(op, str) else getattr(op, "__name__", "call")
        if isinstance(outs, int):
            outs = tuple(f"{label}.{i}" for i in range(outs))
        self._count += 1
        names = tuple(f"{n}#{self._count}" for n in outs)
        self.calls.append(Call(op, dict(args), names, view))
        refs = tuple(Ref(n) for n in names)
        return None if not refs else refs[0] if len(refs) == 1 else refs

    def build(self, outputs: tuple[Ref, ...], key: Any = None) -> Program:
        known = set(self.inputs)
        for call in self.calls:
            missing = [n for n in call.refs() if n not in known]
            if missing:
                raise ValueError(f"program call {call.name} reads {missing} before anything produces them")
            known.update(call.outs)
        absent = [r.name for r in outputs if r.name not in known]
        if absent:
            raise ValueError(f"program outputs {absent} are produced by no call")
        return Program(dict(self.tables), dict(self.inputs), tuple(self.calls), tuple(r.name for r in outputs), key)


__all__ = ["Builder", "Call", "Program", "Programs", "Ref", "Runnable", "bind_outputs", "resolve"]
