"""The cpu back end's C kernels built from another checkout's sources, for a benchmark that times them
against this checkout's in ONE process, alternating (a shared machine makes separate processes' figures
swing): `--baseline /path/to/other/checkout` in scripts/bench_packed_gemm.py and bench_moe_layer.py.
The library is compiled with this process's flags and build switch (DEEPINFER_CPU_NATIVE_ISA) into the
same guarded cache, and gets this checkout's ctypes prototypes (the kernels timed must keep their
signatures)."""
from __future__ import annotations

import ctypes
from pathlib import Path

from deepinfer_plugins.cpu.native import build


def baseline_library(checkout: str) -> ctypes.CDLL:
    """The library of `checkout`'s plugins/cpu/native C files (the same file names as this checkout's)."""
    here = Path(checkout).expanduser().resolve() / "plugins" / "cpu" / "native"
    missing = [p.name for p in build.SOURCES if not (here / p.name).is_file()]
    if missing:
        raise SystemExit(f"--baseline {checkout}: {here} lacks {', '.join(missing)}; give the root of a checkout "
                         f"of this project whose C kernels have the same files")
    sources, headers = build.SOURCES, build.HEADERS
    build.SOURCES = tuple(here / p.name for p in sources)
    # its own headers (a header this checkout added is not included by the other's sources)
    build.HEADERS = tuple(here / p.name for p in headers if (here / p.name).is_file())
    try:
        return build._load(build._build())
    finally:
        build.SOURCES, build.HEADERS = sources, headers
