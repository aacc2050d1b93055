"""Per-call time of the cpu back end's fast paths (NativeCpuKernels: fused C kernels, oneDNN-packed
weights) against the pure-torch reference (CpuKernels), at decode (T = 1, 32) and prefill (T = 2048)
sizes of the `bench` checkpoint (hidden 1024, 4 mHC streams, 32 experts of 1024 x 512, top-4,
bf16). Weights are the same tensors call after call, so they sit in the caches: these are kernel
costs, not the streaming rates of a model step.

    python examples/bench/native_kernels.py [--threads 2] [--rounds 15]

The two implementations alternate call by call inside one process (this machine's speed drifts
with load and throttling), and each figure is the median over rounds of the mean of a burst of
calls. Prints a table; asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def cases(T: int, D: int = 1024, n: int = 4, heads: int = 16, head_dim: int = 128, rope_half: int = 16,
          dtype: torch.dtype = torch.bfloat16) -> dict:
    """name -> (method name, args): the shapes the model passes for one token block."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    streams = rand(T, n, D)
    angles = rand(T, rope_half, dt=torch.float32)
    cos, sin = angles.cos(), angles.sin()
    comb = torch.softmax(rand(T, n, n, dt=torch.float32), dim=-1)
    gate_up = rand(T, D)  # a fused expert gate/up product (moe_intermediate_size 512)
    experts, top_k = 32, 4
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(T)])
    rows, plan = CpuKernels().moe_dispatch(rand(T, D), ids, experts)
    w13, w2 = rand(experts, D, D) * 0.03, rand(experts, D, D // 2) * 0.03
    logits = rand(min(T, 32), 129_280, dt=torch.float32)
    return {
        "linear [T, 1024]": ("linear", (rand(T, D), rand(D, D))),
        "grouped_linear": ("grouped_linear", (rand(T, 4, D // 2), rand(4, D // 4, D // 2))),
        "moe_dispatch": ("moe_dispatch", (rand(T, D), ids, experts)),
        "moe_experts": ("moe_experts", (rows, plan, w13, w2, 10.0)),
        "moe_combine": ("moe_combine", (rows, plan, torch.rand(T, top_k, generator=g))),
        "argmax_lse [<=32, V]": ("argmax_logsumexp", (logits,)),
        "rms_norm [T, D] w": ("rms_norm", (rand(T, D), rand(D, dt=torch.float32), 1e-6)),
        "rotary [T, H, d] q": ("rotary", (rand(T, heads, head_dim), cos, sin, False)),
        "hc_pre [T, n, D]": ("hc_pre", (streams, rand(n * (n + 2), n * D, dt=torch.float32) * 0.02,
                                        rand(n * (n + 2), dt=torch.float32), rand(3, dt=torch.float32), 20,
                                        1e-6, 1e-6)),
        "hc_post [T, n, D]": ("hc_post", (rand(T, D), streams, torch.rand(T, n, generator=g) * 2, comb)),
        "swiglu [T, 512]": ("swiglu", (gate_up[:, :D // 2], gate_up[:, D // 2:], 10.0)),
    }


def per_call_us(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ref, nat = CpuKernels(), NativeCpuKernels()
    if nat.native_library is None:
        raise SystemExit("the native library is unavailable (see the warning above); nothing to compare")
    print(f"{args.threads} threads, bf16, medians of {args.rounds} alternating rounds (us per call)")
    print(f"{'kernel':<22}{'T':>6}{'torch':>12}{'native':>12}{'speed-up':>10}")
    for T, calls in ((1, 200), (32, 20), (2048, 3)):
        for name, (method, kernel_args) in cases(T).items():
            old_fn, new_fn = getattr(ref, method), getattr(nat, method)
            old_fn(*kernel_args), new_fn(*kernel_args)  # warm-up (allocator, first-touch)
            old, new = [], []
            for _ in range(args.rounds):
                old.append(per_call_us(old_fn, kernel_args, calls))
                new.append(per_call_us(new_fn, kernel_args, calls))
            o, n = statistics.median(old), statistics.median(new)
            print(f"{name:<22}{T:>6}{o:>12.1f}{n:>12.1f}{o / n:>9.2f}x")


if __name__ == "__main__":
    main()
