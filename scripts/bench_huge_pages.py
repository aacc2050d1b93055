"""The decode products on the cpu back end with their packed weights on huge pages against 4 KB pages.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_huge_pages.py [--shapes 129280x512] [--rows 1 16]
        [--rounds 16]

For each shape it packs one random bf16 weight (native.pack_bf16: on huge pages from 4 MB) and copies
the packed weight onto plain 4 KB pages, then times `packed_linear_bf16` on the two copies alternating
(the order flips every round), 20 calls per round each. A weight larger than the last-level cache is
read from memory at every call, as a decode step reads it. It prints the median time per call of
each and the median of the per-round ratios (4 KB / huge; above 1: huge pages faster), and how much
of the process's anonymous memory the kernel did back with huge pages (`AnonHugePages`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer_plugins.cpu import huge_pages, native


def anon_huge_mb() -> float:
    """Megabytes of this process's anonymous memory on huge pages (/proc/self/smaps_rollup)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["129280x512"], help="N x K (out x in)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--calls", type=int, default=20, help="calls per side per round")
    args = p.parse_args()
    lib = native.active_library()
    if lib is None:
        raise SystemExit("the cpu back end's C kernels are not available (see the warning above)")
    if not huge_pages.enabled():
        raise SystemExit("DEEPINFER_CPU_HUGE_PAGES=0: nothing to compare")
    print(f"tier {native.gemv_tier(lib)}, {torch.get_num_threads()} threads")
    for N, K in [tuple(int(v) for v in s.split("x")) for s in args.shapes]:
        huge = native.pack_bf16(lib, torch.randn(N, K).bfloat16())
        plain = torch.empty(huge.shape, dtype=huge.dtype)
        plain.copy_(huge)
        print(f"{N}x{K}: {huge.numel() * 2 / 2**20:.0f} MB packed; process AnonHugePages {anon_huge_mb():.0f} MB")
        for M in args.rows:
            x = torch.randn(M, K).bfloat16()
            sides = {"huge": huge, "4 KB": plain}
            if not torch.equal(native.packed_linear_bf16(lib, x, huge, (N, K)),
                               native.packed_linear_bf16(lib, x, plain, (N, K))):
                raise SystemExit("the two copies gave different bits")
            times: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        native.packed_linear_bf16(lib, x, sides[name], (N, K))
                    times[name].append((time.perf_counter() - t) / args.calls * 1e3)
            ratio = statistics.median(a / b for a, b in zip(times["4 KB"], times["huge"]))
            gb = huge.numel() * 2 / 1e9
            print(f"  M={M}: huge {statistics.median(times['huge']):.3f} ms "
                  f"({gb / statistics.median(times['huge']) * 1e3:.1f} GB/s), 4 KB "
                  f"{statistics.median(times['4 KB']):.3f} ms ({gb / statistics.median(times['4 KB']) * 1e3:.1f} GB/s); "
                  f"4 KB / huge {ratio:.3f} (min {min(a / b for a, b in zip(times['4 KB'], times['huge'])):.3f}, "
                  f"max {max(a / b for a, b in zip(times['4 KB'], times['huge'])):.3f})")


if __name__ == "__main__":
    main()
