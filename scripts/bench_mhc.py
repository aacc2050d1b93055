"""Per-call time of the cpu back end's mHC kernels (NativeCpuKernels: hc_pre_norm, hc_post, hc_head, and
between two sub-layers hc_post then hc_pre_norm against hc_post_pre_norm) on the shapes of the 161 M
benchmark checkpoint (n = 4 streams of 512, bf16 streams, fp32 weights).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_mhc.py [--rows 1,16,64] [--label NAME]

Best of 7 runs of many calls each, per call in microseconds; with one thread on this thread's CPU
time (steady on a shared machine), with more on wall time. A site's fn is the same tensor in every
call, so the transposed copy of multi-row calls is made once, as in a model.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def best_us(call: Callable[[], object], reps: int, clock: Callable[[], float]) -> float:
    call(), call()
    best = float("inf")
    for _ in range(7):
        start = clock()
        for _ in range(reps):
            call()
        best = min(best, (clock() - start) / reps)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64", help="token rows per call, comma-separated")
    p.add_argument("--label", default="", help="printed in front of the figures")
    args = p.parse_args()
    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        raise SystemExit("the C kernels did not build (see the warning above); nothing to measure")
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    n, D = 4, 512
    fn, base = torch.randn(24, n * D, generator=g) * 0.02, torch.randn(24, generator=g) * 0.1
    scale, norm = torch.tensor([1.0, 0.5, 0.7]), torch.ones(D)
    head_fn, head_base = torch.randn(4, n * D, generator=g) * 0.02, torch.randn(4, generator=g)
    head_scale = torch.tensor([0.3])
    figures = []
    for T in (int(r) for r in args.rows.split(",")):
        streams, y = torch.randn(T, n, D, generator=g).bfloat16(), torch.randn(T, D, generator=g).bfloat16()
        reps = max(100, 3000 // T)
        _, post, comb = kernels.hc_pre_norm(streams, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-6)
        pre = best_us(lambda: kernels.hc_pre_norm(streams, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-6), reps, clock)
        post_us = best_us(lambda: kernels.hc_post(y, streams, post, comb), reps, clock)
        head = best_us(lambda: kernels.hc_head(streams, head_fn, head_base, head_scale, 1e-6, 1e-6), reps, clock)
        site = (fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-6)
        two = best_us(lambda: kernels.hc_pre_norm(kernels.hc_post(y, streams, post, comb), *site), reps, clock)
        one = best_us(lambda: kernels.hc_post_pre_norm(y, streams, post, comb, *site), reps, clock)
        figures.append(f"{T} rows: hc_pre_norm {pre:.1f} hc_post {post_us:.1f} hc_head {head:.1f}; between two "
                       f"sub-layers: hc_post + hc_pre_norm {two:.1f}, hc_post_pre_norm {one:.1f}")
    print(f"{args.label} {torch.get_num_threads()} thread(s), us per call: " + " | ".join(figures))


if __name__ == "__main__":
    main()
