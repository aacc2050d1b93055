"""What the binding modules (one per C file) share: `Kernel`, one C function with its ctypes prototype
read from its definition in the C sources (each signature written once, in C), and the small tensor
helpers of their wrappers.

A wrapper takes torch tensors, checks once that they are what the C code handles (device, dtype,
layout, shape) and returns new tensors, or None so that the caller falls back to the reference
kernel. Where a wrapper would only make its `*_arguments` function's checked call (a `Bound`), callers
make it with `run(lib, foo_arguments(...))`. Decode calls are a few microseconds, so the checks use
the cheapest tensor queries.
"""
from __future__ import annotations

import ctypes
import functools
import keyword
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

# the C files' `dtype` codes (common.h: DT_F32, DT_BF16)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

# Every Kernel declared so far, in declaration order: build._load gives each its prototype.
KERNELS: list[Kernel] = []

# C types of the kernels' scalar arguments and results (any pointer is a c_void_p; a returned string a c_char_p)
_C_SCALARS = {"void": None, "int": ctypes.c_int, "long": ctypes.c_long, "int64_t": ctypes.c_long,
              "float": ctypes.c_float, "double": ctypes.c_double}
_QUALIFIERS = {"const", "restrict", "extern"}


class Kernel:
    """A C function of the library: `Kernel("rms_norm")` reads its prototype from its definition in the C
    sources (`signature`); `kernel(lib, x=..., rows=...)` calls it with exactly those arguments, by their C
    names (TypeError otherwise).

    Each kernel is an instance of its own subclass whose `__call__` is written out for its argument
    names (`def __call__(self, lib, *, x, rows, ...): return lib.rms_norm(x, rows, ...)`): the
    interpreter then matches the keywords itself, ~1.2 us less per call than collecting them in a dict
    and ordering them in Python (a decode step makes ~100 calls)."""

    def __new__(cls, name: str) -> Kernel:
        restype, arguments = signature(name)
        kernel = super().__new__(type(f"Kernel_{name}", (cls,), {"__call__": _keyword_call(name, tuple(arguments))}))
        kernel.name, kernel.restype, kernel.arguments = name, restype, arguments
        KERNELS.append(kernel)
        return kernel

    def declare(self, lib: ctypes.CDLL) -> None:
        fn = getattr(lib, self.name)
        fn.argtypes, fn.restype = tuple(self.arguments.values()), self.restype

    def __call__(self, lib: ctypes.CDLL, **values: Any) -> Any:  # replaced per kernel (see the class doc)
        raise NotImplementedError


@functools.cache
def _c_sources() -> str:
    return "\n".join(path.read_text() for path in sorted(Path(__file__).parent.glob("*.c")))


def signature(name: str) -> tuple[Any, dict[str, Any]]:
    """The ctypes result type and arguments (C names in C order -> ctypes types) of the C function `name`,
    read from its non-static definition in this package's C files (alternatives under `#if` must agree). An
    argument named like a Python keyword takes a trailing underscore (`in` -> `in_`)."""
    found = {(result, " ".join(params.split())) for result, params in re.findall(
        rf"^([\w \t*]*?)\b{re.escape(name)}\s*\(([^)]*)\)\s*{{", _c_sources(), re.M) if "static" not in result.split()}
    if len(found) != 1:
        raise LookupError(f"C kernel {name!r}: {len(found)} distinct definitions in {Path(__file__).parent}/*.c, "
                          f"expected one")
    (result, params), = found
    arguments = {}
    for param in (p.strip() for p in params.split(",")):
        if param and param != "void":
            arg = re.findall(r"\w+", param)[-1]
            arguments[arg + "_" if keyword.iskeyword(arg) else arg] = _c_type(name, param[:param.rindex(arg)])
    return _c_type(name, result, returned=True), arguments


def _c_type(kernel: str, declared: str, returned: bool = False) -> Any:
    words = [w for w in re.findall(r"\w+", declared) if w not in _QUALIFIERS]
    if "*" in declared:
        return ctypes.c_char_p if returned and words == ["char"] else ctypes.c_void_p
    if len(words) != 1 or words[0] not in _C_SCALARS:
        raise TypeError(f"C kernel {kernel!r}: no ctypes type for {declared.strip()!r}")
    return _C_SCALARS[words[0]]


class Bound(NamedTuple):
    """A wrapper's call, checked and not yet made: the kernel, its argument values, what the wrapper
    returns and the tensors made for the call (alive until it returns). `call` makes it once, `prepared`
    keeps it for repeating (a decode block's calls, decode_block.py)."""

    kernel: Kernel
    values: dict[str, Any]
    outputs: Any = None
    held: tuple = ()

    def call(self, lib: ctypes.CDLL) -> Any:
        return self.kernel(lib, **self.values)

    def prepared(self, lib: ctypes.CDLL) -> PreparedCall:
        return PreparedCall(lib, self.kernel, self.values, (self.outputs, self.held))


def run(lib: ctypes.CDLL, bound: Bound | None) -> Any | None:
    """A `*_arguments` function's checked call made once: its outputs, or None where it returned None (the
    input is not handled: the caller falls back)."""
    if bound is None:
        return None
    bound.call(lib)
    return bound.outputs


class PreparedCall:
    """One kernel call with every argument bound, to be made again and again: a caller that repeats it on
    other inputs of the same shapes replaces those arguments in place (`arguments[index(name)] = value`)
    and calls it. `held`: the tensors its bound addresses point into, kept alive with it."""

    __slots__ = ("function", "arguments", "names", "held")

    def __init__(self, lib: ctypes.CDLL, kernel: Kernel, values: dict[str, Any], held: tuple = ()):
        if set(values) != set(kernel.arguments):
            raise TypeError(f"{kernel.name}: arguments {sorted(values)} are not its parameters "
                            f"{list(kernel.arguments)}")
        self.function = getattr(lib, kernel.name)
        self.names = tuple(kernel.arguments)
        self.arguments = [values[n] for n in self.names]
        self.held = held

    def index(self, name: str) -> int:
        return self.names.index(name)

    def __call__(self) -> Any:
        return self.function(*self.arguments)


def _keyword_call(name: str, arguments: tuple[str, ...]) -> Any:
    """`__call__(self, lib, *, a, b, ...)` -> `lib.name(a, b, ...)` for these names."""
    if not name.isidentifier() or not all(a.isidentifier() for a in arguments):
        raise ValueError(f"kernel and argument names must be identifiers: {name}({', '.join(arguments)})")
    params = ", ".join(arguments)
    keywords = f", *, {params}" if arguments else ""
    namespace: dict[str, Any] = {}
    exec(f"def {name}(self, lib{keywords}):\n    return lib.{name}({params})\n", namespace)  # names checked above
    return namespace[name]  # named after the kernel: a TypeError then reads "rms_norm() missing ..."


def dtype_code(t: torch.Tensor) -> int | None:
    """The C dtype code of a CPU tensor that needs no gradient, else None (not handled)."""
    return DTYPE_CODES.get(t.dtype) if t.is_cpu and not t.requires_grad else None


def f32(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous fp32 tensor (t itself when it already is one)."""
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.detach().float().contiguous()


def new_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def threads() -> int:
    return torch.get_num_threads()
