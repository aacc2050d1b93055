"""The decode products on the cpu back end with their packed weights on huge pages against 4 KB pages;
with --engine, whole batch-1 decode steps with and without huge pages.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_huge_pages.py [--shapes 129280x512] [--rows 1 16]
        [--rounds 16]
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_huge_pages.py --engine MODEL [--rounds 5] [--tokens 256]

For each shape it packs one random bf16 weight (native.pack_bf16: on huge pages from 4 MB) and copies
the packed weight onto plain 4 KB pages, then times `packed_linear_bf16` on the two copies alternating
(the order flips every round), 20 calls per round each. A weight larger than the last-level cache is
read from memory at every call, as a decode step reads it. It prints the median time per call of
each and the median of the per-round ratios (4 KB / huge; above 1: huge pages faster), and how much
of the process's anonymous memory the kernel did back with huge pages (`AnonHugePages`).

With --engine, each round starts two processes one after the other (the order flips every round), one
with DEEPINFER_CPU_HUGE_PAGES=0 and one with the default (`engine_ab.py`: each times batch-1 decode
steps, their forward and LM head). The figure to read is the rest of the forward (the layers), whose
weights, cache and activations the two processes place differently.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from deepinfer_plugins.cpu import huge_pages, native

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_ab import anon_huge_mb, engine_rounds  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["129280x512"], help="N x K (out x in)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--calls", type=int, default=20, help="calls per side per round")
    p.add_argument("--engine", metavar="MODEL", help="whole batch-1 decode steps on this checkpoint instead")
    p.add_argument("--tokens", type=int, default=256, help="--engine: tokens per timed generation")
    args = p.parse_args()
    if args.engine:
        return engine_rounds(args.engine, args.rounds, args.tokens, "DEEPINFER_CPU_HUGE_PAGES",
                             {"huge": "1", "4 KB": "0"})
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
