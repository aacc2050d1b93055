"""The bf16 products of decode batches on the cpu back end: the C register tiles on packed weights
(packed_gemm.c) against oneDNN's packed GEMM, torch's F.linear and the C multi-token GEMV, cold weights.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_packed_gemm.py [--shapes 129280x512 4096x512 512x2048]
        [--rows 1 4 8 16 32 64] [--cold-mb 300] [--baseline /path/to/other/checkout]

For each shape it makes enough distinct weights to fill `--cold-mb` (so every call reads its weight
from memory, as a decode step does), packs each for both GEMMs, and for each row count times the
paths alternating in every round, a call per weight in turn; it prints the median time per call,
GFLOP/s, the weight's GB/s and each path's ratio to the packed C kernel. M = 1 adds the one-token
GEMV. `--baseline` adds the packed C kernel built from another checkout's sources (baseline_library.py),
alternating with this one's in the same process, and checks that both give the same bits. `--peak` first times vdpbf16ps-bound work (a weight panel that stays in L1) for the ceiling.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer_plugins.cpu import native, packed_weights
from deepinfer_plugins.cpu.kernels import _pad_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["129280x512", "4096x512", "512x2048"], help="N x K (out x in)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--cold-mb", type=int, default=300, help="raw weight megabytes cycled through per shape")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--peak", action="store_true", help="also time a 64 x 512 weight that stays in L1/L2")
    p.add_argument("--baseline", help="root of another checkout: also time its packed C kernel")
    args = p.parse_args()
    lib = native.active_library()
    if lib is None:
        raise SystemExit("the cpu back end's C kernels are not available (see the warning above)")
    base_lib = None
    if args.baseline:
        from baseline_library import baseline_library
        base_lib = baseline_library(args.baseline)
    onednn = packed_weights.available()
    print(f"tier {native.gemv_tier(lib)}, {torch.get_num_threads()} threads, oneDNN packed: {onednn}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] + ([(64, 512)] if args.peak else [])
    for N, K in shapes:
        copies = max(1, args.cold_mb * 2**20 // (N * K * 2)) if (N, K) != (64, 512) else 1
        ws = [torch.randn(N, K).bfloat16() for _ in range(copies)]
        cs = [native.pack_bf16(lib, w) for w in ws]
        ds = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] if onednn else []
        for M in args.rows:
            x = torch.randn(M, K).bfloat16()
            paths = {"packed C": lambda i: native.packed_linear_bf16(lib, x, cs[i], (N, K)),
                     "gemv_tokens": lambda i: native.gemv_tokens_bf16(lib, x, ws[i])}
            paths["torch F.linear"] = lambda i: torch.nn.functional.linear(x, ws[i])
            if onednn:
                paths["oneDNN packed"] = lambda i: packed_weights.linear(_pad_rows(x), ds[i])[:M]
            if base_lib is not None:
                paths["baseline packed C"] = lambda i: native.packed_linear_bf16(base_lib, x, cs[i], (N, K))
                if not torch.equal(paths["baseline packed C"](0), paths["packed C"](0)):
                    print(f"{N}x{K} M={M}: the baseline's packed C kernel gives other bits")
            if M == 1:
                paths["gemv"] = lambda i: native.gemv_bf16(lib, ws[i], x[0])
            calls = max(copies, 8 if N * K > 10**7 else 64)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for fn in paths.values():
                fn(0)
            for r in range(args.rounds):  # every other round in reverse: no path always follows another
                for name, fn in (list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]):
                    t0 = time.perf_counter()
                    for c in range(calls):
                        fn(c % copies)
                    times[name].append((time.perf_counter() - t0) / calls)
            base = statistics.median(times["packed C"])
            cells = []
            for name, ts in times.items():
                t = statistics.median(ts)
                cells.append(f"{name} {t * 1e3:.3f} ms ({2 * M * N * K / t / 1e9:.0f} GFLOP/s, "
                             f"{N * K * 2 / t / 1e9:.1f} GB/s, C/this {t / base:.2f}x)")
            print(f"{N}x{K} M={M} ({copies} weights): " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
