"""Time the cpu back end's kernels for one bf16 linear of a few rows, on this CPU: the register tiles over
their packed copy (native/packed_gemm.c), AMX tiles (where usable) and oneDNN's packed copy (where torch has
its bf16 kernel), alternating in one run, on cold weights (enough copies of each shape to pass --cold_mb).

    python scripts/bench_linear_paths.py                              # the model shapes, 1-64 rows
    python scripts/bench_linear_paths.py --shapes 4096x1024 --rows 8,16,32 --rounds 5

It prints one markdown row per shape and row count: each path's median time per product (min-max over
the rounds) and which is fastest. The row thresholds of `plugins/cpu/tuning.py` (`packed_gemm_rows`,
`linear_amx_max_rows`) are set from these figures (docs/performance.md, "The cpu back end's tuning
thresholds").
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from deepinfer.benchmarks.timing import Spread, alternating_rounds, timed
from deepinfer_plugins.cpu import native, packed_weights
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def _shape(text: str) -> tuple[int, int]:
    n, k = (int(v) for v in text.lower().split("x"))
    return n, k


def paths(lib, weights: list[torch.Tensor]) -> dict[str, Callable[[torch.Tensor], None]]:
    """Each available path as `run(x)`: one product of `x` by every weight (their copies made here)."""
    found = {}
    tiles = [native.pack_bf16(lib, w) for w in weights]
    if all(t is not None for t in tiles):
        found["tiles"] = lambda x: [native.packed_linear_bf16(lib, x, t, w.shape) for w, t in zip(weights, tiles)]
    if native.linear_amx_bf16(lib, weights[0][:1].clone(), weights[0]) is not None:  # usable, and the shape fits
        found["amx"] = lambda x: [native.linear_amx_bf16(lib, x, w) for w in weights]
    if packed_weights.onednn_bf16():
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
        found["onednn"] = lambda x: [packed_weights.linear(x, p) for p in onednn]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1024x1024,2048x384,4096x1024", help="weights N x K, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16,32,48,64", help="row counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (the median is printed)")
    p.add_argument("--cold_mb", type=int, default=300, help="megabytes of distinct weights cycled per shape")
    args = p.parse_args(argv)
    lib = NativeCpuKernels().native_library
    if lib is None:
        print("the cpu back end's C library is not available (DEEPINFER_CPU_NATIVE=0 or no C compiler)")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    print(f"tier {native.gemv_tier(lib)}, AMX {'usable' if native.amx_usable(lib) else 'no'}, "
          f"{torch.get_num_threads()} threads; microseconds per product, median (min-max) of {args.rounds} rounds")
    print("| weight | rows | " + " | ".join(("tiles", "amx", "onednn")) + " | fastest |")
    print("|---|---|---|---|---|---|")
    for n, k in map(_shape, args.shapes.split(",")):
        count = max(2, (args.cold_mb << 20) // (n * k * 2))
        weights = [torch.randn(n, k).bfloat16() for _ in range(count)]
        sides = paths(lib, weights)
        xs = {m: torch.randn(m, k).bfloat16() for m in rows}
        for run in sides.values():  # warm: every kernel of every row count compiled or dispatched once
            for x in xs.values():
                run(x)
        samples = alternating_rounds({name: (lambda m, run=run: timed(lambda: run(xs[m]))[1] / count * 1e6)
                                      for name, run in sides.items()}, args.rounds, rows)
        for m in rows:
            spreads = {name: Spread.of(samples[m][name]) for name in sides}
            cells = [f"{spreads[s].median:.0f} ({spreads[s].low:.0f}-{spreads[s].high:.0f})" if s in spreads else "-"
                     for s in ("tiles", "amx", "onednn")]
            print(f"| {n} x {k} | {m} | " + " | ".join(cells) + f" | {min(spreads, key=lambda s: spreads[s].median)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
