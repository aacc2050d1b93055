"""Decode products on weights kept quantised vs the bf16 product the cpu back end runs otherwise.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_quant_gemv.py [--out 4096] [--in 4096] [--rows 1 4 16]

For each row count it times, alternating in every round, the cpu back end's `linear` on a bf16 weight
(its decode GEMV path), on the same weight as FP8 e4m3 128x128 blocks and as FP4 e2m1 (per-32
ue8m0 scales) through the C kernel on the codes (`quant_gemv.c`), and the dequantise-a-tile path the
back end used before that kernel; it prints the median time per call, the weight bytes each path
streams, the effective GB/s and the ratio to bf16.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.accelerator.reference import quantized_linear
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def weights(out: int, inp: int) -> dict[str, torch.Tensor | QuantizedWeight]:
    g = torch.Generator().manual_seed(0)
    fp8 = torch.randint(0, 256, (out, inp), generator=g, dtype=torch.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0x7E
    fp8_scale = torch.randint(110, 125, (-(-out // 128), -(-inp // 128)), generator=g, dtype=torch.uint8)
    fp4 = torch.randint(0, 256, (out, inp // 2), generator=g, dtype=torch.uint8)
    fp4_scale = torch.randint(118, 125, (out, inp // 32), generator=g, dtype=torch.uint8)
    q8 = QuantizedWeight(fp8.view(torch.float8_e4m3fn), fp8_scale.view(torch.float8_e8m0fnu), 128, torch.bfloat16)
    q4 = QuantizedWeight(fp4, fp4_scale.view(torch.float8_e8m0fnu), 128, torch.bfloat16)
    return {"bf16": q8.dequantize(torch.bfloat16).contiguous(), "fp8": q8, "fp4": q4}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=int, default=4096)
    p.add_argument("--in", dest="inp", type=int, default=4096)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls timed per round and path")
    args = p.parse_args()
    kernels, w = NativeCpuKernels(), weights(args.out, args.inp)
    if kernels.native_library is None:
        raise SystemExit("the cpu back end's C kernels are not available (see the warning above)")
    paths = {
        "bf16": lambda x: kernels.linear(x, w["bf16"]),
        "fp8 codes": lambda x: kernels.linear(x, w["fp8"]),
        "fp4 codes": lambda x: kernels.linear(x, w["fp4"]),
        "fp4 dequantise-tile": lambda x: quantized_linear(x, w["fp4"], kernels.linear),
    }
    streamed = {"bf16": w["bf16"].nbytes, "fp8 codes": w["fp8"].nbytes, "fp4 codes": w["fp4"].nbytes,
                "fp4 dequantise-tile": w["fp4"].nbytes + 2 * w["bf16"].nbytes}
    print(f"weight {args.out} x {args.inp}, {torch.get_num_threads()} threads")
    for rows in args.rows:
        x = torch.randn(rows, args.inp).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():  # alternate the paths within every round
                fn(x)
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(x)
                times[name].append((time.perf_counter() - start) / args.calls)
        base = statistics.median(times["bf16"])
        print(f"\nrows {rows}: path, median us/call, MB streamed, GB/s, speed vs bf16")
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"  {name:20s} {t * 1e6:9.1f} {streamed[name] / 1e6:8.1f} {streamed[name] / t / 1e9:6.1f}"
                  f"  {base / t:5.2f}x")


if __name__ == "__main__":
    main()
